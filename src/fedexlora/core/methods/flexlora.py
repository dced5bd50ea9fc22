"""FlexLoRA: the full weighted update, truncated by SVD to each client's rank.

Bai et al., NeurIPS 2024 (code: alibaba/FederatedScope, branch FlexLoRA,
``fed_utils/adaptive_peft.py``). The server forms ``ΔW = Σ p_i s_i B_i A_i`` and gives
every client the best approximation of it at the client's own rank (Eckart-Young):
``ΔW ≈ U_r Σ_r V_rᵀ``, with ``A = V_rᵀ`` and ``B = U_r Σ_r / s`` (every singular value in
B, as the released ``distribute_weight_fast`` does), ``s`` the client's own LoRA scale
(:func:`fedexlora.core.hetero.client_view` with ``orthonormal_A`` for a client below the
global rank). The base weights are never changed and what the
truncation leaves out is dropped, so the method is lossy: each round's loss is the
energy beyond rank r, reported as its effective deviation. The global adapter is the
rank-r truncation that the clients start from.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual, svd_of_product
from fedexlora.core.methods.spec import MethodSpec


def truncated_update(A, B, p, r: int):
    """The best rank-``r`` factors of ``Σ p_i B_i A_i`` (stacked, fp64): ``(A', B')``."""
    k, r_in, n = A.shape
    d = B.shape[1]
    P = (B * p[:, None, None]).permute(1, 0, 2).reshape(d, k * r_in)  # (d, k r)
    Q = A.reshape(k * r_in, n)  # (k r, n)
    U, S, V = svd_of_product(Q, P)  # Σ p_i B_i A_i = U diag(S) V, never (d, n)
    q = min(r, S.numel())
    A_new = torch.zeros(r, n, dtype=A.dtype, device=A.device)
    B_new = torch.zeros(d, r, dtype=A.dtype, device=A.device)
    A_new[:q] = V[:q]
    B_new[:, :q] = U[:, :q] * S[:q]
    return A_new, B_new


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """The rank-r truncation of ``Σ p_i B_i A_i``; the rest is dropped (no residual)."""
    del out_dtype, generator, atol
    k, r, n = A.shape
    d = B.shape[1]
    A_new, B_new = truncated_update(A, B, p, r)
    return A_new, B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="flexlora",
    title="FlexLoRA",
    paper="Bai et al., NeurIPS 2024 (arXiv 2402.11505)",
    trains="A and B (each client at its own rank)",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="the rank-r_i truncated SVD of the weighted update",
    exact=False,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4kr(d+n)",
    aggregate=aggregate,
    hetero_ranks=True,
    hetero_drops_tail=True,
    hetero_orthonormal_A=True,
)
