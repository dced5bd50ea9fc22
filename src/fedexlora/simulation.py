"""The in-process engine: one base model in memory, clients trained in turn.

The server logic (:class:`fedexlora.server.Server`) and the aggregation are the same as in
every other engine; this module only moves tensors between the server and one shared
model, and records what happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import (
    effective_weight,
    fold_residuals,
    get_state,
    layer_info,
    lora_layers,
    restore_base,
    set_state,
    snapshot_base,
)
from .config import RunConfig
from .server import ClientUpload, RoundOutcome, Server
from .training import Encoded, encode, evaluate, train_local

__all__ = [
    "Prepared",
    "apply_round",
    "client_seed",
    "fold_and_measure",
    "local_update",
    "prepare",
    "round_row",
    "run_method",
]


def client_seed(seed: int, rnd: int, client: int) -> int:
    """The seed of one client's local training in one round (same for every method)."""
    return (seed * 1_000_003 + rnd * 10_007 + client * 101) % (2**31)


@dataclass
class Prepared:
    """What every method of a run shares: the task, partitions and tokenized data."""

    task: object
    parts: list[list[int]]
    train: Encoded
    test: Encoded
    tokenizer: object
    partition_table: str


def torch_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> torch dtype."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device` is 'cuda' but no CUDA GPU is available; use 'auto' or 'cpu'")
    return torch.device(name)


def autocast_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The autocast dtype for training and evaluation (``None`` for fp32)."""
    return None if cfg.dtype == "fp32" else torch_dtype(cfg.dtype)


def new_model(cfg: RunConfig, task, method: str):
    """A freshly loaded LoRA model on the run's device; same seed, same head and adapters.

    With ``dtype`` bf16/fp16 the frozen base weights are stored in that dtype while the
    adapters stay fp32 (peft's adapter autocast); with ``quantization`` the base is
    quantized by bitsandbytes. Either way residuals go to an fp32 side branch, never into
    the base weights (:func:`fedexlora.adapters.fold_residuals`).
    """
    from .models import load_model

    model, tokenizer = load_model(
        cfg.model,
        causal=task.kind == "causal_lm",
        num_labels=max(task.num_labels, 1),
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        rslora=cfg.rslora,
        seed=cfg.seed,
        freeze_A=method == "ffa",
        dtype=torch_dtype(cfg.dtype),
        quantization=cfg.quantization,
        double_quant=cfg.double_quant,
    )
    for r in sorted(set(cfg.client_ranks or [])):
        if method in ("fedex", "flora") and r != cfg.lora_r:  # heterogeneous client ranks
            model.add_adapter(f"rank{r}", dataclasses.replace(model.peft_config["default"], r=r))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model.to(resolve_device(cfg.device)), tokenizer


def client_adapter(cfg: RunConfig, method: str, client: int) -> str | None:
    """The peft adapter a client trains when its rank differs from the global one."""
    if not cfg.client_ranks or method not in ("fedex", "flora"):
        return None
    r = cfg.client_ranks[client]
    return None if r == cfg.lora_r else f"rank{r}"


def new_server(cfg: RunConfig, method: str, model) -> Server:
    """The server of one method, from the freshly loaded model's adapters."""
    centralized = method == "centralized"
    client_layers = {}
    for c in range(cfg.num_clients):
        name = client_adapter(cfg, method, c)
        if name is not None:
            client_layers[c] = layer_info(model, name)
    return Server(
        get_state(model, adapter="default"),
        layer_info(model, "default"),
        method="fedex" if centralized else method,
        num_clients=1 if centralized else cfg.num_clients,
        fraction=1.0 if centralized else cfg.fraction,
        weighting=cfg.weighting,
        seed=cfg.seed,
        residual_rank=None if centralized else cfg.residual_rank,
        side_rank=None if centralized else cfg.side_rank,
        max_update_norm=None if centralized else cfg.max_update_norm,
        client_layers=client_layers,
    )


def prepare(cfg: RunConfig, tokenizer, task) -> Prepared:
    """Partitions a loaded task and tokenizes both splits."""
    from .partition import describe_partitions, partition

    scheme = cfg.partition if task.kind == "classification" else "iid"
    parts = partition(
        task.train,
        cfg.num_clients,
        scheme=scheme,
        alpha=cfg.alpha,
        seed=cfg.seed,
        min_partition_size=cfg.min_partition_size,
    )
    table = describe_partitions(task.train, parts, task.label_names or None)
    train = encode(task.train, tokenizer, kind=task.kind, max_length=cfg.max_length)
    test = encode(task.test, tokenizer, kind=task.kind, max_length=cfg.max_length)
    return Prepared(task, parts, train, test, tokenizer, table)


def _summ(values: dict[str, float]) -> dict:
    if not values:
        return {"mean": 0.0, "max": 0.0, "per_layer": {}}
    short = {k.removeprefix("base_model.model."): float(v) for k, v in values.items()}
    return {
        "mean": sum(short.values()) / len(short),
        "max": max(short.values()),
        "per_layer": short,
    }


def round_row(
    method: str,
    rnd: int,
    metrics: dict,
    outcome: RoundOutcome,
    uploads: list[ClientUpload],
    *,
    seconds: float,
    bytes_up: int,
    bytes_down: int,
    approximate: bool,
    sampled: list[int],
    dropped: list[int] | None = None,
    effective: dict[str, float] | None = None,
) -> dict:
    """One ``metrics.jsonl`` row (one method, one round).

    ``effective`` is the per-layer deviation measured on the model
    (:func:`fold_and_measure`); without it the server's own figure is used.
    """
    losses = [u.train_loss for u in uploads if u.client_id in outcome.accepted]
    row = {
        "method": method,
        "round": rnd,
        "metrics": metrics,
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "seconds": seconds,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "deviation": _summ(outcome.deviation),
        "effective_deviation": {
            k: v
            for k, v in _summ(
                outcome.effective_deviation if effective is None else effective
            ).items()
            if k != "per_layer"
        },
        "residual_rank": {
            k.removeprefix("base_model.model."): r.rank for k, r in outcome.residuals.items()
        },
        "sampled": sampled,
        "accepted": outcome.accepted,
        "rejected": {str(k): v for k, v in outcome.rejected.items()},
        "dropped": dropped or [],
        "num_examples": sum(u.num_examples for u in uploads if u.client_id in outcome.accepted),
        "approximate": approximate,
    }
    if approximate:
        # lossy --residual-rank: how far the applied model is from the exact one, per layer
        # (Frobenius norm of the residual kept back as error feedback, before the scale)
        row["approximation_gap"] = {
            k: v for k, v in _summ(outcome.feedback_norm).items() if k != "per_layer"
        }
    if not outcome.accepted:
        row["note"] = "every upload was rejected; the global model is unchanged"
    return row


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
) -> ClientUpload:
    """One client's local step, shared by every engine: train, then read the upload back.

    The model must already hold the global weights (its base with the residuals folded
    in, and the global factors). The seed comes from :func:`client_seed`, so every engine
    trains a given client identically.

    Args:
        cfg: The run configuration.
        method: The method (``ffa`` uploads no A).
        model: The client's model, on the device it trains on.
        data: The client's examples.
        rnd: The round.
        client: The client id.
        steps: Local steps; ``None`` takes ``cfg.local_steps``.
        progress: Whether to show a progress bar.
    """
    res = train_local(
        model,
        data,
        epochs=cfg.local_epochs,
        steps=cfg.local_steps if steps is None else steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_ratio=cfg.warmup_ratio,
        max_grad_norm=cfg.max_grad_norm,
        seed=client_seed(cfg.seed, rnd, client),
        desc=f"{method} r{rnd} client {client}",
        progress=progress,
        device=next(model.parameters()).device,
        autocast=autocast_dtype(cfg),
    )
    state = get_state(model, include_A=method != "ffa")
    return ClientUpload(client, state, res.num_examples, res.loss)


def run_method(
    cfg: RunConfig,
    method: str,
    prep: Prepared,
    *,
    out_dir: Path | None = None,
    on_row: Callable[[dict], None] | None = None,
    progress: bool = True,
    tamper: Callable[[int, int, ClientUpload], ClientUpload] | None = None,
    model=None,
    server: Server | None = None,
    after_round: Callable[[dict, Server, torch.nn.Module], None] | None = None,
):
    """Runs one method for ``cfg.rounds`` rounds and returns ``(rows, model, server)``.

    Args:
        cfg: The run configuration.
        method: ``fedex``, ``fedit``, ``ffa``, ``flora`` or ``centralized``.
        prep: The shared task, partitions and tokenized data.
        out_dir: Where client adapters go when ``cfg.save_client_adapters`` is set.
        on_row: Called with each round's metrics row as soon as it exists.
        progress: Whether to show progress bars.
        tamper: Test hook ``(round, client, upload) -> upload``: lets a test play a
            faulty or hostile client.
        model: A model to use instead of loading one (with ``server``: already restored).
        server: A server restored from a checkpoint; training resumes after its round.
        after_round: Called with ``(row, server, model)`` after each round (checkpoints).
    """
    centralized = method == "centralized"
    if model is None:
        model, _ = new_model(cfg, prep.task, method)
    parts = [sorted(i for p in prep.parts for i in p)] if centralized else prep.parts
    server = server or new_server(cfg, method, model)
    client_data = [prep.train.subset(p) for p in parts]
    # centralized: as many gradient steps per round as all clients together
    steps = cfg.local_steps
    if centralized and steps is not None:
        steps *= len(prep.parts)
    rows = []
    for rnd in range(server.round + 1, cfg.rounds + 1):
        t0 = time.perf_counter()
        sampled = server.sample(rnd)
        uploads, bytes_up, bytes_down = [], 0, 0
        for c in sampled:
            payload = server.payload_for(c)
            bytes_down += payload.nbytes
            set_state(model, server.state)  # the shared base already holds the residuals
            with _client_view(model, server, c, client_adapter(cfg, method, c)):
                up = local_update(
                    cfg, method, model, client_data[c], rnd, c, steps=steps, progress=progress
                )
            num_examples = up.num_examples
            if tamper is not None:
                up = tamper(rnd, c, up)
            bytes_up += up.nbytes
            uploads.append(up)
            if cfg.save_client_adapters and out_dir is not None:
                save_client_adapter(model, out_dir, rnd, c, num_examples)
        outcome = server.aggregate(uploads)
        if cfg.save_client_adapters and out_dir is not None:
            for c, w in outcome.weights.items():
                meta = Path(out_dir) / "clients" / f"round-{rnd}" / f"client-{c}" / "meta.json"
                meta.write_text(json.dumps({**json.loads(meta.read_text()), "weight": w}))
        metrics, measured = apply_round(cfg, method, rnd, model, server, outcome, prep, uploads)
        if centralized:
            bytes_up = bytes_down = 0
        row = round_row(
            method,
            rnd,
            metrics,
            outcome,
            uploads,
            seconds=time.perf_counter() - t0,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            approximate=cfg.approximate and not centralized,
            sampled=sampled,
            effective=measured,
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if after_round is not None:
            after_round(row, server, model)
    return rows, model, server


def apply_round(
    cfg: RunConfig,
    method: str,
    rnd: int,
    model,
    server: Server,
    outcome: RoundOutcome,
    prep: Prepared,
    uploads: list[ClientUpload],
) -> tuple[dict[str, float], dict[str, float]]:
    """Brings the server's model to the new global state and evaluates it (every engine).

    Folds the round's residuals into the base, loads the global factors, measures how far
    the model is from the ideal (:func:`fold_and_measure`), warns about rejected uploads,
    and evaluates on the test split.

    Returns:
        ``(metrics, deviation)``: the task metrics, and per layer the measured relative
        deviation of the model from the ideal average of the clients' models.
    """
    measured = fold_and_measure(model, server, outcome, uploads)
    for cid, why in outcome.rejected.items():
        warnings.warn(f"{method} round {rnd}: rejected client {cid}: {why}", stacklevel=2)
    if uploads and not outcome.accepted:
        warnings.warn(
            f"{method} round {rnd}: every upload was rejected; the global model is unchanged",
            stacklevel=2,
        )
    metrics = evaluate(
        model,
        prep.test,
        prep.task,
        batch_size=cfg.eval_batch_size,
        max_new_tokens=cfg.max_new_tokens,
        tokenizer=prep.tokenizer,
        device=next(model.parameters()).device,
        autocast=autocast_dtype(cfg),
    )
    return metrics, measured


@torch.no_grad()
def fold_and_measure(
    model, server: Server, outcome: RoundOutcome, uploads: list[ClientUpload]
) -> dict[str, float]:
    """Applies a round's outcome to ``model`` and measures its exactness on the model.

    Loads the new global factors, folds each layer's residual (into the base weight, or
    its side branch), and compares the layer's effective weight afterwards (base, side
    branch and adapter, as the forward pass applies them) with the ideal
    ``W + sum_i p_i (T_i + s_i B_i A_i)`` computed in fp64 from the accepted uploads
    (:meth:`Server.ideal_update`). One layer at a time, so at most three dense fp64
    copies of one layer exist at once.

    Returns:
        Per layer ``||W_model - W_ideal|| / ||W_ideal - W_previous||``: the error relative
        to the round's update (empty when no upload was accepted). This is what the
        lossy modes really apply, not what the server meant to.
    """
    set_state(model, server.state)
    measure = bool(outcome.weights) and outcome.previous is not None
    out = {}
    for name, layer in lora_layers(model).items():
        before = effective_weight(layer, lora=False) if measure else None
        if name in outcome.residuals:
            fold_residuals(model, {name: outcome.residuals[name]}, side_rank=server.side_rank)
        if before is None:
            continue
        after = effective_weight(layer)
        ideal = before + server.ideal_update(name, uploads, outcome).to(before.device)
        A0, B0 = outcome.previous.factors[name]
        move = (ideal - before) - server.layers[name].scale * (B0.double() @ A0.double()).to(
            before.device
        )
        den = float(torch.linalg.norm(move))
        out[name] = float(torch.linalg.norm(after - ideal)) / den if den > 0 else 0.0
    return out


@contextlib.contextmanager
def _client_view(model, server: Server, client: int, adapter: str | None):
    """Temporarily turns the shared model into a client of another rank.

    The client's remainder ``T_c`` is folded into the shared base under the client's own
    adapter and scale, and restored bit for bit afterwards.
    """
    if adapter is None:
        yield
        return
    snapshot = snapshot_base(model)
    info = layer_info(model, adapter)
    remainder = server.remainder.get(client, {})
    fold_residuals(
        model, {n: t.scaled(1.0 / info[n].scale) for n, t in remainder.items()}, adapter=adapter
    )
    model.set_adapter(adapter)
    set_state(model, server.sent[client], adapter=adapter)
    try:
        yield
    finally:
        restore_base(model, snapshot)
        model.set_adapter("default")


def save_client_adapter(
    model, out_dir: Path, rnd: int, client: int, num_examples: int, weight: float | None = None
) -> Path:
    """Writes the model's current adapter as a PEFT adapter directory with ``meta.json``."""
    dest = Path(out_dir) / "clients" / f"round-{rnd}" / f"client-{client}"
    model.save_pretrained(str(dest))
    meta = {"round": rnd, "client": client, "num_examples": num_examples}
    if weight is not None:
        meta["weight"] = weight
    (dest / "meta.json").write_text(json.dumps(meta, indent=2))
    return dest
