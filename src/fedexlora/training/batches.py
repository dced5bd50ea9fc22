"""What training on one process and on several shares: batches, schedule, autocast, result.

:mod:`fedexlora.training.local` and :mod:`fedexlora.training.distributed` both use them;
here, so that neither imports the other's module for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TrainResult"]


def _collate(batch, device, pad_to: int = 0) -> dict[str, torch.Tensor]:
    """A :class:`fedexlora.training.local.Encoded` batch as padded tensors on ``device``."""
    n = max(pad_to, *(len(x) for x in batch.input_ids))
    ids = torch.full((len(batch), n), batch.pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch.input_ids):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if batch.kind == "causal_lm":
        lab = torch.full((len(batch), n), -100, dtype=torch.long)
        for i, y in enumerate(batch.labels):
            lab[i, : len(y)] = torch.tensor(y)
        out["labels"] = lab
    elif batch.kind == "regression":
        out["labels"] = torch.tensor(batch.labels, dtype=torch.float32)
    else:
        out["labels"] = torch.tensor(batch.labels, dtype=torch.long)
    return {k: v.to(device) for k, v in out.items()}


@dataclass
class TrainResult:
    """What local training reports.

    Attributes:
        loss: Mean training loss over the steps taken.
        steps: Optimizer steps taken.
        num_examples: Examples in the local dataset.
    """

    loss: float
    steps: int
    num_examples: int


def _schedule(total: int, warmup_ratio: float):
    """Linear warm-up over ``warmup_ratio`` of ``total`` steps, then linear decay to 0."""
    warm = int(warmup_ratio * total)

    def schedule(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return max(0.0, (total - step) / max(1, total - warm))

    return schedule


def _amp(device, dtype: torch.dtype | None):
    dev = torch.device(device)
    return torch.autocast(
        device_type=dev.type, dtype=dtype or torch.float32, enabled=dtype is not None
    )
