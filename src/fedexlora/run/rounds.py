"""The end of a round, as both engines close it: one function, whatever carried the round.

An engine (in-process, :mod:`fedexlora.run.simulation`; or Flower's ServerApp,
:mod:`fedexlora.flower.server_app`) samples, sends payloads, trains and aggregates in its
own way, then hands what it measured (:class:`RoundTraffic`) to :func:`close_round`, which
brings the global model to the outcome, evaluates it (or, for a personalized method, each
client's own model, through the engine's ``evaluate_clients``) and writes the round's
``metrics.jsonl`` row, privacy report included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fedexlora.config import RunConfig
from fedexlora.core.methods import get_method
from fedexlora.run.engine import Prepared, apply_round, personal_metrics, round_row
from fedexlora.server.server import ClientUpload, RoundOutcome, Server

__all__ = ["RoundTraffic", "close_round"]

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
    metrics, measured = apply_round(cfg, method, rnd, model, server, outcome, prep, traffic.uploads)
    per_client = None
    if spec.personalized:  # no global model: each client's own, on its own test split
        if evaluate_clients is None:
            raise ValueError(f"method {method!r} is personalized: pass evaluate_clients")
        trained = {c for row in earlier for c in row.get("accepted", [])}
        per_client = evaluate_clients(sorted(trained | set(outcome.accepted)))
        metrics = personal_metrics(per_client)
    if save_uploads is not None:
        save_uploads()
    federated = spec.federated
    row = round_row(
        method,
        rnd,
        metrics,
        outcome,
        traffic.uploads,
        seconds=time.perf_counter() - traffic.started,
        bytes_up=traffic.bytes_up if federated else 0,
        bytes_down=traffic.bytes_down if federated else 0,
        approximate=cfg.approximate and federated,
        sampled=traffic.sampled,
        dropped=traffic.dropped,
        effective=measured,
        bytes_down_max=traffic.bytes_down_max if federated else 0,
        server_bytes=server.nbytes(),
        test_examples=len(prep.task.test),
        server_seconds=server.last_round_seconds,
        personalized=per_client,
    )
    if traffic.privacy is not None:
        row["privacy"] = traffic.privacy
        if traffic.refused:
            row["note"] = (
                f"clients {sorted(traffic.refused)} were not trained: their privacy budget "
                f"(epsilon {cfg.dp_epsilon}) would be exceeded"
            )
    return row
