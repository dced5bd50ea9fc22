"""Heterogeneous client ranks: the global adapter has rank ``r_max``; client i trains ``r_i``.

A client of rank ``r_i`` receives the leading ``r_i`` components of the global update
``s_g B̄ Ā`` (by SVD, so they keep the most energy), rescaled to its own LoRA scale
``s_i``: by default with the singular values split evenly between A and B; as FlexLoRA's
release gives them (``A = V_rᵀ``, orthonormal rows, and ``B = U_r Σ_r / s_i``); or, for
HetLoRA, as the first ``r_i`` rows of A and columns of B. What the truncation leaves
out, ``T_i``, is folded into that client's base weight (the server drops it for
FlexLoRA), so its effective weights equal the global model exactly. On the way back, its
trained factors are zero-padded to ``r_max`` and rescaled to ``s_g``; the server adds
``Σ p_i T_i`` to the FedEx-LoRA residual, so that the new global model is exactly
``Σ p_i (W_i + s_i B_i A_i)``, each client with its own scale.

Pure tensor math: no peft, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedexlora.core.factors import Residual, pad_rank, split_leading, svd_of_product
from fedexlora.core.state import AdapterState

__all__ = ["client_view", "to_global"]


def _same(g, c) -> bool:
    return g.rank == c.rank and math.isclose(g.scale, c.scale, rel_tol=1e-12)


def client_view(
    state: AdapterState,
    global_layers: Mapping,
    client_layers: Mapping,
    *,
    generator: torch.Generator | None = None,
    slices: bool = False,
    orthonormal_A: bool = False,
    drop_tail: bool = False,
) -> tuple[AdapterState, dict[str, Residual]]:
    """The global state as a client of other ranks/scales sees it.

    Args:
        state: The global adapter state (rank ``r_max``).
        global_layers: ``LayerInfo`` of the global adapter, per module.
        client_layers: ``LayerInfo`` of the client's adapter, per module.
        generator: Seeded generator for A rows the global update does not determine
            (where ``B̄ Ā`` has fewer than ``r_i`` non-zero singular values); their B
            columns are zero, so the product is unchanged and they can still learn.
        slices: Give the client the first ``r_i`` rows of A and columns of B (HetLoRA)
            instead of the leading SVD components.
        orthonormal_A: Give the leading SVD components as FlexLoRA's release does
            (``distribute_weight_fast``): with ``s_g B̄ Ā = U Σ Vᵀ``, ``A_i = V_rᵀ``
            (orthonormal rows) and ``B_i = U_r Σ_r / s_i``, every singular value in B.
            Otherwise each factor carries ``sqrt(Σ_r / s_i)``. The product is the same.
        drop_tail: The client holds the cut and nothing else (FlexLoRA, HetLoRA): no
            remainders are returned.

    Returns:
        ``(client_state, remainders)``: factors of the client's rank with
        ``s_i B_i A_i`` = the leading part of ``s_g B̄ Ā``, and per module the remainder
        ``T_i = s_g B̄ Ā - s_i B_i A_i`` as an absolute weight-space matrix.

    Raises:
        ValueError: If a client's rank exceeds the global one, or if both ``slices``
            and ``orthonormal_A`` are asked for.
    """
    if slices and orthonormal_A:
        raise ValueError("`slices` and `orthonormal_A` are two ways to cut; ask for one")
    factors, remainders = {}, {}
    for name, (A, B) in state.factors.items():
        g, c = global_layers[name], client_layers[name]
        if _same(g, c):
            factors[name] = (A, B)
            continue
        if c.rank > g.rank:
            raise ValueError(
                f"module {name!r}: client rank {c.rank} exceeds the global rank {g.rank}"
            )
        if orthonormal_A:
            A_c, B_c, tail = _orthonormal_leading(A, B, c.rank, g.scale / c.scale)
        else:
            if slices:
                A_lead, B_lead = A[: c.rank], B[:, : c.rank]
                tail = Residual.exact(B[:, c.rank :], A[c.rank :])
            else:
                A_lead, B_lead, tail = split_leading(A, B, c.rank)
            root = math.sqrt(g.scale / c.scale)
            A_c, B_c = A_lead * root, B_lead * root
        dead = (A_c.abs().amax(dim=1) == 0).nonzero().flatten()
        if dead.numel():  # directions B̄ Ā does not use: fresh A rows, zero B columns
            bound = 1.0 / math.sqrt(A.shape[1])
            fresh = torch.empty(dead.numel(), A.shape[1], dtype=A_c.dtype)
            fresh.uniform_(-bound, bound, generator=generator)
            A_c[dead] = fresh
            B_c[:, dead] = 0
        factors[name] = (A_c, B_c)
        if not tail.is_zero and not drop_tail:
            remainders[name] = tail.scaled(g.scale)
    return AdapterState(factors=factors, extra=state.extra), remainders


def _orthonormal_leading(A: torch.Tensor, B: torch.Tensor, rank: int, factor: float):
    """``B @ A``'s leading ``rank`` SVD components as ``(V_rᵀ, factor * U_r Σ_r)``, and the rest.

    Directions with a zero singular value (an update of lower rank, or none yet) get a
    zero A row and B column: :func:`client_view` starts them from a fresh A row, as a
    new adapter would.

    Returns:
        ``(A_r, B_r, tail)`` with ``B_r @ A_r == factor * (B @ A - tail.to_dense())``.
    """
    out = torch.float64 if A.dtype == torch.float64 else torch.float32
    U, S, V = svd_of_product(A, B)
    k = min(rank, S.numel())
    live = (S[:k] > 0).to(S.dtype)
    A_r = torch.zeros(rank, A.shape[1], dtype=torch.float64, device=A.device)
    B_r = torch.zeros(B.shape[0], rank, dtype=torch.float64, device=B.device)
    A_r[:k] = V[:k] * live[:, None]
    B_r[:, :k] = U[:, :k] * (S[:k] * factor)
    d, n = B.shape[0], A.shape[1]
    tail = Residual((d, n), U=(U[:, k:] * S[k:]).to(out), V=V[k:].to(out).contiguous())
    return A_r.to(out), B_r.to(out), tail


def to_global(state: AdapterState, global_layers: Mapping, client_layers: Mapping) -> AdapterState:
    """A client's trained factors zero-padded to the global rank and rescaled to ``s_g``.

    ``s_g B̃ Ã == s_i B_i A_i`` for every module.
    """
    factors = {}
    for name, (A, B) in state.factors.items():
        g, c = global_layers[name], client_layers[name]
        if _same(g, c):
            factors[name] = (A, B)
        else:
            factors[name] = pad_rank(A, B, g.rank, factor=c.scale / g.scale)
    return AdapterState(factors=factors, extra=state.extra)
