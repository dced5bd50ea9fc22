"""The model: a quantized base with a PEFT LoRA adapter, as FlowerTune's ``get_model``."""

import math
from types import SimpleNamespace

import torch

from fedexlora.bridge.models import load_base

_QUANT = {4: "nf4", 8: "int8", 0: None}


def cosine_annealing(
    current_round: int, total_round: int, lrate_max: float = 0.001, lrate_min: float = 0.0
) -> float:
    """FlowerTune's learning-rate schedule over the rounds."""
    cos_inner = math.pi * current_round / total_round
    return lrate_min + 0.5 * (lrate_max - lrate_min) * (1 + math.cos(cos_inner))


def quantization(model_cfg: SimpleNamespace) -> str | None:
    """``model.quantization`` (4, 8 or 0) as bitsandbytes' nf4, int8 or none."""
    if int(model_cfg.quantization) not in _QUANT:
        raise ValueError(
            f"model.quantization must be 4, 8 or 0 (none), got {model_cfg.quantization!r}"
        )
    return _QUANT[int(model_cfg.quantization)]


def get_base(model_cfg: SimpleNamespace):
    """The pretrained base, quantized, and its tokenizer: what a saved adapter goes onto.

    The compute dtype is fp32 (bf16 on a GPU is faster; on a CPU without AVX512-BF16 it is
    about 19x slower). A GGUF model (the embedded SmolLM2) is dequantized, then quantized.
    """
    return load_base(model_cfg.name, causal=True, quantization=quantization(model_cfg))


def get_model(model_cfg: SimpleNamespace):
    """The base with the LoRA adapter: ``(peft_model, tokenizer)``, the same on every party.

    Residuals folded into a quantized base live in fedex-lora's fp32 side branch (the
    4-bit weights are never touched); an fp32 base (``model.quantization = 0``) keeps them
    in one too (``use_side_branch``), so that every round is exact to fp32's rounding of
    the update itself.
    """
    from peft import LoraConfig, get_peft_model

    from fedexlora.bridge.fold import use_side_branch

    base, tokenizer = get_base(model_cfg)
    if model_cfg.gradient_checkpointing:
        base.config.use_cache = False
    lora = LoraConfig(
        r=int(model_cfg.lora.peft_lora_r),
        lora_alpha=float(model_cfg.lora.peft_lora_alpha),
        lora_dropout=0.0,  # FlowerTune uses 0.075; 0 keeps client runs reproducible
        target_modules=[t.strip() for t in str(model_cfg.lora.target_modules).split(",")],
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(0)  # every party starts from the same adapter
    model = get_peft_model(base, lora)
    for p in model.parameters():  # the adapter trains in fp32 (fedexlora.training.sft's
        if p.requires_grad and p.dtype != torch.float32:  # train_sft keeps it so under TRL)
            p.data = p.data.float()
    return use_side_branch(model), tokenizer
