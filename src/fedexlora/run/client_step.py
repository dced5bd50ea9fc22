"""A client's step in a round, on either engine: its seed, its training, its upload.

:func:`local_update` trains one client from the global model it holds (through
:mod:`fedexlora.training`: ours, or TRL's ``SFTTrainer``) with the seed
:func:`client_seed` gives every engine alike, with the factors the method's round plan
trains (:meth:`fedexlora.core.methods.MethodSpec.plan`), applies HetLoRA's rank
self-pruning, and reads back exactly the parts the plan uploads
(:func:`fedexlora.bridge.steps.make_upload`);
:func:`save_client_adapter` writes what a client trained as a PEFT adapter
(``save_client_adapters``). The in-process engine (:mod:`fedexlora.run.inprocess`) and
Flower's ClientApp (:mod:`fedexlora.flower.client_app`) both call it, so a client trains
identically on either.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fedexlora.bridge.adapters import LoraHandle
from fedexlora.bridge.steps import make_upload
from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload
from fedexlora.core.methods import get_method
from fedexlora.run.build import autocast_dtype
from fedexlora.run.timing import phase
from fedexlora.training.local import Encoded, train_local

__all__ = ["client_seed", "local_update", "save_client_adapter", "trained_upload"]


def client_seed(seed: int, rnd: int, client: int) -> int:
    """The seed of one client's local training in one round (same for every method)."""
    return (seed * 1_000_003 + rnd * 10_007 + client * 101) % (2**31)


def local_update(
    cfg: RunConfig,
    method: str,
    model: torch.nn.Module,
    data: Encoded,
    rnd: int,
    client: int,
    *,
    steps: int | None = None,
    progress: bool = False,
    dp=None,
    tokenizer=None,
) -> ClientUpload:
    """One client's local step, shared by every engine: train, then read the upload back.

    The model must already hold the global weights (its base with the residuals folded
    in, and the global factors). The seed comes from :func:`client_seed`, so every engine
    trains a given client identically.

    Args:
        cfg: The run configuration.
        method: A method of the registry (:data:`fedexlora.core.methods.REGISTRY`); its
            spec says what the client trains and uploads (``ffa``, for one, uploads no A).
        model: The client's model, on the device it trains on.
        data: The client's examples.
        rnd: The round.
        client: The client id.
        steps: Local steps; ``None`` takes ``cfg.local_steps``.
        progress: Whether to show a progress bar.
        dp: This client's DP-SGD budget (:class:`fedexlora.training.privacy.Budget`), or
            None. With it the upload carries no training loss (NaN): only what DP-SGD
            covers leaves the client. Its sampling and noise come from OS entropy unless
            ``cfg.dp_reproducible``.
        tokenizer: The model's tokenizer (``cfg.trainer == "trl"`` needs it).
    """
    spec = get_method(method)
    sharded = _distributed_checks(cfg)  # a client on several processes, if any
    plan = spec.plan(rnd)  # what this round trains, uploads and keeps
    with phase("setup"):  # the steps are the caller's "train"; this is set-up
        handle = LoraHandle(model)
        hooks = spec.local_hooks(handle, rnd)  # HetLoRA's penalty and pruning
        # after the hooks: the plan alone says what trains (FFA-LoRA's frozen A, RoLoRA's)
        handle.set_trainable(plan.train_A, plan.train_B, plan.train_extra)
    steps = cfg.local_steps if steps is None else steps
    seed, device = client_seed(cfg.seed, rnd, client), next(model.parameters()).device
    if cfg.trainer == "trl":  # TRL's SFTTrainer: the same steps, batch, schedule and seed
        from fedexlora.training.sft import train_encoded

        if tokenizer is None:
            raise ValueError("`trainer` 'trl' needs the tokenizer: local_update(..., tokenizer=)")
        res = train_encoded(
            model, tokenizer, data, steps=steps, seed=seed,
            lr=cfg.lr, batch_size=cfg.batch_size, epochs=cfg.local_epochs,
            device=device, dtype=autocast_dtype(cfg),
            gradient_checkpointing=cfg.gradient_checkpointing,
            weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio,
            max_grad_norm=cfg.max_grad_norm,
        )  # fmt: skip
    else:
        res = train_local(
            model,
            data,
            epochs=cfg.local_epochs,
            steps=steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            warmup_ratio=cfg.warmup_ratio,
            max_grad_norm=cfg.max_grad_norm,
            seed=seed,
            desc=f"{method} r{rnd} client {client}",
            progress=progress,
            device=device,
            autocast=autocast_dtype(cfg),
            dp=dp,
            dp_reproducible=cfg.dp_reproducible,
            penalty=hooks.penalty,
        )
    if hooks.after is not None:
        hooks.after()
    with phase("setup"):  # the upload read back from the model
        return trained_upload(
            method, model, rnd, client, res.num_examples, res.loss, dp=dp, reader=sharded
        )


def trained_upload(
    method: str,
    model,
    rnd: int,
    client: int,
    num_examples: int,
    loss: float,
    *,
    dp=None,
    reader=None,
) -> ClientUpload:
    """The upload of a client whose model holds what it trained (:func:`local_update`'s).

    Also used where the training ran elsewhere (a worker group, :mod:`fedexlora.run.workers`)
    and its result was loaded into the client's model. ``reader`` replaces
    :func:`~fedexlora.bridge.steps.make_upload` (a sharded model's).
    """
    sharded = reader
    plan = get_method(method).plan(rnd)
    # exactly the plan's parts (FedSA-LoRA: B and the head are kept)
    return (sharded or make_upload)(
        model,
        num_examples,
        client_id=client,
        # under DP the loss is not sent: a noiseless mean of batch losses is outside
        # DP-SGD's guarantee (it would be a figure of the client's data in the clear)
        train_loss=loss if dp is None else math.nan,
        include_A=plan.upload_A,
        include_B=plan.upload_B,
        include_extra=plan.upload_extra,
    )


def _distributed_checks(cfg: RunConfig):
    """Refuses what a client on several processes cannot train; ``fsdp``: its upload reader.

    Returns :func:`fedexlora.training.distributed.make_upload` under ``fsdp`` (the model
    is sharded), else ``None``.
    """
    from fedexlora.training import distributed as D

    ctx = D.get_context()
    if ctx is None:
        return None
    D.check_supported(
        ctx.mode, dp=cfg.dp, trainer=cfg.trainer, quantization=cfg.quantization, dora=cfg.dora
    )
    return D.make_upload if ctx.mode == "fsdp" else None


def save_client_adapter(
    model, out_dir: Path, rnd: int, client: int, num_examples: int, weight: float | None = None
) -> Path:
    """Writes the model's current adapter as a PEFT adapter directory with ``meta.json``."""
    from fedexlora.run.layout import RunLayout

    dest = RunLayout(out_dir).client_adapter(rnd, client)
    model.save_pretrained(str(dest))
    meta = {"round": rnd, "client": client, "num_examples": num_examples}
    if weight is not None:
        meta["weight"] = weight
    RunLayout(out_dir).client_adapter_meta(rnd, client).write_text(json.dumps(meta, indent=2))
    return dest
