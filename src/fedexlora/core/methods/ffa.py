"""FFA-LoRA: A frozen and shared by every client; only B is trained and averaged (exact)."""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec


def is_shared(X: torch.Tensor, atol: float) -> bool:
    """Whether every client's copy of a stacked factor ``X`` (``(k, ...)``) is the same."""
    return (X - X[0]).abs().amax().item() <= atol + 1e-5 * X[0].abs().amax().item()


def check_shared_A(A: torch.Tensor, atol: float, method: str) -> None:
    """Raises ``ValueError`` unless every client's A (stacked, ``(k, r, n)``) is the same.

    Clients that keep A frozen send none; the server fills in the global A, so a
    difference means a client trained it.
    """
    if not is_shared(A, atol):
        spread = (A - A[0]).abs().amax().item()
        raise ValueError(
            f"{method} requires every client to share the frozen A, but the clients' A "
            f"differ by up to {spread:.3g}; was A trained?"
        )


def shared_A_aggregate(
    A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6, method: str = "ffa"
):
    """The shared A and ``B̄``: exact, since the update ``B A`` is linear in B.

    ``method``: the method named in the error (Fed-SB aggregates by this rule too).

    Raises:
        ValueError: If the clients' A differ (A was trained).
    """
    del out_dtype, generator
    k, r, n = A.shape
    d = B.shape[1]
    check_shared_A(A, atol, method)
    B_new = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    return A[0].clone(), B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="ffa",
    title="FFA-LoRA",
    paper="Sun et al., ICLR 2024 (arXiv 2403.12313)",
    trains="B (A frozen, shared from the seed)",
    keeps_local="nothing",
    uploads="B_i",
    downloads="B̄",
    exact=True,
    linear=True,
    bytes_per_round="up 4krd; down 4krd",
    aggregate=shared_A_aggregate,
    frozen_A=True,
    claims=(("fedit", "FFA-LoRA ahead of FedIT under DP (FFA-LoRA, ICLR 2024)"),),
)
