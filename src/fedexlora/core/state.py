"""Adapter states as plain tensors, and whole-model aggregation over them.

An :class:`AdapterState` is what a client uploads and what the server holds as the global
adapter: the LoRA factors of every adapted module plus the trainable non-LoRA parameters
(``modules_to_save``, e.g. a classifier head). It knows nothing of peft; the bridge in
:mod:`fedexlora.bridge.adapters` reads and writes it from a model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fedexlora.core.aggregation import aggregate
from fedexlora.core.factors import (
    Residual,
    _gram_fro2,
    deviation,
    factor_product,
    normalize_weights,
)
from fedexlora.core.methods import get_method

__all__ = ["AdapterState", "LayerInfo", "RoundAggregate", "aggregate_states"]


@dataclass
class AdapterState:
    """LoRA factors per module and trainable extra parameters, as tensors.

    Attributes:
        factors: Module name -> ``(A, B)`` with ``A`` ``(r, n)`` and ``B`` ``(d, r)``.
            ``A`` may be ``None`` where a method does not upload it (FFA-LoRA), ``B``
            where a round does not train it (RoLoRA's A rounds) or the client keeps it
            (FedSA-LoRA); never both.
        extra: Parameter name -> tensor, for trainable non-LoRA parameters.
    """

    factors: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict
    )
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_flat(self) -> dict[str, torch.Tensor]:
        """Flat ``name -> tensor`` map (``lora.<module>.A``/``.B``, ``extra.<param>``)."""
        flat: dict[str, torch.Tensor] = {}
        for name, (A, B) in self.factors.items():
            if A is not None:
                flat[f"lora.{name}.A"] = A
            if B is not None:
                flat[f"lora.{name}.B"] = B
        for name, t in self.extra.items():
            flat[f"extra.{name}"] = t
        return flat

    @classmethod
    def from_flat(cls, flat: dict[str, torch.Tensor]) -> AdapterState:
        """Inverse of :meth:`to_flat`."""
        As: dict[str, torch.Tensor] = {}
        Bs: dict[str, torch.Tensor] = {}
        extra: dict[str, torch.Tensor] = {}
        for key, t in flat.items():
            if key.startswith("lora.") and key.endswith(".A"):
                As[key[5:-2]] = t
            elif key.startswith("lora.") and key.endswith(".B"):
                Bs[key[5:-2]] = t
            elif key.startswith("extra."):
                extra[key[6:]] = t
            else:
                raise ValueError(f"unexpected key {key!r} in an adapter state")
        modules = list(Bs) + [m for m in As if m not in Bs]
        return cls(factors={m: (As.get(m), Bs.get(m)) for m in modules}, extra=extra)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors held."""
        return sum(t.numel() * t.element_size() for t in self.to_flat().values())

    def clone(self) -> AdapterState:
        """A deep copy."""
        return AdapterState.from_flat({k: v.detach().clone() for k, v in self.to_flat().items()})


@dataclass
class RoundAggregate:
    """The result of aggregating one round's client states.

    Attributes:
        state: The new global adapter state.
        residuals: Module name -> residual to fold (times the module's LoRA scale).
        deviation: Module name -> relative deviation of the averaged-factor product from
            the ideal update (what FedIT would lose in this round).
        effective_deviation: Module name -> relative deviation of the update actually
            applied (averaged factors plus residual) from the ideal update.
        weights: The normalised client weights.
    """

    state: AdapterState
    residuals: dict[str, Residual]
    deviation: dict[str, float]
    effective_deviation: dict[str, float]
    weights: torch.Tensor


def aggregate_states(
    states: Sequence[AdapterState],
    weights: Sequence[float] | torch.Tensor | None,
    method: str,
    *,
    global_state: AdapterState | None = None,
    generator: torch.Generator | None = None,
    effective: bool = True,
) -> RoundAggregate:
    """Aggregates client adapter states module by module.

    LoRA factors go through :func:`fedexlora.core.aggregation.aggregate`; the extra parameters
    are averaged with the same weights.

    Args:
        states: One state per client, all over the same modules and shapes.
        weights: Client weights (normalised inside) or ``None`` for uniform.
        method: One of ``fedex``, ``fedit``, ``ffa``, ``flora``.
        global_state: The current global state. Required where clients do not upload
            a factor (FFA-LoRA's A, RoLoRA's frozen one): the global factor is used.
        generator: Seeded generator for ``flora``'s fresh A.
        effective: Also compute each module's effective deviation (the applied update
            against the ideal, from the returned factors). An engine that measures it on
            the model it folds into (:func:`fedexlora.bridge.steps.apply_outcome`) turns
            it off: at 4096 x 4096 it is an fp64 Gram of width ``(2 k + 1) r`` per side,
            several times the cost of the aggregation itself.

    Returns:
        The new global state, the residuals to fold, and deviations per module.
    """
    if not states:
        raise ValueError("nothing to aggregate: got 0 client states")
    p = normalize_weights(weights, len(states))
    ref = states[0]
    for i, s in enumerate(states):
        if set(s.factors) != set(ref.factors) or set(s.extra) != set(ref.extra):
            raise ValueError(f"client {i}'s state covers other modules than client 0's")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    residuals: dict[str, Residual] = {}
    dev: dict[str, float] = {}
    eff: dict[str, float] = {}
    for name in ref.factors:
        As, Bs = [], []
        for i, s in enumerate(states):
            A, B = s.factors[name]
            for which, got, j in (("A", A, 0), ("B", B, 1)):
                if got is None and (global_state is None or global_state.factors[name][j] is None):
                    raise ValueError(
                        f"client {i} sent no {which} for {name!r} and no global {which} is known"
                    )
            As.append(global_state.factors[name][0] if A is None else A)
            Bs.append(global_state.factors[name][1] if B is None else B)
        start = None if global_state is None else global_state.factors[name]
        if start is not None and (start[0] is None or start[1] is None):
            start = None
        res = aggregate(As, Bs, p, method, generator=generator, start=start)
        factors[name] = (res.A, res.B)
        residuals[name] = res.residual
        dev[name] = deviation(As, Bs, p)
        # aggregate() has accepted the method: the registry knows it
        if effective:
            measure = functools.partial(_effective_deviation, As, Bs, p, res)
            eff[name] = get_method(method).effective_deviation(dev[name], measure)
    extra = {  # averaged in fp64, then rounded once to fp32 (an fp64 extra stays fp64)
        name: torch.einsum(
            "k,k...->...",
            p.to(torch.float64),
            torch.stack([s.extra[name].detach().double() for s in states]),
        ).to(torch.float64 if ref.extra[name].dtype == torch.float64 else torch.float32)
        for name in ref.extra
    }
    return RoundAggregate(
        state=AdapterState(factors=factors, extra=extra),
        residuals=residuals,
        deviation=dev,
        effective_deviation=eff,
        weights=p,
    )


def _effective_deviation(As, Bs, p, res) -> float:
    """``||B A + R - sum p_i B_i A_i|| / ||sum p_i B_i A_i||``.

    Computed densely in fp64 up to 4M entries (so float rounding shows); above that from
    stacked-factor Gram matrices, which cannot resolve below about 1e-8.
    """
    P, Q = factor_product(As, Bs, p)
    den = _gram_fro2(P, Q)
    if den <= 0:
        return 0.0
    R = res.residual
    d, n = R.shape
    if d * n <= 1 << 22 or not R.is_factored:
        diff = res.B.double() @ res.A.double() + R.to_dense().double() - P.double() @ Q.double()
        return (float(diff.pow(2).sum()) / den) ** 0.5
    U = torch.cat([res.B, -P, R.U], 1)
    V = torch.cat([res.A, Q, R.V], 0)
    return (_gram_fro2(U, V) / den) ** 0.5


@dataclass(frozen=True)
class LayerInfo:
    """What the server needs to know of one LoRA layer.

    Attributes:
        scale: peft's ``scaling`` for the adapter (alpha/r, alpha/sqrt(r) with rsLoRA,
            after rank_pattern and alpha_pattern).
        fan_in_fan_out: Whether the base weight is stored ``(in, out)`` (GPT-2 Conv1D).
        rank: The adapter's rank ``r``.
        shape: ``(d, n)``: ``(out_features, in_features)`` of the update ``B @ A``.
    """

    scale: float
    fan_in_fan_out: bool
    rank: int
    shape: tuple[int, int]
