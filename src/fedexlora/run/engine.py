"""What both engines share: models, servers, data, local updates, rounds and their rows.

The in-process engine (:mod:`fedexlora.run.simulation`) and the Flower engine
(:mod:`fedexlora.flower`) are siblings over this module: both load models and servers,
prepare data, train clients and apply rounds through the same functions, so they produce
the same global model. The model-level steps a user's own loop needs live in
:mod:`fedexlora.bridge.steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fedexlora.bridge.adapters import folded_delta, get_state, layer_info, set_state
from fedexlora.bridge.steps import apply_outcome, make_upload
from fedexlora.config import RunConfig
from fedexlora.core.methods import get_method
from fedexlora.server.server import ClientUpload, RoundOutcome, Server, example_count
from fedexlora.training.local import Encoded, encode, evaluate, train_local

__all__ = [
    "Prepared",
    "apply_round",
    "autocast_dtype",
    "client_adapter",
    "client_seed",
    "evaluate_personal",
    "local_update",
    "new_model",
    "new_server",
    "personal_metrics",
    "prepare",
    "resolve_device",
    "round_row",
    "save_client_adapter",
    "torch_dtype",
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
    test_parts: list[list[int]] = dataclasses.field(default_factory=list)


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
    the base weights (:func:`fedexlora.bridge.adapters.fold_residuals`); so they do on an
    fp32 base with ``fp32_side_branch``.
    """
    from fedexlora.bridge.models import load_model

    spec = get_method(method)
    model, tokenizer = load_model(
        cfg.model,
        causal=task.kind == "causal_lm",
        num_labels=max(task.num_labels, 1),
        dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        rslora=cfg.rslora,
        seed=cfg.seed,
        dtype=torch_dtype(cfg.dtype),
        quantization=cfg.quantization,
        double_quant=cfg.double_quant,
        **spec.adapter_setup(cfg.lora_r, cfg.lora_alpha, cfg.fedsb_rank),
    )
    check_max_length(cfg, model)
    if cfg.fp32_side_branch_resolved:
        from fedexlora.bridge.adapters import use_side_branch

        use_side_branch(model)
    if spec.latent:  # Fed-SB: its frozen A and B, and the r x r core between them
        _install_fedsb(cfg, task, model, tokenizer)
    for r in sorted(set(cfg.client_ranks or [])):
        if spec.hetero_ranks and r != cfg.lora_r:  # heterogeneous client ranks
            model.add_adapter(f"rank{r}", dataclasses.replace(model.peft_config["default"], r=r))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model.to(resolve_device(cfg.device)), tokenizer


def _install_fedsb(cfg: RunConfig, task, model, tokenizer) -> None:
    """Fed-SB's frozen A and B (the same in every process: seeded, or from the same data)."""
    from fedexlora.bridge.latent import install

    init = cfg.fedsb_init_resolved
    data = None
    if init == "gradient":
        # The sum of every client's gradient equals the gradient on the pooled examples:
        # the simulation computes that sum here (a deployment would collect it once).
        g = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randperm(len(task.train), generator=g)[: cfg.fedsb_init_samples].tolist()
        data = encode(
            task.train.select(pick),
            tokenizer,
            kind=task.kind,
            max_length=cfg.max_length,
            template=task.template,
        )
    grads = None
    if data is not None:
        from fedexlora.bridge.layers import lora_layers
        from fedexlora.training.local import estimate_gradients

        grads = estimate_gradients(
            model,
            data,
            samples=cfg.fedsb_init_samples,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            layers=lora_layers(model),
        )
    steps = cfg.local_steps or 1
    install(model, init=init, seed=cfg.seed, grads=grads, lr=cfg.lr, total_steps=cfg.rounds * steps)


def client_adapter(cfg: RunConfig, method: str, client: int) -> str | None:
    """The peft adapter a client trains when its rank differs from the global one."""
    if not cfg.client_ranks or not get_method(method).hetero_ranks:
        return None
    r = cfg.client_ranks[client]
    return None if r == cfg.lora_r else f"rank{r}"


def new_server(cfg: RunConfig, method: str, model) -> Server:
    """The server of one method, from the freshly loaded model's adapters."""
    spec = get_method(method)
    centralized = not spec.federated  # one party: its server's math, one client
    client_layers = {}
    for c in range(cfg.num_clients):
        name = client_adapter(cfg, method, c)
        if name is not None:
            client_layers[c] = layer_info(model, name)
    server = Server(
        get_state(model, adapter="default"),
        layer_info(model, "default"),
        method=spec.server,
        num_clients=1 if centralized else cfg.num_clients,
        fraction=1.0 if centralized else cfg.fraction,
        weighting=cfg.weighting,
        seed=cfg.seed,
        residual_rank=None if centralized else cfg.residual_rank,
        side_rank=None if centralized else cfg.side_rank,
        max_update_norm=None if centralized else cfg.max_update_norm,
        client_layers=client_layers,
    )
    if not (spec.latent or spec.personalized):
        # every engine folds each outcome into this model (apply_round): the server reads
        # a dense base delta from it instead of keeping a second copy (Fed-SB's deltas are
        # in latent coordinates, FedSA-LoRA folds nothing into a global model)
        server.delta_source = functools.partial(folded_delta, model)
    return server


def effective_partition(cfg: RunConfig, task) -> tuple[str, str]:
    """The scheme the clients are partitioned by, and a note when it is not ``cfg``'s.

    Dirichlet partitioning draws class proportions, so a task without class labels (a
    causal-LM task such as gsm8k) is partitioned IID; the run says so in its header,
    ``partitions.txt`` and ``config.toml``.
    """
    if cfg.partition == "dirichlet" and task.kind != "classification":
        return "iid", (
            f"partition 'dirichlet' needs class labels and task {cfg.task!r} has none "
            f"({task.kind}): its clients are partitioned iid"
        )
    return cfg.partition, ""


def check_max_length(cfg: RunConfig, model) -> None:
    """Refuses a ``max_length`` beyond the positions the model can embed.

    Raises:
        ValueError: Naming the flag, the limit and where it comes from.
    """
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        limit = getattr(config, attr, None)
        if isinstance(limit, int) and limit > 0:
            if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
                limit -= 2  # their position ids start after the padding index
            if cfg.max_length > limit:
                raise ValueError(
                    f"--max-length {cfg.max_length} exceeds the {limit} positions model "
                    f"{cfg.model!r} can embed ({attr}); use --max-length {limit} or less"
                )
            return


def prepare(cfg: RunConfig, tokenizer, task) -> Prepared:
    """Partitions a loaded task and tokenizes both splits."""
    if cfg.trainer == "trl" and task.kind != "causal_lm":
        raise ValueError(
            f"`trainer` 'trl' (TRL's SFTTrainer) trains causal-LM tasks; task {cfg.task!r} is "
            f"{task.kind}; fix: --trainer builtin, or a causal-LM task such as gsm8k"
        )
    from fedexlora.tasks.partition import describe_partitions, partition, partition_like

    scheme, note = effective_partition(cfg, task)
    parts = partition(
        task.train,
        cfg.num_clients,
        scheme=scheme,
        alpha=cfg.alpha,
        seed=cfg.seed,
        min_partition_size=cfg.min_partition_size,
    )
    table = describe_partitions(task.train, parts, task.label_names or None)
    if note:
        table = f"note: {note}\n{table}"
    train = encode(
        task.train, tokenizer, kind=task.kind, max_length=cfg.max_length, template=task.template
    )
    test = encode(
        task.test, tokenizer, kind=task.kind, max_length=cfg.max_length, template=task.template
    )
    classes = task.kind == "classification" and "label" in task.train.column_names
    test_parts = partition_like(  # each client's own test split (personalized methods)
        task.train["label"] if classes else None,
        parts,
        task.test["label"] if classes else None,
        len(task.test),
        seed=cfg.seed,
    )
    return Prepared(task, parts, train, test, tokenizer, table, test_parts)


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
    bytes_down_max: int = 0,
    server_bytes: dict[str, int] | None = None,
    test_examples: int = 0,
    server_seconds: float = 0.0,
    personalized: dict[int, tuple[dict[str, float], int]] | None = None,
) -> dict:
    """One ``metrics.jsonl`` row (one method, one round).

    ``effective`` is the per-layer deviation measured on the model
    (:func:`fedexlora.bridge.steps.apply_outcome`); without it the server's own figure is used.
    ``bytes_down_max`` is the largest payload one client received; ``server_bytes`` is
    :meth:`fedexlora.server.Server.nbytes` after the round; ``test_examples`` is how many
    examples ``metrics`` were measured on; ``server_seconds`` is the server's own work
    in the round (payloads, validation, aggregation: ``Server.last_round_seconds``).
    ``personalized`` (a personalized method: no global model) is each evaluated client's
    ``(metrics, test examples)``: ``metrics`` are then their weighted mean, the clients'
    own go under ``personalized``, and no deviation is reported (``None``).
    """
    losses = [u.train_loss for u in uploads if u.client_id in outcome.accepted]
    row = {
        "method": method,
        "round": rnd,
        "metrics": metrics,
        "test_examples": test_examples,
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "seconds": seconds,
        "server_seconds": server_seconds,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "bytes_down_max": bytes_down_max,
        "server_bytes": dict(server_bytes or {}),
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
        "num_examples": sum(
            example_count(u.num_examples)[0] for u in uploads if u.client_id in outcome.accepted
        ),
        "approximate": approximate,
    }
    if personalized is not None:
        row["personalized"] = {
            "clients": {str(c): m for c, (m, n) in sorted(personalized.items()) if n},
            "test_examples": {str(c): n for c, (_, n) in sorted(personalized.items()) if n},
        }
        row["test_examples"] = sum(n for _, n in personalized.values())
        row["deviation"] = {"mean": None, "max": None, "per_layer": {}}
        row["effective_deviation"] = {"mean": None, "max": None}
    if approximate:
        # lossy --residual-rank: how far the applied model is from the exact one, per layer
        # (Frobenius norm of the residual kept back as error feedback, before the scale)
        row["approximation_gap"] = {
            k: v for k, v in _summ(outcome.feedback_norm).items() if k != "per_layer"
        }
    if outcome.secure is not None:  # secure aggregation: read from the sums
        row["secure"] = {"clipped": int(outcome.secure["clipped"])}
        row["train_loss"] = float(outcome.secure["train_loss"])
        row["num_examples"] = outcome.secure["num_examples"]  # None: uniform weights
        # what the sums cannot tell is not measured (None), never reported as 0:
        # FedIT's loss needs the products; the model's deviation needs the uploads
        if not outcome.deviation:
            row["deviation"] = {"mean": None, "max": None, "per_layer": {}}
        if not effective:
            row["effective_deviation"] = {"mean": None, "max": None}
    if effective and outcome.rounding and row["effective_deviation"].get("max") is not None:
        # what fp32's rounding of the weights alone may explain (the exactness check's floor)
        row["rounding_floor"] = max(outcome.rounding.values())
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
    dp=None,
    tokenizer=None,
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
        dp: This client's DP-SGD budget (:class:`fedexlora.training.privacy.Budget`), or None.
        tokenizer: The model's tokenizer (``cfg.trainer == "trl"`` needs it).
    """
    spec = get_method(method)
    train_A, train_B = spec.trained(rnd)  # latent (Fed-SB): A is I in its coordinates
    if spec.alternating:  # RoLoRA: B in odd rounds, A in even ones
        from fedexlora.bridge.adapters import set_trainable

        set_trainable(model, train_A=train_A, train_B=train_B)
    penalty, prune = _rank_pruning(model) if spec.prunes_rank else (None, None)
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
            penalty=penalty,
        )
    if prune is not None:
        prune()
    up_A, up_B = spec.uploaded(rnd)  # FedSA-LoRA: B is trained but kept
    return make_upload(
        model,
        res.num_examples,
        client_id=client,
        train_loss=res.loss,
        include_A=up_A,
        include_B=up_B,
        include_extra=spec.shares_head,
    )


def _rank_pruning(model):
    """HetLoRA's rank self-pruning for one round: ``(penalty, prune)``, or ``(None, None)``.

    ``penalty`` (added to the local loss) is ``λ ||B[:, t:r]|| ||A[t:r]||`` over the tail
    of the rank ``r`` the client uses, ``t = ⌊γ r⌋``; ``prune`` (after training) cuts the
    adapter to rank ``t`` when that tail's norm product ended smaller than it began.
    """
    from fedexlora.bridge.adapters import tail_norm
    from fedexlora.core.hetero import cut_rank, used_rank
    from fedexlora.core.methods.hetlora import LAMBDA, pruning_tail

    rank = used_rank(get_state(model, include_extra=False))
    cut = pruning_tail(rank)
    if not 1 <= cut < rank:
        return None, None
    with torch.no_grad():
        before = float(tail_norm(model, cut, rank))

    def prune() -> None:
        with torch.no_grad():
            if float(tail_norm(model, cut, rank)) < before:  # the tail shrank: cut it off
                set_state(model, cut_rank(get_state(model, include_extra=False), cut))

    return (lambda: LAMBDA * tail_norm(model, cut, rank)), prune


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
    the model is from the ideal (:func:`fedexlora.bridge.steps.apply_outcome`), warns about
    rejected uploads, and evaluates on the test split. A personalized method (FedSA-LoRA)
    has no global model: nothing is measured or evaluated here (``({}, {})``); the
    engine evaluates each client's own model (:func:`evaluate_personal`).

    Returns:
        ``(metrics, deviation)``: the task metrics, and per layer the measured relative
        deviation of the model from the ideal average of the clients' models.
    """
    personal = get_method(method).personalized
    measured = {} if personal else apply_outcome(model, server, outcome, uploads)
    if personal:
        set_state(model, server.state)
    for cid, why in outcome.rejected.items():
        warnings.warn(f"{method} round {rnd}: rejected client {cid}: {why}", stacklevel=2)
    if uploads and not outcome.accepted:
        warnings.warn(
            f"{method} round {rnd}: every upload was rejected; the global model is unchanged",
            stacklevel=2,
        )
    if personal:
        return {}, measured
    return _test_metrics(cfg, model, prep, prep.test), measured


def _test_metrics(cfg: RunConfig, model, prep: Prepared, data: Encoded) -> dict[str, float]:
    """The task metrics of ``model`` on ``data`` (some or all of the test split)."""
    return evaluate(
        model,
        data,
        prep.task,
        batch_size=cfg.eval_batch_size,
        max_new_tokens=cfg.max_new_tokens,
        num_beams=cfg.num_beams,
        tokenizer=prep.tokenizer,
        device=next(model.parameters()).device,
        autocast=autocast_dtype(cfg),
    )


@torch.no_grad()
def evaluate_personal(
    cfg: RunConfig, method: str, model, prep: Prepared, client: int, state, own=None
) -> tuple[dict[str, float], int]:
    """One client's own model on its own test split (personalized methods).

    The model takes the parts of ``state`` (the global ones) that the method's clients do
    not keep (:attr:`MethodSpec.keeps`), and the parts the client keeps (``own``; ``None``:
    the model holds the client's own already).

    Returns:
        ``(metrics, n)``: the task metrics and the size of the client's test split
        (``({}, 0)`` when it has none).
    """
    rows = prep.test_parts[client] if prep.test_parts else []
    if not rows:
        return {}, 0
    from fedexlora.core.state import AdapterState

    keeps = get_method(method).keeps
    shared = AdapterState(
        factors={
            k: (None if "A" in keeps else A, None if "B" in keeps else B)
            for k, (A, B) in state.factors.items()
        },
        extra={} if "head" in keeps else state.extra,
    )
    set_state(model, shared)
    if own is not None:
        set_state(model, own)
    return _test_metrics(cfg, model, prep, prep.test.subset(rows)), len(rows)


def personal_metrics(per_client: dict[int, tuple[dict[str, float], int]]) -> dict:
    """The clients' own metrics, averaged weighted by their test examples."""
    total = sum(n for _, n in per_client.values())
    if total == 0:
        return {}
    keys = list(dict.fromkeys(k for m, n in per_client.values() if n for k in m))
    return {  # in the metrics' own order: the headline metric first
        k: sum(float(m[k]) * n for m, n in per_client.values() if n and k in m) / total
        for k in keys
    }


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
