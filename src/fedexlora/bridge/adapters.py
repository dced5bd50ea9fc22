"""The peft bridge's factors: reading and writing a peft model's LoRA adapters.

It reads LoRA factors from a :class:`peft.PeftModel`, checks a state against it, writes
global factors back, and gives a method's local hooks the model (:class:`LoraHandle`).
What a layer folds into its frozen base (its fp32 side branch, or the record of an fp32
weight) is :mod:`fedexlora.bridge.fold`'s.
Orientation (``fan_in_fan_out``) and scale are always taken from the peft layer itself,
never recomputed: ``nn.Linear`` stores its weight ``(out, in)``, GPT-2's ``Conv1D``
stores ``(in, out)``.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.dora import dora_keys, read_row_scales, write_row_scales
from fedexlora.bridge.latent import is_latent
from fedexlora.bridge.layers import _adapter_name, lora_layers
from fedexlora.bridge.masters import read_extra, write_extra
from fedexlora.core.state import AdapterState, LayerInfo

__all__ = [
    "LoraHandle",
    "check_compatible",
    "get_state",
    "layer_info",
    "lift",
    "set_state",
    "set_trainable",
]

_LORA_PARAM_TAGS = (".lora_A.", ".lora_B.", ".lora_embedding_", ".lora_magnitude_vector")


def layer_info(model: torch.nn.Module, adapter: str | None = None) -> dict[str, LayerInfo]:
    """Scale, orientation, rank and shape of every LoRA layer, read from peft."""
    adapter = _adapter_name(model, adapter)
    info = {}
    for name, layer in lora_layers(model, adapter).items():
        A, B = _factor_shapes(layer, adapter)
        info[name] = LayerInfo(
            scale=float(layer.scaling[adapter]),
            fan_in_fan_out=bool(getattr(layer, "fan_in_fan_out", False)),
            rank=int(A[0]),
            shape=(int(B[0]), int(A[1])),
        )
    return info


def _factor_shapes(layer: LoraLayer, adapter: str) -> tuple[tuple, tuple]:
    """The shapes of ``(A, B)`` as the server sees them.

    A Fed-SB layer is shown in its latent coordinates: ``A = I_r`` and ``B = R``, a layer
    of shape ``(r, r)`` (see :mod:`fedexlora.bridge.latent`).
    """
    if is_latent(layer, adapter):
        r = layer.lora_B[adapter].core.weight.shape[0]
        return (r, r), (r, r)
    r, n = layer_kinds.read_A(layer, adapter).shape
    d, rb = layer_kinds.read_B(layer, adapter).shape
    return (r, n), (d, rb)


def _read_factors(layer: LoraLayer, adapter: str, include_A: bool, include_B: bool = True):
    if is_latent(layer, adapter):
        R = layer.lora_B[adapter].core.weight
        return (torch.eye(R.shape[0]) if include_A else None), _host(R)
    A = _host(layer_kinds.read_A(layer, adapter)) if include_A else None
    return A, (_host(layer_kinds.read_B(layer, adapter)) if include_B else None)


def lift(layer: LoraLayer, M: torch.Tensor, adapter: str = "default") -> torch.Tensor:
    """A ``(d, n)`` update from one in the server's coordinates (``B M A`` for Fed-SB)."""
    if not is_latent(layer, adapter):
        return M
    basis = layer.lora_B[adapter].basis.weight.detach().to(M)
    A = layer.lora_A[adapter].weight.detach().to(M)
    return basis @ M @ A


def _extra_params(model: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """Trainable non-LoRA parameters (``modules_to_save``) of ``adapter``, and its LoRA biases.

    A LoRA bias (``lora_bias=True``: ``lora_B``'s bias, added to the output times the
    scale) is linear in itself, so it is averaged like a head, keyed
    ``...lora_B.default.bias``. A ``modules_to_save`` copy is keyed as
    ``...modules_to_save.default...`` whatever the adapter's name, so that clients
    training other adapters (other ranks) share keys.
    """
    out = {}
    own, canonical = f".modules_to_save.{adapter}.", ".modules_to_save.default."
    bias = f".lora_B.{adapter}.bias"  # lora_bias=True: linear in the output, averaged
    for name, p in model.named_parameters():
        if name.endswith(bias):
            out[name[: -len(bias)] + ".lora_B.default.bias"] = p
            continue
        if any(tag in name for tag in _LORA_PARAM_TAGS):
            continue
        if ".modules_to_save." in name:
            if own in name:
                out[name.replace(own, canonical)] = p
        elif p.requires_grad:
            out[name] = p
    return out


def set_trainable(
    model: torch.nn.Module,
    *,
    train_A: bool,
    train_B: bool = True,
    train_extra: bool | None = None,
    adapter: str | None = None,
) -> None:
    """Freezes or unfreezes every ``lora_A`` and ``lora_B`` of ``adapter`` (the active one).

    FFA-LoRA freezes A; RoLoRA alternates A and B by round (their round plans). A
    Fed-SB layer is left as it is: its A and basis stay frozen, its core trains.

    Args:
        model: The peft model.
        train_A: Whether every layer's A trains.
        train_B: Whether every layer's B trains.
        train_extra: Whether the adapter's ``modules_to_save`` copies (the task head)
            and LoRA biases train; ``None`` leaves them as they are. Other trainable
            tensors beside the adapter are not touched.
        adapter: The adapter; ``None`` is the active one.
    """
    adapter = _adapter_name(model, adapter)
    for layer in lora_layers(model, adapter).values():
        if is_latent(layer, adapter):
            continue  # Fed-SB: A and the basis stay frozen, the core trains
        A, B = layer_kinds.factor_params(layer, adapter)
        A.requires_grad_(train_A)
        B.requires_grad_(train_B)
    if train_extra is None:
        return
    own, bias = f".modules_to_save.{adapter}.", f".lora_B.{adapter}.bias"
    for name, p in model.named_parameters():
        if own in name or name.endswith(bias):
            p.requires_grad_(train_extra)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy, in fp32 when the parameter is bf16/fp16 (numpy and records lack bf16)."""
    t = t.detach().to("cpu", copy=True)
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def get_state(
    model: torch.nn.Module,
    *,
    include_A: bool = True,
    adapter: str | None = None,
    include_B: bool = True,
    include_extra: bool = True,
) -> AdapterState:
    """Copies the LoRA factors and trainable extras of ``model`` into an AdapterState.

    Tensors are copied to the CPU (the server's math runs there), half precision as fp32.
    A half-precision extra is read as its fp32 master plus what training changed since
    :func:`set_state` wrote it (:mod:`fedexlora.bridge.masters`), so the exact average
    is never rounded to bf16/fp16 between rounds.

    Args:
        model: A peft model.
        include_A: Whether to include each layer's A (FFA-LoRA clients omit it).
        adapter: The adapter name; defaults to the active one.
        include_B: Whether to include each layer's B (RoLoRA clients omit it in the
            rounds that train A).
        include_extra: Whether to include the trainable extras (a task head; FedSA-LoRA
            clients keep theirs).
    """
    adapter = _adapter_name(model, adapter)
    factors = {}
    for name, layer in lora_layers(model, adapter).items():
        factors[name] = _read_factors(layer, adapter, include_A, include_B)
    # a half-precision extra: its fp32 master plus what training changed (bridge.masters)
    extra = {name: read_extra(p) for name, p in _extra_params(model, adapter).items()}
    extra.update(read_row_scales(lora_layers(model, adapter), adapter))  # DoRA: m as D
    return AdapterState(factors=factors, extra=extra if include_extra else {})


def check_compatible(model: torch.nn.Module, state: AdapterState, adapter: str | None = None):
    """Raises ``ValueError`` unless ``state`` covers exactly the model's modules and shapes.

    Its extras must be the model's, or none at all (a state that leaves the model's
    extras as they are: FedSA-LoRA's clients keep their task head).
    """
    adapter = _adapter_name(model, adapter)
    layers = lora_layers(model, adapter)
    missing = sorted(set(layers) - set(state.factors))
    extra_mods = sorted(set(state.factors) - set(layers))
    if missing or extra_mods:
        raise ValueError(
            f"adapter state does not match the model: missing modules {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}, unknown modules {extra_mods[:3]}"
            f"{'...' if len(extra_mods) > 3 else ''}"
        )
    for name, (A, B) in state.factors.items():
        wa, wb = _factor_shapes(layers[name], adapter)
        if A is not None and tuple(A.shape) != wa:
            raise ValueError(f"module {name!r}: A has shape {tuple(A.shape)}, model expects {wa}")
        if B is not None and tuple(B.shape) != wb:
            raise ValueError(f"module {name!r}: B has shape {tuple(B.shape)}, model expects {wb}")
    shapes = {k: tuple(p.shape) for k, p in _extra_params(model, adapter).items()}
    for key, name in dora_keys(layers, adapter).items():  # DoRA row scales: (d,) each
        shapes[key] = (layer_kinds.dims(layers[name], adapter)[0],)
    keys = set(shapes)
    if state.extra and keys != set(state.extra):
        raise ValueError(
            "adapter state does not match the model's trainable extras: missing "
            f"{sorted(keys - set(state.extra))}, unknown "
            f"{sorted(set(state.extra) - keys)}"
        )
    for name, t in state.extra.items():
        want = shapes[name]
        if tuple(t.shape) != want:
            raise ValueError(f"parameter {name!r} has shape {tuple(t.shape)}, model expects {want}")


@torch.no_grad()
def set_state(model: torch.nn.Module, state: AdapterState, adapter: str | None = None) -> None:
    """Writes global factors and extras into ``model`` (a factor ``state`` lacks is kept).

    A half-precision extra (a bf16 head) holds the value rounded to its dtype and keeps
    it exactly in an fp32 master beside it (:mod:`fedexlora.bridge.masters`).

    Raises:
        ValueError: If the state's modules or shapes differ from the model's.
    """
    adapter = _adapter_name(model, adapter)
    check_compatible(model, state, adapter)
    layers = lora_layers(model, adapter)
    for name, (A, B) in state.factors.items():
        layer = layers[name]
        if is_latent(layer, adapter):  # latent coordinates: A is I_r, B is the core R
            core = layer.lora_B[adapter].core.weight
            core.copy_(B.to(core.dtype))
            continue
        if A is not None:
            layer_kinds.write_A(layer, adapter, A)
        if B is not None:
            layer_kinds.write_B(layer, adapter, B, name)
    params = _extra_params(model, adapter)
    for name, t in state.extra.items():  # a half-precision one keeps an fp32 master
        if name in params:
            write_extra(params[name], t)
    write_row_scales(layers, state.extra, adapter)  # DoRA: m = D ||W + s B A||, new factors


def tail_norm(model: torch.nn.Module, start: int, stop: int) -> torch.Tensor:
    """``Σ_layers ||B[:, start:stop]||_F ||A[start:stop]||_F`` of the active adapter.

    Differentiable: HetLoRA's rank-pruning regularizer, and the score it prunes by.
    """
    adapter = _adapter_name(model, None)
    total = None
    for layer in lora_layers(model, adapter).values():
        A, B = layer_kinds.read_A(layer, adapter), layer_kinds.read_B(layer, adapter)
        term = torch.linalg.norm(B[:, start:stop]) * torch.linalg.norm(A[start:stop])
        total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


class LoraHandle:
    """A client's peft model as a method's local hooks see it (``MethodSpec.local_round``).

    :class:`fedexlora.core.methods.spec.LocalModel`, over the active adapter, and the
    client step's way to apply a round plan (:meth:`set_trainable`: not part of what a
    hook may do; the client step calls it after setting up the hooks, so what trains is
    the plan's whatever a hook did).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def set_trainable(self, train_A: bool, train_B: bool, train_extra: bool) -> None:
        """Freezes or unfreezes the active adapter's A, B and extras (:func:`set_trainable`)."""
        set_trainable(self.model, train_A=train_A, train_B=train_B, train_extra=train_extra)

    def factors(self) -> AdapterState:
        """The adapter's factors, without the task head."""
        return get_state(self.model, include_extra=False)

    def load(self, state: AdapterState) -> None:
        """Loads factors into the adapter."""
        set_state(self.model, state)

    def tail_norm(self, start: int, stop: int) -> torch.Tensor:
        """:func:`tail_norm` of the active adapter."""
        return tail_norm(self.model, start, stop)
