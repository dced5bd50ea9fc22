"""DoRA layers (``use_dora=True``) on the peft bridge: their magnitude as a row scale.

FedEx's DoRA path (:mod:`fedexlora.core.dora`): a DoRA layer's weight is
``diag(m / ||V||) V`` with ``V = W + s B A`` (``W`` its base, folds included), so its
magnitude ``m`` travels as the row scale ``D = m / ||V||`` (an extra keyed
:func:`~fedexlora.core.dora.dora_key`, averaged by the server to ``Dbar``), and every
party turns the global ``D`` back into ``m = D ||V||`` from its own base once the round's
residual is folded. The layer must fold into its weight (an fp32 or fp64
``nn.Linear``/GPT-2 ``Conv1D`` that no other module holds): peft's DoRA norm reads only
the base weight, never a side branch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft.tuners.lora import LoraLayer

from fedexlora.bridge import layer_kinds
from fedexlora.core.dora import dora_key

__all__ = [
    "check_dora_layer",
    "dora_deviation",
    "dora_keys",
    "dora_weight_of",
    "is_dora",
    "read_row_scales",
    "row_scale",
    "set_magnitude",
    "write_row_scales",
]


def is_dora(layer: LoraLayer, adapter: str) -> bool:
    """Whether the layer applies DoRA for ``adapter``."""
    return bool(getattr(layer, "use_dora", {}).get(adapter, False))


def check_dora_layer(name: str, layer: LoraLayer, adapter: str) -> None:
    """Raises ``ValueError`` (one line) unless the DoRA layer can be aggregated exactly."""
    base = layer.get_base_layer()
    if layer_kinds.kind(layer) != "linear" or type(base).__module__.startswith("bitsandbytes"):
        raise ValueError(
            f"module {name!r} uses DoRA (use_dora=True) on a {type(base).__name__}, which "
            "fedex-lora aggregates exactly only on an unquantized nn.Linear or GPT-2 Conv1D; "
            "leave it out of target_modules or set use_dora=False"
        )
    dtype = layer_kinds.base_param(layer).dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"module {name!r} uses DoRA (use_dora=True) on a {dtype} base, which fedex-lora "
            "aggregates exactly only on an fp32 (or fp64) base; load the model in fp32 or "
            "set use_dora=False"
        )


def _v(layer: LoraLayer, adapter: str) -> torch.Tensor:
    W = layer_kinds.base_matrix(layer)
    A = layer_kinds.read_A(layer, adapter).detach().double()
    B = layer_kinds.read_B(layer, adapter).detach().double()
    return W + float(layer.scaling[adapter]) * (B @ A).to(W.device)


def _magnitude(layer: LoraLayer, adapter: str) -> torch.Tensor:
    return layer.lora_magnitude_vector[adapter].weight


def row_scale(layer: LoraLayer, adapter: str) -> torch.Tensor:
    """``D = m / ||W + s B A||`` per output feature, fp64 on the CPU."""
    norm = torch.linalg.norm(_v(layer, adapter), dim=1)
    return (_magnitude(layer, adapter).detach().double() / norm).cpu()


def dora_weight_of(layer: LoraLayer, adapter: str = "default") -> torch.Tensor:
    """The ``(d, n)`` weight the DoRA layer applies, ``diag(m / ||V||) V``, fp64."""
    V = _v(layer, adapter)
    m = _magnitude(layer, adapter).detach().double().to(V.device)
    return (m / torch.linalg.norm(V, dim=1))[:, None] * V


@torch.no_grad()
def set_magnitude(layer: LoraLayer, D: torch.Tensor, adapter: str) -> None:
    """``m = D ||W + s B A||`` from the layer's current base and factors."""
    mag = _magnitude(layer, adapter)
    norm = torch.linalg.norm(_v(layer, adapter), dim=1)
    mag.copy_((D.double().to(norm.device) * norm).to(mag.dtype))


def read_row_scales(layers: Mapping[str, LoraLayer], adapter: str) -> dict[str, torch.Tensor]:
    """Each DoRA layer's row scale, keyed :func:`~fedexlora.core.dora.dora_key`."""
    return {dora_key(n): row_scale(x, adapter) for n, x in layers.items() if is_dora(x, adapter)}


def dora_keys(layers: Mapping[str, LoraLayer], adapter: str) -> dict[str, str]:
    """``dora_key(name) -> name`` for each DoRA layer."""
    return {dora_key(n): n for n, x in layers.items() if is_dora(x, adapter)}


def write_row_scales(
    layers: Mapping[str, LoraLayer], extra: Mapping[str, torch.Tensor], adapter: str
) -> None:
    """Sets each DoRA layer's magnitude from its row scale in ``extra`` (if there)."""
    for key, name in dora_keys(layers, adapter).items():
        if key in extra:
            set_magnitude(layers[name], extra[key], adapter)


def dora_deviation(
    layer: LoraLayer, name: str, base: torch.Tensor, uploads, outcome, scale, adapter="default"
):
    """``||W_model - T|| / ||T - W_previous||`` for a DoRA layer after the round's fold.

    ``T = sum_i p_i D_i (W + s B_i A_i)`` from the accepted uploads (``W``: ``base``, the
    layer's base before the fold, fp64 ``(d, n)``), and ``W_previous`` the global weight
    the clients started from. Returns the deviation and ``||W_model||`` (for the
    rounding figure).
    """
    key = dora_key(name)
    by_id = {u.client_id: u for u in uploads}
    ideal = torch.zeros_like(base)
    for cid, p in outcome.weights.items():
        A, B = by_id[cid].state.factors[name]
        D = by_id[cid].state.extra[key].double().to(base.device)
        V = base + scale * (B.double() @ A.double()).to(base.device)
        ideal += (p * D)[:, None] * V
    A0, B0 = outcome.previous.factors[name]
    D0 = outcome.previous.extra[key].double().to(base.device)
    prev = D0[:, None] * (base + scale * (B0.double() @ A0.double()).to(base.device))
    after = dora_weight_of(layer, adapter)
    den = float(torch.linalg.norm(ideal - prev))
    dev = float(torch.linalg.norm(after - ideal)) / den if den > 0 else 0.0
    return dev, float(torch.linalg.norm(after)), den
