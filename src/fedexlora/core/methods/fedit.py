"""FedIT: A and B averaged separately (inexact: the average of products is not the product)."""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """``Ā`` and ``B̄``; no residual."""
    del out_dtype, generator, atol
    k, r, n = A.shape
    d = B.shape[1]
    A_new = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_new = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    return A_new, B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="fedit",
    title="FedIT",
    paper="Zhang et al., ICASSP 2024 (arXiv 2305.05644)",
    trains="A and B",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="Ā, B̄",
    exact=False,
    linear=True,
    bytes_per_round="up 4kr(d+n); down 4kr(d+n)",
    aggregate=aggregate,
    effective_is_deviation=True,
)
