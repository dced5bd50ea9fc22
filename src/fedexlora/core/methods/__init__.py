"""The method registry: one module per federated LoRA method, each declaring its spec.

Adding a method is one module in this folder (its :class:`MethodSpec` as ``SPEC``, with
its server math and, where its flags do not say it, its :class:`RoundPlan`: what clients
train, upload and keep each round), its tests, and one line in :data:`REGISTRY` below.
Every other module asks the registry (:func:`get_method`); none tests a method's name.
"""

from __future__ import annotations

from fedexlora.core.methods import (
    centralized,
    fedex,
    fedit,
    fedsa,
    fedsb,
    fedsvd,
    ffa,
    flexlora,
    flora,
    frlora,
    hetlora,
    lorafair,
    rolora,
)
from fedexlora.core.methods.plan import RoundPlan
from fedexlora.core.methods.spec import Aggregate, LocalHooks, LocalModel, MethodSpec

__all__ = [
    "REGISTRY",
    "Aggregate",
    "LocalHooks",
    "LocalModel",
    "MethodSpec",
    "RoundPlan",
    "get_method",
    "method_names",
]

REGISTRY: dict[str, MethodSpec] = {
    m.SPEC.name: m.SPEC
    for m in (
        fedex,
        fedit,
        ffa,
        flora,
        fedsb,
        flexlora,
        fedsvd,
        lorafair,
        rolora,
        fedsa,
        frlora,
        hetlora,
        centralized,
    )
}


def method_names(**flags: bool) -> tuple[str, ...]:
    """The registered names, in registry order, whose spec has every given flag value.

    ``method_names(federated=True)`` are the methods with clients.
    """
    return tuple(
        name
        for name, spec in REGISTRY.items()
        if all(getattr(spec, k) == v for k, v in flags.items())
    )


def get_method(name: str) -> MethodSpec:
    """The spec of method ``name``.

    Raises:
        ValueError: If no method of that name is registered.
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(REGISTRY)}") from None
