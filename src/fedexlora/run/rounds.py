"""The end of a round, as both engines close it, whatever carried the round.

An engine (in-process, :mod:`fedexlora.run.inprocess`; or Flower's ServerApp,
:mod:`fedexlora.flower.server_app`) samples, sends payloads, trains and aggregates in its
own way, then hands what it measured (:class:`RoundTraffic`) to :func:`close_round`, which
brings the global model to the outcome, evaluates it (or, for a personalized method, each
client's own model, through the engine's ``evaluate_clients``) and writes the round's
``metrics.jsonl`` row, privacy report included. Its steps are here too: the outcome
applied and the model evaluated (:func:`apply_round`), each client's own model for a
personalized method (:func:`evaluate_personal`, which a Flower client calls itself), the
row (:func:`round_row`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from fedexlora.bridge.adapters import set_state
from fedexlora.bridge.steps import apply_outcome
from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload, RoundOutcome, example_count
from fedexlora.core.methods import get_method
from fedexlora.run.build import Prepared, autocast_dtype
from fedexlora.run.timing import RoundClock, phase, running
from fedexlora.server.server import Server
from fedexlora.training.local import Encoded, evaluate

__all__ = [
    "RoundTraffic",
    "apply_round",
    "DP_SECURE",
    "DP_SEEDED",
    "close_round",
    "dp_randomness",
    "lossy",
    "evaluate_personal",
    "personal_metrics",
    "round_row",
    "train_loss",
]

EvaluateClients = Callable[[list[int]], dict[int, tuple[dict[str, float], int]]]
"""Each given client's own model on its own test split: ``(metrics, test examples)``."""


@dataclass
class RoundTraffic:
    """What an engine's transport measured of one round.

    Attributes:
        round: The round's number.
        sampled: The clients sampled for it.
        uploads: The uploads that reached the server.
        outcome: The server's aggregate of them.
        started: ``time.perf_counter()`` when the round began.
        bytes_up: Bytes the clients sent (masked vectors under secure aggregation).
        bytes_down: Bytes the server sent, all clients together.
        bytes_down_max: The largest payload one client received.
        dropped: Clients that dropped out of a secure round (``None``: not secure).
        refused: Clients that were not trained because their privacy budget was spent.
        privacy: The round's ``privacy`` report with DP-SGD (``None``: no DP).
        bytes_up_protocol: Bytes of the clients' SecAgg+ keys and shares (stages 0, 1
            and 3; :func:`fedexlora.secagg.traffic.protocol_nbytes`), apart from
            ``bytes_up``.
        clock: Where the round's seconds went so far (:class:`fedexlora.run.timing.RoundClock`:
            the clients' training and set-up); :func:`close_round` goes on timing into it
            and writes its split into the row (``None``: a new clock there).
    """

    round: int
    sampled: list[int]
    uploads: list[ClientUpload]
    outcome: RoundOutcome
    started: float
    bytes_up: int
    bytes_down: int
    bytes_down_max: int
    dropped: list[int] | None = None
    refused: list[int] = field(default_factory=list)
    privacy: dict | None = None
    bytes_up_protocol: int = 0
    clock: RoundClock | None = None


def lossy(cfg: RunConfig, server: Server) -> bool:
    """Whether a lossy mode of ``cfg`` can cut anything from ``server``'s rounds.

    A ``side_budget`` that leaves every layer uncapped (each could hold its dense delta)
    cuts nothing: the run stays exact and is not marked approximate.
    """
    if not cfg.approximate:
        return False
    caps = server.side_rank
    return not (
        cfg.side_budget is not None
        and isinstance(caps, dict)
        and all(c is None for c in caps.values())
    )


def close_round(
    cfg: RunConfig,
    method: str,
    model,
    server: Server,
    prep: Prepared,
    traffic: RoundTraffic,
    *,
    earlier: Iterable[dict] = (),
    evaluate_clients: EvaluateClients | None = None,
    save_uploads: Callable[[], None] | None = None,
) -> dict:
    """Applies the round's outcome to ``model``, evaluates it and returns its row.

    Args:
        cfg: The run configuration.
        method: The method's name.
        model: The server's global model.
        server: The server, after aggregating the round.
        prep: The task, partitions and tokenized data.
        traffic: What the engine measured of the round.
        earlier: This method's rows before this round (a personalized method evaluates
            every client that has trained so far).
        evaluate_clients: For a personalized method (no global model), each client's own
            model on its own test split; required then.
        save_uploads: Saves the round's client adapters (``save_client_adapters``), once
            the model is evaluated; an engine that saved them as they trained passes none.

    Returns:
        The round's ``metrics.jsonl`` row.
    """
    spec = get_method(method)
    rnd, outcome = traffic.round, traffic.outcome
    clock = traffic.clock if traffic.clock is not None else RoundClock()
    with running(clock):
        metrics, measured = apply_round(
            cfg, method, rnd, model, server, outcome, prep, traffic.uploads
        )
        per_client = None
        if spec.personalized:  # no global model: each client's own, on its own test split
            if evaluate_clients is None:
                raise ValueError(f"method {method!r} is personalized: pass evaluate_clients")
            trained = {c for row in earlier for c in row.get("accepted", [])}
            with phase("evaluate"):
                per_client = evaluate_clients(sorted(trained | set(outcome.accepted)))
            metrics = personal_metrics(per_client)
        if save_uploads is not None:
            with phase("checkpoint"):
                save_uploads()
    federated = spec.federated
    seconds = time.perf_counter() - traffic.started
    row = round_row(
        method,
        rnd,
        metrics,
        outcome,
        traffic.uploads,
        seconds=seconds,
        bytes_up=traffic.bytes_up if federated else 0,
        bytes_down=traffic.bytes_down if federated else 0,
        approximate=federated and lossy(cfg, server),
        sampled=traffic.sampled,
        dropped=traffic.dropped,
        effective=measured,
        bytes_down_max=traffic.bytes_down_max if federated else 0,
        server_bytes=server.nbytes(),
        test_examples=len(prep.task.test),
        server_seconds=server.last_round_seconds,
        personalized=per_client,
    )
    # where the seconds went: the checkpoint's are added when it is written
    # (fedexlora.run.lifecycle.Run.record), and with them the round's whole wall time
    row["split_seconds"] = clock.split(aggregate=server.last_round_seconds, total=seconds)
    if federated and cfg.side_branch:
        from fedexlora.bridge.fold import adapter_nbytes, side_nbytes

        # what every client holds beside its base (fp32, half-precision or quantized) for
        # the residuals, from the side branches' tensors (and the budget it was given),
        # and its adapter's own bytes beside them
        row["side_bytes"] = side_nbytes(model)
        row["adapter_bytes"] = adapter_nbytes(model)
        if cfg.side_budget is not None:
            row["side_budget"] = cfg.side_budget
    if federated and cfg.secure_aggregation:
        # SecAgg+'s keys and shares, apart from the masked vectors in bytes_up
        row["bytes_up_protocol"] = traffic.bytes_up_protocol
    if traffic.privacy is not None:
        row["privacy"] = {**traffic.privacy, "randomness": dp_randomness(cfg)}
        # no client sends its loss under DP: a noiseless loss is outside DP-SGD's guarantee
        row["train_loss"] = None
        if traffic.refused:
            row["note"] = (
                f"clients {sorted(traffic.refused)} were not trained: their privacy budget "
                f"(epsilon {cfg.dp_epsilon}) would be exceeded"
            )
    return row


DP_SEEDED = (
    "seeded (dp_reproducible): drawn from the run's seed, not private against anyone "
    "who knows the seed"
)
DP_SECURE = "os-entropy: drawn on each client from OS entropy (ChaCha20), never from a seed"


def dp_randomness(cfg) -> str:
    """Where DP-SGD's sampling and noise came from, as rows and summaries name it."""
    return DP_SEEDED if cfg.dp_reproducible else DP_SECURE


def _summ(values: dict[str, float]) -> dict:
    if not values:
        return {"mean": 0.0, "max": 0.0, "per_layer": {}}
    short = {k.removeprefix("base_model.model."): float(v) for k, v in values.items()}
    return {
        "mean": sum(short.values()) / len(short),
        "max": max(short.values()),
        "per_layer": short,
    }


def train_loss(uploads: list[ClientUpload], outcome: RoundOutcome) -> float:
    """The round's training loss: the accepted clients' losses, weighted as the model is.

    One definition on every path: each accepted client's loss under its aggregation weight
    (``outcome.weights``: its example count's share under ``--weighting examples``, equal
    shares under ``uniform``), which is what secure aggregation's sum gives too. Without
    weights (a method that keeps none) the plain mean. NaN when no client reported one.
    """
    losses = {u.client_id: u.train_loss for u in uploads if u.client_id in outcome.accepted}
    if not losses:
        return float("nan")
    weights = outcome.weights
    if set(losses) <= set(weights) and sum(weights[c] for c in losses) > 0:
        total = sum(weights[c] for c in losses)
        return sum(weights[c] * loss for c, loss in losses.items()) / total
    return sum(losses.values()) / len(losses)


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
    row = {
        "method": method,
        "round": rnd,
        "metrics": metrics,
        "test_examples": test_examples,
        "train_loss": train_loss(uploads, outcome),
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
    with phase("apply"):
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
    with phase("evaluate"):
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
