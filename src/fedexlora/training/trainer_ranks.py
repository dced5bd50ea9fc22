"""A transformers ``Trainer`` on N processes that trains on the single process's batches.

Under torch.distributed (``torchrun``, ``accelerate launch``, or a client's worker group)
a ``Trainer`` trains with DDP: accelerate wraps the model, and by default each rank draws
batches of its own (``per_device_train_batch_size`` each, so the global batch is N times
one process's, and the data order is another). :class:`OneProcessBatches` changes only
the data: every rank draws the single process's global batch (the same seeded sampler,
``data_seed``, and the same last, shorter batch of an epoch), collates it whole (padded
as one process pads it) and keeps its contiguous share (:func:`~fedexlora.training.
distributed.share`). A rank whose share is empty (a batch shorter than N) trains the
batch's first example with every label masked, which adds nothing. The Trainer's own loss
scaling then makes each step the single process's: the loss is summed over the tokens
and divided by the global batch's label count (``num_items_in_batch``, gathered across
the ranks with ``average_tokens_across_devices``), then DDP averages the ranks'
gradients, times N. So the trained weights equal one process's up to float
reassociation, without dropout (each rank draws its own masks).

Needs a loss that divides by the token count it is given (``num_items_in_batch``:
transformers' causal LMs, and TRL's ``SFTTrainer``, which computes its loss so; a
sequence classifier's mean loss does not) and no padding-free batches (TRL's packing
flattens a batch into one row, which cannot be split by example:
:func:`fedexlora.training.sft.train_sft` refuses it, :data:`PACKING_REFUSED`, before TRL
builds anything).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["OneProcessBatches", "one_process_batches", "rank_share_collator"]

PACKING_REFUSED = (
    "TRL's packing / padding_free flattens a batch into one row, which cannot be split "
    "across a client's processes; fix: packing=False, or one process"
)


def rank_share_collator(
    collate: Callable[[list], Mapping[str, Any]], rank: int, world: int
) -> Callable[[list], dict[str, Any]]:
    """``collate``, then rank ``rank``'s contiguous rows of the collated global batch.

    Every tensor whose first dimension is the batch's size is cut; a share that is empty
    gets the batch's first row with its ``labels`` all ``-100`` (it trains nothing).

    Raises:
        ValueError: On a batch without ``labels`` that must give an empty share.
    """
    from fedexlora.training.distributed import share

    def collate_share(features: list) -> dict[str, Any]:
        batch = collate(features)
        n = len(features)
        lo, hi = share(n, rank, world)
        empty = hi == lo
        if empty:
            lo, hi = 0, 1
        out = {}
        for key, value in batch.items():
            rows = torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n
            out[key] = value[lo:hi] if rows else value
        if empty:
            if "labels" not in out:
                raise ValueError(
                    f"a global batch of {n} examples leaves rank {rank} of {world} nothing, "
                    "and the batch has no `labels` to mask its stand-in example"
                )
            out["labels"] = torch.full_like(out["labels"], -100)
        return out

    return collate_share


class OneProcessBatches:
    """Mixin for a ``transformers.Trainer`` (first in the bases): the one process's batches.

    ``class Mine(OneProcessBatches, Trainer)``, or :func:`one_process_batches`. On one
    process it changes nothing. ``per_device_train_batch_size`` is then the global batch.
    """

    def get_train_dataloader(self):
        """The Trainer's loader, every rank iterating all of its batches, each cut to a share."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().get_train_dataloader()
        if not self.model_accepts_loss_kwargs or not self.args.average_tokens_across_devices:
            raise ValueError(
                "this model's loss cannot be weighted by the global batch's tokens across "
                "processes (its forward takes no loss kwargs, or average_tokens_across_devices "
                "is off); fix: train it on one process"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        collate = self.data_collator
        self.data_collator = rank_share_collator(collate, rank, world)
        try:
            loader = super().get_train_dataloader()
        finally:
            self.data_collator = collate
        shard = loader.batch_sampler  # accelerate's BatchSamplerShard: made a pass-through
        if hasattr(shard, "num_processes"):
            # every batch on every rank, the last shorter one as it is (no looping back)
            shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
        return loader


def one_process_batches(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass) with :class:`OneProcessBatches`."""
    return type(trainer_cls.__name__, (OneProcessBatches, trainer_cls), {})
