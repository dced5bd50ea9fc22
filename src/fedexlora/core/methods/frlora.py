"""FRLoRA: each round's averaged update folded into the base; the adapter restarts.

Yan et al., "Federated Residual Low-Rank Adaptation of Large Language Models", ICLR 2025
(code: IAMJackYan/FRLoRA). Once, the adapter is initialised from the SVD of each
pretrained weight, ``B0 = U_r sqrt(S_r / s)``, ``A0 = sqrt(S_r / s) V_rᵀ``, and the base
keeps the rest, ``W0 - s B0 A0`` (peft's ``init_lora_weights="pissa"``, the same
formula as the released ``ours_init``). Every round the clients start from ``(A0, B0)``;
the server averages A and B separately and folds ``s (B̄ Ā - B0 A0)`` into the base, and
the adapter returns to ``(A0, B0)``: the global update grows in rank round after round.
The fold is the product of the averages, as FedIT's, so the method is inexact by FedIT's
deviation. (The released code freezes A while the paper trains both; we train both, and
weight clients as the run says where the released code weights them uniformly.)
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6, start):
    """``(A0, B0)`` again, and the residual ``B̄ Ā - B0 A0`` (rank <= 2r)."""
    del generator, atol
    A0, B0 = start
    A_bar = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    # B̄Ā - B0A0 = (B̄ - B0) Ā + B0 (Ā - A0): the differences are taken here in fp64, on
    # the factors, so no fp32 product of the (large) principal part cancels at the fold
    U = torch.cat([B_bar - B0, B0], 1)  # (d, 2r)
    V = torch.cat([A_bar, A_bar - A0], 0)  # (2r, n)
    residual = Residual.exact(U.to(out_dtype), V.to(out_dtype), dense_dtype=out_dtype)
    return A0.clone(), B0.clone(), residual


def check(cfg) -> list[str]:
    """FRLoRA starts from the SVD of each pretrained weight, which a quantized base lacks."""
    if cfg.quantization is not None:
        return [
            "method 'frlora' starts its adapter from the SVD of each pretrained weight, "
            "which a quantized base does not hold; fix: drop --quantization (a bf16 base "
            "works: --dtype bf16)"
        ]
    return []


SPEC = MethodSpec(
    name="frlora",
    title="FRLoRA",
    paper="Yan et al., ICLR 2025 (code: IAMJackYan/FRLoRA)",
    trains="A and B, restarted each round from the pretrained weight's principal part",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="A0, B0 and the residual B̄Ā - B0A0 (factored, rank <= 2r)",
    exact=False,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4k[r(d+n) + min(2r(d+n), dn)]",
    aggregate=aggregate,
    restarts=True,
    lora_init="pissa",
    check=check,
)
