"""FLoRA: the clients' adapters stacked, their exact sum folded, a fresh adapter each round."""

from __future__ import annotations

import math

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """Residual ``Σ p_i B_i A_i`` (rank <= k r), a fresh seeded A and ``B = 0``."""
    del atol
    k, r, n = A.shape
    d = B.shape[1]
    P = (B * p[:, None, None]).permute(1, 0, 2).reshape(d, k * r)  # (d, k r)
    Q = A.reshape(k * r, n)  # (k r, n)
    residual = Residual.exact(P.to(out_dtype), Q.to(out_dtype), dense_dtype=out_dtype)
    # drawn on the CPU (the generator's device), so a seed gives one A on every device
    A_new = torch.empty(r, n, dtype=A.dtype)
    bound = 1.0 / math.sqrt(n)  # kaiming_uniform_(a=sqrt(5)), peft's default for A
    A_new.uniform_(-bound, bound, generator=generator)
    A_new = A_new.to(A.device)
    B_new = torch.zeros(d, r, dtype=A.dtype, device=A.device)
    return A_new, B_new, residual


SPEC = MethodSpec(
    name="flora",
    title="FLoRA",
    paper="Wang et al., NeurIPS 2024 (arXiv 2409.05976)",
    trains="A and B (a fresh adapter each round)",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="a fresh A, B = 0 and the stacked update (factored or dense)",
    exact=True,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4k[r(d+n) + min(kr(d+n), dn)]",
    aggregate=aggregate,
    hetero_ranks=True,
    fresh_adapter=True,
)
