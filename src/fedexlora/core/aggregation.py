"""``aggregate``: one layer's client factors -> the new global factors and residual.

The rule is the method's own (:mod:`fedexlora.core.methods`); this module checks the
inputs, stacks them in fp64 and returns the result. The building blocks live in
:mod:`fedexlora.core.factors` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedexlora.core.factors import (
    AggregationResult,
    Residual,
    _compute_dtype,
    _stack,
    deviation,
    factor_product,
    normalize_weights,
    pad_rank,
    residuals_from_flat,
    residuals_to_flat,
    split_leading,
)
from fedexlora.core.methods import REGISTRY

__all__ = [
    "METHODS",
    "AggregationResult",
    "Residual",
    "aggregate",
    "deviation",
    "factor_product",
    "normalize_weights",
    "pad_rank",
    "residuals_from_flat",
    "residuals_to_flat",
    "split_leading",
]

METHODS = tuple(name for name, spec in REGISTRY.items() if spec.aggregate is not None)


def aggregate(
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor | None = None,
    method: str = "fedex",
    *,
    generator: torch.Generator | None = None,
    atol: float = 1e-6,
    start: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AggregationResult:
    """Aggregates the LoRA factors of one layer from ``k`` clients.

    Args:
        As: ``k`` tensors of shape ``(r, n)``.
        Bs: ``k`` tensors of shape ``(d, r)``.
        weights: Client weights (e.g. example counts), normalised inside; ``None`` is
            uniform.
        method: The name of any method of the registry
            (:data:`fedexlora.core.methods.REGISTRY`; ``fedexlora methods`` lists them)
            whose spec has server math (:attr:`MethodSpec.aggregate`), e.g. ``"fedex"``
            (exact: averaged factors plus residual). Each method's module documents
            its math.
        generator: Seeded generator for ``flora``'s fresh A.
        atol: Tolerance with which ``ffa`` checks that all clients share A.
        start: The global ``(A, B)`` the clients started the round from; needed by a
            method that returns to them every round (``frlora``).

    Returns:
        The new global ``A``, ``B`` and the residual to fold (before the LoRA scale).

    Raises:
        ValueError: On empty input, mismatched shapes or ranks, bad weights, an unknown
            method, or ``ffa`` clients whose A differ.
    """
    spec = REGISTRY.get(method) if isinstance(method, str) else None
    if spec is None or spec.aggregate is None:
        raise ValueError(f"unknown aggregation `method` {method!r}; choose from {METHODS}")
    # The factors are small (k r (d + n) numbers): aggregate them in fp64 (the averages
    # and the residual's exact factors, two subtractions away from the inputs), then
    # return fp32 (or fp64 for fp64 inputs) on the factors' device.
    out_dtype = _compute_dtype(As[0]) if len(As) else torch.float32
    A, B = _stack(As, Bs, dtype=torch.float64)  # (k, r, n), (k, d, r)
    k = A.shape[0]
    p = normalize_weights(weights, k).to(device=A.device, dtype=A.dtype)  # (k,)
    A_new, B_new, residual = spec.server_math(
        A, B, p, out_dtype=out_dtype, generator=generator, atol=atol, start=start
    )
    return AggregationResult(
        A=A_new.to(out_dtype),
        B=B_new.to(out_dtype),
        residual=residual.to(out_dtype),
        weights=p,
        method=method,
    )
