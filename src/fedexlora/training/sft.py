"""Local training with TRL's ``SFTTrainer`` (``pip install 'fedex-lora[trl]'``).

Knows nothing of federation, like :mod:`fedexlora.training.local`: a client applies the
server's payload before, and makes its upload after (``fedexlora run --trainer trl``, the
FlowerTune-style app and ``examples/trl_sft`` do). TRL does the rest as usual: the
tokenizer's chat template on conversational data, the loss on the completion only, and
packing where asked. Nothing here formats a conversation or masks a label by hand.

On a client of several processes (``--nproc-per-client N --distributed ddp``: a
:class:`~fedexlora.training.distributed.DistContext` is set), each rank's ``SFTTrainer``
trains under DDP (accelerate wraps the model) on the single process's global batches
(:class:`~fedexlora.training.trainer_ranks.OneProcessBatches`), so the trained factors
equal one process's up to float reassociation.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from fedexlora.training.local import Encoded, TrainResult
from fedexlora.training.trainer_ranks import one_process_batches

__all__ = [
    "chat_generate",
    "conversations",
    "encoded_dataset",
    "require_trl",
    "sft_config",
    "train_sft",
]


def require_trl() -> None:
    """Raises a clear error when TRL is not installed."""
    if importlib.util.find_spec("trl") is None:
        raise ValueError("TRL is not installed; fix: pip install 'fedex-lora[trl]'")


def conversations(rows: Mapping[str, Any], prompt: str = "prompt", response: str = "response"):
    """Prompt and response columns as TRL's conversational prompt-completion data.

    One user turn and one assistant turn per row, for the tokenizer's own chat template.
    """
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in rows[prompt]],
            "completion": [[{"role": "assistant", "content": r}] for r in rows[response]],
        }
    )


def encoded_dataset(data: Encoded):
    """A tokenized causal-LM split as TRL's pre-tokenized data.

    ``input_ids`` and a ``completion_mask`` (1 where the label is kept), so that TRL builds
    the completion-only labels itself, the prompt formatted exactly as evaluation does.

    Raises:
        ValueError: If ``data`` is not a causal-LM split.
    """
    from datasets import Dataset

    if data.kind != "causal_lm":
        raise ValueError(f"TRL's SFTTrainer trains causal-LM data, got {data.kind!r} examples")
    masks = [[int(label != -100) for label in labels] for labels in data.labels]
    return Dataset.from_dict({"input_ids": data.input_ids, "completion_mask": masks})


def sft_config(
    output_dir: str,
    *,
    steps: int | None,
    seed: int,
    lr: float = 2e-4,
    batch_size: int = 2,
    epochs: float = 1.0,
    max_length: int | None = 1024,
    packing: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    progress: bool = False,
    **overrides: Any,
):
    """One client's round of TRL SFT: the loss on the completion only.

    TRL's bf16 and gradient-checkpointing defaults are set from the arguments instead:
    mixed precision only where ``dtype`` asks for it (on a CPU without AVX512-BF16 or AMX,
    bf16 matmuls are about 19x slower than fp32: docs/BENCHMARKS.md, "bf16 on a CPU"),
    and a small model needs no checkpointing.

    Args:
        output_dir: TRL's output directory (nothing is saved there: ``save_strategy="no"``).
        steps: Optimizer steps; ``None`` trains ``epochs`` passes.
        seed: The data order and dropout.
        lr: Peak learning rate.
        batch_size: Examples per step.
        epochs: Passes over the data when ``steps`` is ``None``.
        max_length: Tokens per example (or per packed sequence).
        packing: TRL's packing (best-fit; padding-free, meant for FlashAttention).
        device: Where the model trains (``cpu`` sets TRL's ``use_cpu``).
        dtype: Mixed precision (bf16, or fp16 on a GPU); ``None`` trains in fp32.
        gradient_checkpointing: Trade compute for memory.
        progress: Whether TRL shows its progress bar.
        **overrides: Any other ``SFTConfig`` field (FlowerTune's training arguments).
    """
    require_trl()
    from trl import SFTConfig

    gpu = torch.device(device).type != "cpu"
    kwargs = dict(
        output_dir=output_dir, max_steps=-1 if steps is None else steps,
        num_train_epochs=epochs, per_device_train_batch_size=batch_size, learning_rate=lr,
        seed=seed, data_seed=seed, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=not gpu, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        gradient_checkpointing=gradient_checkpointing,
        disable_tqdm=not progress, max_length=max_length, packing=packing,
        completion_only_loss=True, dataset_num_proc=None,
    )  # fmt: skip
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


def train_sft(model: torch.nn.Module, tokenizer, dataset, args) -> TrainResult:
    """Trains ``model``'s trainable parameters with TRL's ``SFTTrainer``.

    Args:
        model: A peft model (its adapter is what trains).
        tokenizer: The model's tokenizer (its chat template formats conversational data).
        dataset: Conversational prompt-completion data (:func:`conversations`), plain
            prompt-completion text, or pre-tokenized data (:func:`encoded_dataset`).
        args: An ``SFTConfig`` (:func:`sft_config`).
    """
    require_trl()
    import datasets
    from transformers import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    was_training = model.training
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # TRL's dataset preparation, every round: quiet
    # TRL casts a quantized model's trainable weights to bf16 (QLoRA's recipe). The
    # adapter must stay as it is: the global factors it was given, in fp32, or the client
    # would start from a rounded global model. The very tensors are put back.
    kept = {n: p.data for n, p in model.named_parameters() if p.requires_grad}
    ranks = _ranks(args)
    trainer_cls = SFTTrainer if ranks is None else one_process_batches(SFTTrainer)
    try:
        trainer = trainer_cls(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        for n, p in model.named_parameters():
            if n in kept and p.data is not kept[n]:
                p.data = kept[n]
        if args.disable_tqdm:  # no bar, and no dict of metrics printed at the end either
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
        out = trainer.train()
        del trainer  # and with it accelerate's DDP wrapper of the model
    finally:
        if bars:
            datasets.enable_progress_bars()
    model.train(was_training)
    loss = float(out.training_loss)
    if ranks is not None:  # each rank's: its tokens' loss over the global count, times N
        from fedexlora.training.distributed import all_sum

        loss = all_sum([loss], ranks)[0] / ranks.world_size
    return TrainResult(loss=loss, steps=int(out.global_step), num_examples=len(dataset))


def _ranks(args):
    """The client's distributed context (DDP over its ranks), or ``None`` on one process.

    Raises:
        ValueError: Under ``fsdp`` (fedex-lora shards the model itself; the Trainer would
            wrap it in DDP again), or with packing (before TRL builds anything).
    """
    from fedexlora.training.distributed import check_supported, get_context
    from fedexlora.training.trainer_ranks import PACKING_REFUSED

    ctx = get_context()
    if ctx is None:
        return None
    check_supported(ctx.mode, trainer="trl")
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):
        raise ValueError(PACKING_REFUSED)
    return ctx


def train_encoded(
    model: torch.nn.Module,
    tokenizer,
    data: Encoded,
    *,
    steps: int | None,
    seed: int,
    lr: float,
    batch_size: int,
    epochs: float = 1.0,
    max_length: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    progress: bool = False,
    warmup_ratio: float = 0.0,
    **overrides: Any,
) -> TrainResult:
    """:func:`train_sft` on a tokenized causal-LM split (``fedexlora run --trainer trl``).

    ``warmup_ratio`` becomes a whole number of warm-up steps, as the builtin trainer counts
    them (``int(ratio * total steps)``).
    """
    if warmup_ratio:
        total = steps or math.ceil(math.ceil(len(data) / batch_size) * epochs)
        overrides["warmup_steps"] = int(warmup_ratio * total)
    with tempfile.TemporaryDirectory(prefix="fedexlora-sft-") as out:
        args = sft_config(
            out, steps=steps, seed=seed, lr=lr, batch_size=batch_size, epochs=epochs,
            max_length=max_length, device=device, dtype=dtype,
            gradient_checkpointing=gradient_checkpointing, progress=progress, **overrides,
        )  # fmt: skip
        return train_sft(model, tokenizer, encoded_dataset(data), args)


@torch.no_grad()
def chat_generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 160) -> list[str]:
    """Greedy completions of ``prompts``, each one user turn through the chat template.

    The prompt is formatted as TRL formatted it in training (``add_generation_prompt``).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outs = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(device)
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
        outs.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    model.train(was_training)
    return outs
