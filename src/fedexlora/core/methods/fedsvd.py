"""FedSVD: clients train B against a shared frozen A; the server re-factors by SVD.

Lee et al., NeurIPS 2025 (code: seanie12/fed-svd, ``reinit_lora``). Each round the server
averages B (exact: the shared A makes the update linear in B), forms the product with the
A the clients trained against, and re-factors it: ``B̄ A = U Σ Vᵀ``, the new A is the
orthonormal ``Vᵀ`` (r rows), the new B is ``U Σ``. The product is unchanged, so the round
is exact; clients receive both and keep training B against the new A. Nothing is folded
into the base weights.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.ffa import check_shared_A
from fedexlora.core.methods.flexlora import truncated_update
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """``B̄ = Σ p_i B_i``; ``B̄ A = U Σ Vᵀ`` gives ``A' = Vᵀ`` (orthonormal rows), ``B' = U Σ``.

    Raises:
        ValueError: If the clients' A differ (A was trained).
    """
    del out_dtype, generator
    k, r, n = A.shape
    d = B.shape[1]
    check_shared_A(A, atol, "fedsvd")
    B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    one = torch.ones(1, dtype=p.dtype, device=p.device)
    # B̄ A has rank <= r: its rank-r SVD factors (Σ in B, as the released code does) are
    # the product itself, FlexLoRA's truncation of a single "client"
    A_new, B_new = truncated_update(A[:1], B_bar[None], one, r)
    return A_new, B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="fedsvd",
    title="FedSVD",
    paper="Lee et al., NeurIPS 2025 (code: seanie12/fed-svd)",
    trains="B (A frozen; the server re-factors it every round)",
    keeps_local="nothing",
    uploads="B_i",
    downloads="the new orthonormal A and B = U Σ",
    exact=True,
    linear=True,
    bytes_per_round="up 4krd; down 4kr(d+n)",
    aggregate=aggregate,
    frozen_A=True,
    refactors_A=True,
)
