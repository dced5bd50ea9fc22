"""The round loop, one for both engines: an engine is only how a round is carried.

:func:`run_rounds` runs a method's rounds after its server's last one: for each, the
engine's :class:`Transport` carries the round (samples, sends each client its payload,
trains, receives and aggregates, and says what it measured, :class:`RoundTraffic`), and
the loop closes it (:func:`fedexlora.run.rounds.close_round`: the outcome folded into
the global model, evaluated, and the row), saves the clients' adapters when asked, and
hands the row on. :func:`drive` runs every method of a :class:`fedexlora.run.lifecycle.Run`
through it. The two transports:

- in-process (:class:`fedexlora.run.inprocess.InProcess`): the sampled clients train in
  turn on the one model in this process;
- Flower (:class:`fedexlora.flower.server_app.FlowerRounds`): the
  :class:`fedexlora.flower.strategy.FedExLoRA` strategy's messages over a Flower
  ``Grid``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from fedexlora.config import RunConfig
from fedexlora.run.build import Prepared
from fedexlora.run.rounds import RoundTraffic, close_round
from fedexlora.run.stopping import stop_reason
from fedexlora.server.server import Server

if TYPE_CHECKING:
    from fedexlora.run.lifecycle import MethodRun, Run

__all__ = ["Transport", "drive", "run_rounds"]


class Transport(Protocol):
    """How an engine carries a method's rounds (see the module docstring)."""

    def train_round(self, rnd: int) -> RoundTraffic:
        """Carries round ``rnd``: sampled clients trained, their uploads aggregated."""

    def evaluate_clients(self, clients: list[int]) -> dict[int, tuple[dict[str, float], int]]:
        """A personalized method: each client's own model on its own test split."""

    def save_uploads(self, traffic: RoundTraffic) -> None:
        """``save_client_adapters``: the round's client adapters, with their weights."""


def run_rounds(
    cfg: RunConfig,
    method: str,
    model,
    server: Server,
    prep: Prepared,
    transport: Transport,
    *,
    history: Iterable[dict] = (),
    after_round: Callable[[dict], None] | None = None,
    say: Callable[[str], object] | None = None,
) -> list[dict]:
    """Runs ``method``'s rounds after ``server.round`` up to ``cfg.rounds``; its new rows.

    A method stops earlier when the study's stopping rule says so
    (:mod:`fedexlora.run.stopping`: ``stop_patience``, ``stop_at``), read from all its
    rows, so a resume of a stopped method runs nothing more.

    Args:
        cfg: The run configuration.
        method: The method.
        model: The server's global model (the base holds the residuals folded so far).
        server: The method's server (restored from a checkpoint: the run resumes).
        prep: The task, partitions and tokenized data.
        transport: The engine's way of carrying a round.
        history: This method's rows before these rounds (a resume).
        after_round: Called with each row once the round is closed (the run records it).
        say: Where the stop is announced.
    """
    earlier = list(history)
    rows: list[dict] = []
    for rnd in range(server.round + 1, cfg.rounds + 1):
        reason = stop_reason(cfg, [*earlier, *rows])
        if reason is not None:
            if say is not None:
                say(f"{method}: stopped after round {rnd - 1}: {reason}")
            break
        traffic = transport.train_round(rnd)
        row = close_round(
            cfg, method, model, server, prep, traffic, earlier=[*earlier, *rows],
            evaluate_clients=transport.evaluate_clients,
            save_uploads=(
                (lambda t=traffic: transport.save_uploads(t)) if cfg.save_client_adapters else None
            ),
        )  # fmt: skip
        rows.append(row)
        if after_round is not None:
            after_round(row)
    return rows


def drive(run: Run, transport_for: Callable[[MethodRun], Transport]) -> list[dict]:
    """Runs every method of ``run`` through the loop and finishes it; all its rows.

    ``transport_for`` gives the engine's transport for a method (its model, server, rows
    and what its clients keep: :class:`fedexlora.run.lifecycle.MethodRun`).
    """
    for current in run.methods():
        run_rounds(
            run.cfg, current.method, current.model, current.server, run.prep,
            transport_for(current), history=current.rows,
            after_round=lambda row, _m=current: run.record(_m, row), say=run.say,
        )  # fmt: skip
    return run.finish()
