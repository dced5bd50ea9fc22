"""RoLoRA: alternating rounds, B then A, each averaged while the other is shared.

Chen et al., "Robust federated finetuning of LLMs via alternating optimization of LoRA"
(arXiv 2502.01755; code: the paper's supplement, a FederatedScope fork). Odd rounds train
B with A frozen, even rounds train A with B frozen (B first: with B = 0 at the start, A's
gradient is zero). Clients upload only the factor they trained and the server averages
it: ``Σ p_i B_i A = B̄ A`` and ``Σ p_i B A_i = B Ā``, so every round is exact with no
residual. Clients receive both factors. ``alternating`` says all of it: the round plan
(:meth:`~fedexlora.core.methods.spec.MethodSpec.plan`) freezes the other factor on every
client and uploads the trained one, with no hook of the method's.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.ffa import is_shared
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """The weighted mean of the trained factor; the frozen one is shared and kept.

    Raises:
        ValueError: If neither factor is the same on every client (both were trained).
    """
    del out_dtype, generator
    k, r, n = A.shape
    d = B.shape[1]

    if not is_shared(A, atol) and not is_shared(B, atol):
        raise ValueError(
            "rolora requires one factor shared by every client (B frozen in even rounds, "
            "A in odd ones), but the clients' A and B both differ; were both trained?"
        )
    A_new = torch.einsum("k,krn->rn", p, A)  # (r, n): A itself where it is shared
    B_new = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    return A_new, B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


def check(cfg) -> list[str]:
    """What RoLoRA cannot run with: DP-SGD's checks are made for one trained factor set."""
    if cfg.dp:
        return [
            "`dp_epsilon`: DP-SGD cannot be combined with method 'rolora' (its trained "
            "factor changes by round, and the DP-SGD checks are made for one set of trained "
            "parameters)"
        ]
    return []


SPEC = MethodSpec(
    name="rolora",
    title="RoLoRA",
    paper="Chen et al., 2025 (arXiv 2502.01755)",
    trains="B in odd rounds (A frozen), A in even rounds (B frozen)",
    keeps_local="nothing",
    uploads="B_i in odd rounds, A_i in even rounds",
    downloads="A and B",
    exact=True,
    linear=True,
    bytes_per_round="up 4krd (odd rounds) or 4krn (even); down 4kr(d+n)",
    aggregate=aggregate,
    alternating=True,
    check=check,
)
