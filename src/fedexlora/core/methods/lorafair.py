"""LoRA-FAIR: averaged factors, with B corrected towards the ideal update on the server.

Bian et al., ICCV 2025 (arXiv 2411.14961). The server averages A and B as FedIT does, then
refines B: ``ΔB = argmin 1 - cos(ΔW, (B̄ + ΔB) Ā) + λ ||ΔB||_F²`` with
``ΔW = Σ p_i B_i A_i`` the ideal update, and sends ``Ā`` and ``B̄ + ΔB`` as every client's
start for the next round (the paper's refined initialization). Nothing is folded into
the base weights: what ``(B̄ + ΔB) Ā`` misses of ``ΔW`` is lost, and reported as the
round's effective deviation.

The objective is evaluated in factored form (never ``(d, n)``): with ``M = B̄ + ΔB``,
``<ΔW, M Ā> = <M, P Q Āᵀ>`` and ``||M Ā||² = <M (Ā Āᵀ), M>``. It starts at ``ΔB = 0``
(FedIT's B) and is solved on the two-parameter family its stationary points lie in
(:func:`refine_B`), instead of by the released code's fixed-step SGD, whose progress
depends on the scale of the factors. Tests check the result against the objective's
gradient computed densely.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec

LAMBDA = 0.01  # the regulariser's weight λ (the paper's default)
MAX_ITER = 500  # L-BFGS steps at most (each O(r))


def refine_B(A, B, p, *, lam: float = LAMBDA, max_iter: int = MAX_ITER):
    """``(Ā, B̄, ΔB)`` for stacked fp64 factors ``A (k, r, n)``, ``B (k, d, r)``.

    A stationary point ``M = B̄ + ΔB`` solves ``M (2λ I + α C) = 2λ B̄ + β H`` with
    ``β = 1 / (w s)``, ``α = <M, H> / (w s³)`` and ``s = ||M Ā||``: it lies in the
    two-parameter family ``M(α, β)``. In the eigenbasis of ``C`` the objective on that
    family is a sum over the ``r`` columns of scalar terms, so the search over ``(α, β)``
    (L-BFGS, strong-Wolfe line search) costs ``O(r)`` per step; ``M`` is formed once.
    """
    k, r, n = A.shape
    d = B.shape[1]
    A_bar = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    P = (B * p[:, None, None]).permute(1, 0, 2).reshape(d, k * r)  # ΔW = P Q
    Q = A.reshape(k * r, n)
    H = P @ (Q @ A_bar.T)  # (d, r): ΔW Āᵀ
    C = A_bar @ A_bar.T  # (r, r)
    w2 = ((P.T @ P) * (Q @ Q.T)).sum()  # ||P Q||² = <PᵀP, Q Qᵀ>
    if w2 <= 0 or float(((B_bar @ C) * B_bar).sum()) <= 0:
        return A_bar, B_bar, torch.zeros_like(B_bar)  # nothing to align: FedIT's factors
    w = w2.sqrt()
    c, V = torch.linalg.eigh(C)  # C = V diag(c) Vᵀ, c >= 0
    Bt, Ht = B_bar @ V, H @ V  # (d, r) each, in the eigenbasis
    bb, hh, bh = (Bt * Bt).sum(0), (Ht * Ht).sum(0), (Bt * Ht).sum(0)  # (r,) each
    l2 = 2 * lam

    def f(x):  # the objective at M(α, β), from per-column scalars
        t = 1.0 / (l2 + x[0] * c)
        if bool((t <= 0).any()):  # 2λ I + α C must stay positive definite
            return (x * 0).sum() + 1e6
        a = (t * (l2 * bh + x[1] * hh)).sum()  # <M, H>
        b = (c * t**2 * (l2**2 * bb + 2 * l2 * x[1] * bh + x[1] ** 2 * hh)).sum()  # s²
        u = l2 * t - 1.0
        reg = (u**2 * bb + 2 * u * t * x[1] * bh + t**2 * x[1] ** 2 * hh).sum()  # ||ΔB||²
        return 1.0 - a / (w * b.clamp_min(1e-300).sqrt()) + lam * reg

    s0 = ((B_bar @ C) * B_bar).sum().sqrt()  # start at M = B̄: α, β of FedIT's B
    x = torch.stack([(B_bar * H).sum() / (w * s0**3), 1.0 / (w * s0)]).requires_grad_(True)
    opt = torch.optim.LBFGS(
        [x],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-15,
        tolerance_change=1e-18,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = f(x)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    alpha, beta = x.detach()
    M = ((l2 * Bt + beta * Ht) / (l2 + alpha * c)) @ V.T  # (d, r)
    return A_bar, B_bar, M - B_bar


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """``Ā`` and ``B̄ + ΔB`` (the refined B); no residual."""
    del out_dtype, generator, atol
    k, r, n = A.shape
    d = B.shape[1]
    A_bar, B_bar, dB = refine_B(A, B, p)
    return A_bar, B_bar + dB, Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="lorafair",
    title="LoRA-FAIR",
    paper="Bian et al., ICCV 2025 (arXiv 2411.14961)",
    trains="A and B",
    keeps_local="nothing",
    uploads="A_i, B_i",
    downloads="Ā and the refined B̄ + ΔB",
    exact=False,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4kr(d+n)",
    aggregate=aggregate,
)
