"""peft's LoRA layers of a model, by name, checked to be ones fedex-lora can aggregate."""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from transformers.pytorch_utils import Conv1D

__all__ = ["lora_layers", "other_holders", "storage_groups"]

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
            than a linear layer; a grouped, dilated or non-zero-padded convolution, an
            unreadable quantized base, an
            unknown layer type): one line naming the module, the option and the way out.
    """
    adapter = _adapter_name(model, adapter)
    layers: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        active = list(getattr(module, "active_adapters", []) or [])
        if len(active) > 1:  # each would train, and only one be federated
            raise ValueError(
                f"module {name!r}: adapters {active} are active at once, and fedex-lora "
                "federates one adapter; activate one (set_adapter) or merge the others into "
                "the base first (merge_and_unload)"
            )
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        _check_layer(name, module, adapter)
        _check_factor_dtype(name, module, adapter)  # after the base's own refusals
        layers[name] = module
    if not layers:
        raise ValueError(f"the model has no LoRA layers for adapter {adapter!r}")
    _check_untied(model, layers)
    _check_dora_unshared(model, layers, adapter)
    return layers


def _key(t: torch.Tensor) -> tuple | None:
    """Where ``t`` lives: its device and its storage's address (``None``: nothing held)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    ptr = t.untyped_storage().data_ptr()
    return None if ptr == 0 else (str(t.device), ptr)


def _check_conv_geometry(name: str, base: torch.nn.Module) -> None:
    """Refuses a convolution whose LoRA branch peft builds with another geometry.

    peft's ``lora_A`` takes the base's kernel, stride and padding, but zero-pads and is
    undilated: a ``padding_mode`` other than zeros (circular, reflect, replicate) or a
    dilation makes the branch no longer the convolution by ``B @ A``, so a residual folded
    into the base weight (which pads and dilates as the base does) would not be the
    clients' average at the borders (or, dilated, not fit the base's output at all).
    """
    pads = base.padding
    padded = pads != "valid" and (isinstance(pads, str) or any(p != 0 for p in pads))
    if base.padding_mode != "zeros" and padded:
        raise ValueError(
            f"module {name!r}: LoRA on a convolution with padding_mode="
            f"{base.padding_mode!r} is not linear in B @ A (peft's LoRA branch pads with "
            f"zeros); {_WAY_OUT}"
        )
    if any(d != 1 for d in base.dilation):
        raise ValueError(
            f"module {name!r}: LoRA on a dilated convolution (dilation={tuple(base.dilation)})"
            f" is not linear in B @ A (peft's LoRA branch is undilated); {_WAY_OUT}"
        )


def storage_groups(model: torch.nn.Module) -> dict[tuple, list[tuple[str, torch.Tensor]]]:
    """Every parameter and buffer of ``model`` by the storage it lives in.

    Duplicates are kept (``remove_duplicate=False``): a tied or replicated tensor appears
    once under each module that holds it. Returns ``{storage: [(name, tensor), ...]}``.
    """
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = _key(t)
        if key is not None:
            groups.setdefault(key, []).append((name, t))
    return groups


def _base_name(layer_name: str, layer: torch.nn.Module) -> str:
    """The parameter name of a LoRA layer's base weight (``<layer>.base_layer.weight``)."""
    for name, module in layer.named_modules():
        if module is layer.get_base_layer():
            return f"{layer_name}.{name}.weight" if name else f"{layer_name}.weight"
    return f"{layer_name}.base_layer.weight"


def other_holders(groups: dict, name: str, layer: LoraLayer) -> list[tuple[str, torch.Tensor]]:
    """What else holds the layer's base weight: parameters and buffers sharing its storage.

    ``groups`` is :func:`storage_groups` of the model; the base weight itself is left out.
    """
    weight = getattr(layer.get_base_layer(), "weight", None)
    key = None if weight is None else _key(weight)
    if key is None:
        return []
    own = _base_name(name, layer)
    return [(n, t) for n, t in groups.get(key, []) if n != own]


def _check_dora_unshared(model: torch.nn.Module, layers: dict[str, LoraLayer], adapter: str):
    """Refuses DoRA on a base weight another module holds (tied, replicated).

    Before any training: peft's DoRA norm reads the base weight alone, so the residual
    has nowhere exact to go (a side branch would escape the norm; the weight is shared).
    """
    dora = {n: x for n, x in layers.items() if x.use_dora.get(adapter, False)}
    if not dora:
        return
    groups = storage_groups(model)
    for name, layer in dora.items():
        others = other_holders(groups, name, layer)
        if others:
            raise ValueError(
                f"module {name!r} uses DoRA (use_dora=True) on a base weight that "
                f"{others[0][0]!r} holds too (tied or replicated), which fedex-lora cannot fold "
                "into exactly; leave it out of target_modules or set use_dora=False"
            )


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


# peft's LoRA variants (``LoraLayer.lora_variant``) fedex-lora aggregates exactly: DoRA on
# its own path (fedexlora.bridge.dora), and those whose layer still adds scaling * B @ A
# to the base and change only how A and B are found (VeLoRA: compressed activations in
# the backward pass; MiCA: an initialisation). Each is held by the matrix's independent
# ideal (tests/bridge/peft_matrix.py). Any other variant changes the update's form
# (KaSA's B diag(s) A, aLoRA's update on some tokens only, BD-LoRA's block-diagonal
# factors, ...) and is refused with the option that asked for it.
_EXACT_VARIANTS = frozenset({
    "DoraLinearVariant", "DoraEmbeddingVariant", "DoraConv1dVariant", "DoraConv2dVariant",
    "DoraConv3dVariant", "VeloraLinearVariant", "MiCALinearVariant", "MiCAEmbeddingVariant",
})  # fmt: skip
_VARIANT_OPTIONS = {  # the LoraConfig option behind a variant, for the message
    "Kasa": "kasa_config",
    "ALora": "alora_invocation_tokens",
    "BdLora": "use_bdlora",
    "Arrow": "arrow_config",
    "QALora": "use_qalora",
    "Monteclora": "monteclora_config",
}


def _check_variant(name: str, module: LoraLayer, adapter: str) -> None:
    variant = getattr(module, "lora_variant", {}).get(adapter)
    if variant is None or type(variant).__name__ in _EXACT_VARIANTS:
        return
    kind = type(variant).__name__
    option = next((o for k, o in _VARIANT_OPTIONS.items() if kind.startswith(k)), None)
    raise ValueError(
        f"module {name!r}: peft's {kind} ({option or 'a LoRA variant'}) makes the layer's "
        "update other than scaling * B @ A, which fedex-lora cannot aggregate exactly; "
        f"drop {option or 'that option'} from the LoraConfig"
    )


def _check_factor_dtype(name: str, module: LoraLayer, adapter: str) -> None:
    from fedexlora.bridge import layer_kinds

    for which, p in zip("AB", layer_kinds.factor_params(module, adapter)):
        dtype = p.dtype
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"module {name!r}: its LoRA {which} is {dtype}, which cannot hold the "
                "averaged factors exactly; keep the adapter in fp32 (peft's default, "
                "autocast_adapter_dtype=True; do not cast the whole model with .to(dtype) "
                "after get_peft_model)"
            )


def _check_layer(name: str, module: LoraLayer, adapter: str) -> None:
    """Raises ``ValueError`` (one line) unless the layer can be aggregated exactly."""
    from fedexlora.bridge import layer_kinds

    _check_variant(name, module, adapter)
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
    if kind == "conv":
        _check_conv_geometry(name, base)
    supported = (torch.nn.Linear, Conv1D, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
    if not isinstance(base, supported):
        raise ValueError(
            f"module {name!r}: base layer {type(base).__name__} is not supported; only "
            "nn.Linear, GPT-2 Conv1D, nn.Embedding, nn.Conv1d/2d/3d and bitsandbytes "
            f"Linear4bit/Linear8bitLt are; {_WAY_OUT}"
        )
