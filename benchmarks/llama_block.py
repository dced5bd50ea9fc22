"""One or more Llama decoder blocks at real shapes (Llama-3-8B's), random weights, LoRA on
all seven projections: the model ``llm_scale.py`` and ``distributed_client.py`` measure.

:func:`save_block` writes a one-block Llama in bf16 once; :func:`load_block` loads it as
bf16, nf4 or fp32 the way ``fedexlora.bridge.models`` loads a base, with peft's LoRA and
the fp32 side branch.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from fedexlora.bridge.fold import use_side_branch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRECISIONS = ("bf16", "nf4", "fp32")


@dataclass(frozen=True)
class BlockShape:
    """A Llama decoder block: its sizes, and how many of them the model has."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    blocks: int = 32

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=128,  # the block is what is measured: a token table of 128
            tie_word_embeddings=False,
        )

    def describe(self) -> str:
        kv = self.kv_heads * self.head_dim
        return (
            f"q/o {self.hidden}x{self.heads * self.head_dim}, k/v {self.hidden} -> {kv}, "
            f"gate/up {self.hidden} -> {self.intermediate}, down {self.intermediate} -> "
            f"{self.hidden}"
        )


LLAMA3_8B = BlockShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)


def save_block(shape: BlockShape, path: Path, *, seed: int = 0) -> Path:
    """A one-block Llama with random weights (transformers' init), saved in bf16."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.config()).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def load_block(path: Path, precision: str, r: int, alpha: float, *, seed: int = 0):
    """The saved block as ``precision`` with LoRA on all seven projections.

    As :func:`fedexlora.bridge.models.load_model` loads a base (which needs a tokenizer,
    so it is not called here): bitsandbytes through transformers'
    ``BitsAndBytesConfig`` (:func:`~fedexlora.bridge.models.quantization_config`, compute
    dtype bf16), bitsandbytes' CPU repacking turned off, trainable weights in fp32, and
    the fp32 side branch (:func:`~fedexlora.bridge.fold.use_side_branch`; bf16 and nf4
    bases have one anyway).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    kw = {}
    if precision == "nf4":
        from fedexlora.bridge.models import quantization_config

        kw["quantization_config"] = quantization_config("nf4", double_quant=False, dtype=dtype)
    base = LlamaForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    if precision == "nf4":
        import bitsandbytes as bnb

        for module in base.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = False
    lora = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    torch.manual_seed(seed)  # the same initial A in both copies
    model = get_peft_model(base, lora)
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    return use_side_branch(model)


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads, torch {torch.__version__}"
