"""FedEx-LoRA: averaged factors plus the exact residual (a side branch, or a fold)."""

from __future__ import annotations

import torch

from fedexlora.core.factors import centred_residual
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """``Ā``, ``B̄`` and the residual ``Σ p_i B_i A_i − B̄ Ā``, factored at rank <= (k-1) r."""
    del generator, atol
    A_new = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_new = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    residual = centred_residual(A, B, p, out_dtype=out_dtype, B_bar=B_new)  # no QR, no SVD
    return A_new, B_new, residual


SPEC = MethodSpec(
    name="fedex",
    title="FedEx-LoRA",
    paper="Singhal, Ponkshe, Vepakomma, ACL 2025 (arXiv 2410.09432)",
    trains="A and B",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="Ā, B̄ and the residual since the client's version (factored or dense)",
    exact=True,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4k[r(d+n) + min((k-1)r(d+n), dn)]",
    aggregate=aggregate,
    hetero_ranks=True,
    residual_rank=True,
    secure_products=True,
    dora=True,
    baseline="fedit",
)
