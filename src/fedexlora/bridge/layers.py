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

    Raises:
        ValueError: If the model has no LoRA layer, or one uses DoRA, a LoRA bias, an
            embedding or convolution base, peft's ``target_parameters``, a base without a
            weight, or a base quantized otherwise than by bitsandbytes.
    """
    adapter = _adapter_name(model, adapter)
    layers: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_embedding_A", {}):
                raise ValueError(
                    f"module {name!r}: LoRA on embeddings is not supported; target Linear "
                    "or Conv1D layers only"
                )
            continue
        if module.use_dora.get(adapter, False):
            raise ValueError(
                f"module {name!r} uses DoRA, which is not supported: its magnitude vector "
                "makes the update non-linear in B @ A, so exact aggregation does not apply"
            )
        if getattr(module, "lora_bias", {}).get(adapter, False):
            raise ValueError(f"module {name!r} uses lora_bias, which is not supported")
        param_name = getattr(module, "parameter_name", None)  # peft's target_parameters
        if param_name is not None:
            raise ValueError(
                f"module {name!r}: LoRA on its parameter {param_name!r} (target_parameters, "
                "e.g. MoE experts) is not supported; fix: leave it out of target_parameters "
                "and target the model's Linear layers with target_modules"
            )
        base = module.get_base_layer()
        if _is_bnb(base):
            if type(base).__name__ not in _BNB_LAYERS:
                raise ValueError(
                    f"module {name!r}: bitsandbytes layer {type(base).__name__} is not "
                    f"supported; only {sorted(_BNB_LAYERS)} are"
                )
        else:
            weight = getattr(base, "weight", None)
            if weight is None:
                raise ValueError(
                    f"module {name!r}: base layer {type(base).__name__} has no weight that "
                    "fedex-lora can read; fix: leave it out of target_modules (exclude_modules)"
                )
            if not weight.dtype.is_floating_point:
                raise ValueError(
                    f"module {name!r} has a quantized base layer ({type(base).__name__}) "
                    "that fedex-lora cannot read; quantize with bitsandbytes instead "
                    "(--quantization nf4|fp4|int8)"
                )
            if not isinstance(base, (torch.nn.Linear, Conv1D)):
                raise ValueError(
                    f"module {name!r}: base layer {type(base).__name__} is not supported; "
                    "only nn.Linear, GPT-2 Conv1D and bitsandbytes Linear4bit/Linear8bitLt are"
                )
        layers[name] = module
    if not layers:
        raise ValueError(f"the model has no LoRA layers for adapter {adapter!r}")
    return layers
