"""Exact aggregation of DoRA clients: the math, on tensors (no peft).

DoRA (``use_dora=True``) applies, per output feature (row ``j`` of a ``(d, n)`` weight),

    W = diag(m / ||V||) V,    V = W0 + s B A,    ||V||_j = norm of row j of V,

with ``m`` the trainable magnitude. So client ``i``'s weight is ``D_i V_i`` with
``D_i = diag(m_i / ||V_i||)``, non-linear in its factors and magnitude: averaging ``A``,
``B`` and ``m`` does not give the average of the clients' weights. The ideal is

    T = sum_i p_i D_i (W0 + s B_i A_i) = Dbar W0 + s sum_i p_i (D_i B_i) A_i,
    Dbar = sum_i p_i D_i.

The global model takes the averaged factors ``Abar``, ``Bbar`` and reaches ``T`` exactly
with the base

    W0' = T - s Bbar Abar = Dbar W0 + s R,   R = sum_i (p_i D_i B_i) A_i - Bbar Abar,

(the old base scaled per output feature, plus a residual of rank at most ``(k + 1) r``)
and the magnitude ``m' = ||T||`` (per row): then ``V' = W0' + s Bbar Abar = T`` and
``diag(m' / ||V'||) V' = T``. Every party can compute ``m'`` itself from its own ``W0'``,
``Abar`` and ``Bbar``, so only ``Dbar`` (a ``d``-vector) and ``R`` (factored) travel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedexlora.core.factors import Residual, normalize_weights

__all__ = [
    "DORA_SUFFIX",
    "DoraOutcome",
    "dora_aggregate",
    "dora_key",
    "dora_magnitude",
    "dora_modules",
    "dora_residual",
    "dora_row_scale",
    "dora_weight",
]


def _v(W0: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    return W0.double() + scale * (B.double() @ A.double())


def dora_weight(
    W0: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, scale: float
) -> torch.Tensor:
    """The ``(d, n)`` weight a DoRA layer applies, fp64: ``diag(m / ||V||) V``."""
    V = _v(W0, A, B, scale)
    return (m.double() / torch.linalg.norm(V, dim=1))[:, None] * V


def dora_row_scale(
    W0: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, scale: float
) -> torch.Tensor:
    """``m / ||W0 + s B A||`` per output feature (fp64 ``(d,)``): a client's ``D_i``."""
    return m.double() / torch.linalg.norm(_v(W0, A, B, scale), dim=1)


def dora_magnitude(W0: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float):
    """``||W0 + s B A||`` per output feature (fp64).

    The magnitude that makes ``V`` itself the layer's weight (``m' = ||T||`` once
    ``W0' + s B A = T``).
    """
    return torch.linalg.norm(_v(W0, A, B, scale), dim=1)


@dataclass(frozen=True)
class DoraOutcome:
    """One DoRA layer's aggregate.

    Attributes:
        A: ``Abar`` ``(r, n)``, the weighted mean of the clients' ``A``.
        B: ``Bbar`` ``(d, r)``.
        row_scale: ``Dbar`` ``(d,)``: the base's rows are multiplied by it.
        residual: ``R`` ``(d, n)``, before the LoRA scale: added as ``s R`` after scaling.
    """

    A: torch.Tensor
    B: torch.Tensor
    row_scale: torch.Tensor
    residual: Residual

    def new_base(self, W0: torch.Tensor, scale: float) -> torch.Tensor:
        """``W0' = Dbar W0 + s R`` in fp64."""
        return self.row_scale[:, None] * W0.double() + scale * self.residual.to_dense().double()


def dora_aggregate(
    row_scales: Sequence[torch.Tensor],
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
) -> DoraOutcome:
    """FedEx-LoRA for DoRA clients (module docstring), fp64.

    Args:
        row_scales: Each client's ``D_i = m_i / ||W0 + s B_i A_i||`` (:func:`dora_row_scale`,
            computed where ``W0`` is: the client's own).
        As: Each client's ``A_i`` ``(r, n)``.
        Bs: Each client's ``B_i`` ``(d, r)``.
        weights: Aggregation weights (normalised), default uniform.

    Raises:
        ValueError: If the lists differ in length or are empty.
    """
    k = len(As)
    if not k or len(Bs) != k or len(row_scales) != k:
        raise ValueError(f"dora_aggregate: {len(row_scales)} scales, {k} A, {len(Bs)} B")
    p = normalize_weights(weights, k).double()
    A = sum(pi * a.double() for pi, a in zip(p, As))
    B = sum(pi * b.double() for pi, b in zip(p, Bs))
    Dbar = sum(pi * D.double() for pi, D in zip(p, row_scales))
    U = torch.cat(
        [pi * D.double()[:, None] * b.double() for pi, D, b in zip(p, row_scales, Bs)] + [-B], 1
    )
    V = torch.cat([a.double() for a in As] + [A], 0)
    return DoraOutcome(A=A, B=B, row_scale=Dbar, residual=Residual.exact(U, V))


# -- FedEx's DoRA path: the magnitude travels as the row scale, the base stays additive --
#
# ``dora_aggregate`` above scales the base's rows by ``Dbar``. The same global weight is
# reached with a purely additive, low-rank change of the base by choosing the other gauge
# ``V' = Dbar^-1 T`` (any row scaling of ``T`` will do for a DoRA layer, since its
# magnitude sets the row norms):
#
#     W0' = W0 + s R~,   R~ = sum_i (p_i D_i / Dbar) B_i A_i - Bbar Abar,
#
# then ``V' = W0' + s Bbar Abar = Dbar^-1 T`` and the magnitude ``m' = Dbar ||V'||`` gives
# ``diag(m' / ||V'||) V' = Dbar V' = T``. So the server's record, catch-up history and
# reset payloads keep their additive residuals (rank <= (k + 1) r), and the magnitude
# travels as the layer's row scale ``D = m / ||V||`` (an extra, averaged to ``Dbar``):
# every party turns it back into ``m`` from its own base (``m = D ||V||``).

DORA_SUFFIX = ".fedex_dora_row_scale"


def dora_key(module: str) -> str:
    """The extra under which module ``module``'s DoRA row scale ``D`` travels."""
    return module + DORA_SUFFIX


def dora_modules(extra: Mapping[str, torch.Tensor]) -> list[str]:
    """The modules whose DoRA row scale is among ``extra``'s keys."""
    return [k[: -len(DORA_SUFFIX)] for k in extra if k.endswith(DORA_SUFFIX)]


def dora_residual(
    row_scales: Sequence[torch.Tensor],
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    *,
    module: str = "",
) -> Residual:
    """``R~ = sum_i (p_i D_i / Dbar) B_i A_i - Bbar Abar`` (see above), factored, fp64.

    Args:
        row_scales: Each client's ``D_i`` ``(d,)``.
        As: Each client's ``A_i`` ``(r, n)``.
        Bs: Each client's ``B_i`` ``(d, r)``.
        weights: The aggregation weights (normalised here).
        module: For the error message.

    Raises:
        ValueError: If some row's ``Dbar`` is zero (no row scaling of ``T`` exists).
    """
    k = len(As)
    p = normalize_weights(list(map(float, weights)), k).double()
    Dbar = sum(pi * D.double() for pi, D in zip(p, row_scales))
    if bool((Dbar == 0).any()):
        raise ValueError(
            f"module {module!r}: the clients' DoRA magnitudes average to zero in some "
            "output feature; that layer cannot be aggregated exactly"
        )
    A = sum(pi * a.double() for pi, a in zip(p, As))
    B = sum(pi * b.double() for pi, b in zip(p, Bs))
    U = torch.cat(
        [(pi * D.double() / Dbar)[:, None] * b.double() for pi, D, b in zip(p, row_scales, Bs)]
        + [-B],
        1,
    )
    V = torch.cat([a.double() for a in As] + [A], 0)
    return Residual.exact(U, V)
