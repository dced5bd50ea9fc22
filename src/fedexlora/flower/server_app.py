"""The Flower ServerApp: the shared server state, evaluation and run directory.

For every method of the run it builds the same :class:`fedexlora.server.Server` the
in-process engine builds (:mod:`fedexlora.run.build`'s helpers) and runs the same round
loop (:func:`fedexlora.run.loop.run_rounds`), which closes each round on the global model
this process holds (residuals folded into its base, global factors loaded) exactly as
in-process. Flower is the transport only: :class:`FlowerRounds` carries each round as
the :class:`fedexlora.flower.strategy.FedExLoRA` strategy's messages. It writes the
same run directory: ``config.toml``, ``metrics.jsonl`` (rows from
:func:`fedexlora.run.rounds.round_row`, with ``dropped`` filled in), checkpoints,
``summary.md`` and the plots.

The run directory is the run config's ``run-dir`` (give an absolute path when the
ServerApp runs under a SuperLink).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedexlora.flower.records import FlowerSettings, resolve_run_config
from fedexlora.quiet import quiet_libraries
from fedexlora.run.layout import RunLayout
from fedexlora.run.rounds import RoundTraffic

__all__ = ["FlowerRounds", "app", "make_server_app", "run_server"]


def run_server(
    grid: Grid,
    cfg,
    settings: FlowerSettings,
    *,
    say: Callable[[str], Any] = print,
) -> list[dict]:
    """Runs every method of ``cfg`` over ``grid`` and writes the run directory.

    The run directory's life is :class:`fedexlora.run.lifecycle.Run`'s and the rounds are
    the loop every engine runs (:func:`fedexlora.run.loop.run_rounds`), as in-process;
    here each round is carried by :class:`FlowerRounds` (the :class:`FedExLoRA`
    strategy's messages). With ``settings.resume`` it continues the run in that
    directory from each method's last intact checkpoint (as ``fedexlora run --resume``
    does in-process).

    Returns:
        All metrics rows.

    Raises:
        ValueError: If the configuration is invalid or asks for something the Flower
            engine cannot do, the run directory already holds a run (without
            ``resume``), or the run to resume has another configuration.
    """
    from fedexlora.flower.nodes import NodeDirectory
    from fedexlora.run.lifecycle import Run
    from fedexlora.run.loop import drive

    cfg = cfg.replace(engine="flower").validate()  # one validation for every entry point
    if settings.resume:
        out = Path(settings.resume)
    else:
        out = Path(settings.run_dir or Path("runs") / time.strftime("flower-%Y%m%d-%H%M%S"))
    run = Run.open(
        cfg,
        out,
        resume=bool(settings.resume),
        say=say,
        resume_hint="resume it (`resume` in the run config, or fedexlora run --resume)",
    )
    nodes = NodeDirectory(
        cfg.num_clients, run.fingerprint, timeout=settings.round_timeout, run_token=run.run_token()
    )
    rows = drive(
        run,
        lambda current: FlowerRounds(
            grid,
            cfg,
            settings,
            current,
            nodes,
            fingerprint=run.fingerprint,
            out_dir=run.layout.root,
            say=say,
        ),  # fmt: skip
    )
    say(f"wrote {run.layout.metrics}")
    return rows


class FlowerRounds:
    """The Flower transport: a method's rounds as the :class:`FedExLoRA` strategy's messages.

    Each round the strategy samples with the shared server, sends every sampled node its
    client's payload over ``grid``, and aggregates the replies with the server
    (:meth:`FedExLoRA.train_round`); the loop (:func:`fedexlora.run.loop.run_rounds`)
    closes the round on the global model this process holds. A Flower client keeps its
    own DP-SGD accounting: the round's privacy report is what the clients reported.

    Args:
        grid: The Flower grid.
        cfg: The run configuration.
        settings: The Flower run settings (timeouts, node counts).
        current: The method, its model, server and rows
            (:class:`fedexlora.run.lifecycle.MethodRun`).
        nodes: Which node holds which partition (shared by the run's methods).
        fingerprint: The configuration's fingerprint, which clients check.
        out_dir: The run directory (client adapters).
        say: Where messages go.
    """

    def __init__(
        self,
        grid: Grid,
        cfg,
        settings: FlowerSettings,
        current,
        nodes,
        *,
        fingerprint: str,
        out_dir: Path,
        say: Callable[[str], Any] = print,
    ):
        from fedexlora.flower.strategy import FedExLoRA

        self.grid, self.cfg, self.settings = grid, cfg, settings
        self.method, self.model, self.server = current.method, current.model, current.server
        self.out_dir, self.say = out_dir, say
        self.strategy = FedExLoRA(
            self.server,
            nodes,
            fraction_train=cfg.fraction,
            min_train_nodes=settings.min_train_nodes,
            min_available_nodes=settings.min_available_nodes or None,
            wait_timeout=settings.wait_timeout,
            fingerprint=fingerprint,
            effective=False,  # the loop measures it on the model
            secure=cfg.secure_aggregation,
            adapters_dir=str(out_dir) if cfg.save_client_adapters else "",
        )
        if current.rows and current.rows[-1].get("privacy"):  # a resume: the last reports
            self.strategy.dp_reports = {
                int(c): dict(v) for c, v in current.rows[-1]["privacy"].get("clients", {}).items()
            }
        self.strategy.trained = {c for row in current.rows for c in row.get("accepted", [])}
        self.strategy.summary()

    def train_round(self, rnd: int) -> RoundTraffic:
        """Round ``rnd`` over the grid, and what it measured.

        The clients' seconds (training steps, set-up) are what their replies say
        (:func:`fedexlora.flower.client_app.train_step`), summed into the round's clock.
        """
        from fedexlora.run.timing import RoundClock

        rec = self.strategy.train_round(self.grid, self.settings.round_timeout)
        if rec.round != rnd:
            raise RuntimeError(f"{self.method}: loop round {rnd}, server round {rec.round}")
        self.strategy.trained.update(rec.outcome.accepted)
        privacy = None
        if self.cfg.dp:  # what the clients reported of their own accounting
            from fedexlora.training.privacy import privacy_row

            privacy = privacy_row(
                self.cfg.dp_epsilon, self.cfg.dp_delta, self.strategy.dp_reports, rec.refused,
                kept=self.cfg.secure_aggregation,  # then the clients reported no figures
            )  # fmt: skip
        traffic = rec.traffic(privacy)
        traffic.clock = clock = RoundClock()
        # under DP-SGD or secure aggregation the clients send no seconds: not measured
        clock.clients_measured = not (self.cfg.dp or self.cfg.secure_aggregation)
        for c, seconds in sorted(rec.client_seconds.items()):
            clock.add("train", seconds.get("train", 0.0), c)
            clock.add("setup", seconds.get("setup", 0.0))
            began, ended = seconds.get("train-began"), seconds.get("train-ended")
            if began is not None and ended is not None and ended >= began:
                clock.add_span(began, ended)
        return traffic

    def evaluate_clients(self, clients: list[int]) -> dict[int, tuple[dict[str, float], int]]:
        """Each client evaluates its own model (a personalized method) and replies."""
        return self.strategy.evaluate_personal(self.grid, clients, self.settings.round_timeout)

    def save_uploads(self, traffic: RoundTraffic) -> None:
        """``save_client_adapters``: each client saved its adapter; the server weighs them.

        A client writes its adapter as it trained it into the run directory the server
        names in its message (``adapters-dir``); one on another machine keeps it there, on
        its own node.
        """
        missing = RunLayout(self.out_dir).weigh_client_adapters(
            traffic.round, traffic.outcome.weights
        )
        if missing:
            self.say(
                f"{self.method} round {traffic.round}: the adapters of clients {missing} are "
                f"not in {self.out_dir / 'clients'} (each keeps it on its own node)"
            )


def make_server_app(
    defaults: Mapping[str, Any] | None = None, *, say: Callable[[str], Any] = print
) -> ServerApp:
    """A ServerApp; ``defaults`` fill in run-config keys the context does not set.

    ``flwr run`` gives the app its run config (``[tool.flwr.app.config]`` plus
    ``--run-config`` overrides); a caller that runs the app itself (a test's in-process
    grid, ``flwr.simulation.run_simulation``) can bake one in here.
    """
    base = dict(defaults or {})
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        """Resolves the run config and runs every method."""
        quiet_libraries()  # under flwr run the ServerApp has a process of its own
        cfg, settings = resolve_run_config({**base, **dict(context.run_config)})
        run_server(grid, cfg, settings, say=say)

    return server_app


app = make_server_app()
