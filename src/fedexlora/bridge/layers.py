"""peft's LoRA layers of a model, by name, checked to be ones fedex-lora can aggregate."""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from transformers.pytorch_utils import Conv1D

__all__ = ["lora_layers"]

_BNB_LAYERS = {"Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt"}


def _is_bnb(base: torch.nn.Module) -> bool:
    return type(base).__module__.split(".")[0] == "bitsandbytes"


def _adapter_name(model: torch.nn.Module, adapter: str | None) -> str:
    if adapter is not None:
        return adapter
    return getattr(model, "active_adapter", None) or "default"


def lora_layers(model: torch.nn.Module, adapter: str | None = None) -> dict[str, LoraLayer]:
    """All LoRA-wrapped modules of ``model`` by name, checked to be supported.

    Supported: LoRA on ``nn.Linear``, GPT-2's ``Conv1D``, bitsandbytes 4/8-bit linears,
    ``nn.Embedding``, ungrouped ``nn.Conv1d/2d/3d`` and ``target_parameters`` (stacked
    MoE experts, fp32), with or without ``lora_bias`` (see
    :mod:`fedexlora.bridge.layer_kinds`); DoRA on an fp32 ``nn.Linear`` or ``Conv1D``
    (:mod:`fedexlora.bridge.dora`).

    Raises:
        ValueError: If the model has no LoRA layer, or one is of a kind fedex-lora cannot
            aggregate exactly (DoRA on a half-precision or quantized base, or on other
            than a linear layer; a grouped convolution, an unreadable quantized base, an
            unknown layer type): one line naming the module, the option and the way out.
    """
    adapter = _adapter_name(model, adapter)
    layers: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        _check_layer(name, module, adapter)
        layers[name] = module
    if not layers:
        raise ValueError(f"the model has no LoRA layers for adapter {adapter!r}")
    _check_untied(model, layers)
    return layers


def _check_untied(model: torch.nn.Module, layers: dict[str, LoraLayer]) -> None:
    """Refuses LoRA on an embedding whose weight another module holds (a tied ``lm_head``).

    Its fold would change that module too.
    """
    from fedexlora.bridge import layer_kinds

    embeddings = {n: x for n, x in layers.items() if layer_kinds.kind(x) == "embedding"}
    if not embeddings:
        return
    holders: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(pname)
    for name, layer in embeddings.items():
        others = [
            h
            for h in holders.get(id(layer_kinds.base_param(layer)), [])
            if not h.startswith(name + ".")
        ]
        if others:
            raise ValueError(
                f"module {name!r}: LoRA on an embedding whose weight is tied to {others[0]!r} "
                f"(tie_word_embeddings) is not supported; {_WAY_OUT}, or untie the weights"
            )


_WAY_OUT = "leave it out of target_modules (or list it in exclude_modules)"


def _check_layer(name: str, module: LoraLayer, adapter: str) -> None:
    """Raises ``ValueError`` (one line) unless the layer can be aggregated exactly."""
    from fedexlora.bridge import layer_kinds

    if module.use_dora.get(adapter, False):
        from fedexlora.bridge.dora import check_dora_layer

        check_dora_layer(name, module, adapter)  # FedEx's DoRA path: fp32 folds only
    kind = layer_kinds.kind(module)
    base = module.get_base_layer()
    if kind == "param":
        if layer_kinds.base_param(module).dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"module {name!r}: target_parameters on a {layer_kinds.base_param(module).dtype}"
                " parameter is not supported (its update cannot be held beside it); load "
                "the model in fp32 or drop target_parameters"
            )
        return
    if _is_bnb(base):
        if type(base).__name__ not in _BNB_LAYERS:
            raise ValueError(
                f"module {name!r}: bitsandbytes layer {type(base).__name__} is not "
                f"supported; only {sorted(_BNB_LAYERS)} are; {_WAY_OUT}"
            )
        return
    weight = getattr(base, "weight", None)
    if weight is None:
        raise ValueError(
            f"module {name!r}: base layer {type(base).__name__} has no weight that "
            f"fedex-lora can fold into; {_WAY_OUT}"
        )
    if not weight.dtype.is_floating_point:
        raise ValueError(
            f"module {name!r} has a quantized base layer ({type(base).__name__}) "
            "that fedex-lora cannot read; quantize with bitsandbytes instead "
            "(--quantization nf4|fp4|int8)"
        )
    if kind == "conv" and base.groups != 1:
        raise ValueError(
            f"module {name!r}: LoRA on a grouped convolution (groups={base.groups}) is not "
            f"linear in B @ A; {_WAY_OUT}"
        )
    supported = (torch.nn.Linear, Conv1D, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
    if not isinstance(base, supported):
        raise ValueError(
            f"module {name!r}: base layer {type(base).__name__} is not supported; only "
            "nn.Linear, GPT-2 Conv1D, nn.Embedding, nn.Conv1d/2d/3d and bitsandbytes "
            f"Linear4bit/Linear8bitLt are; {_WAY_OUT}"
        )
