"""The Flower ServerApp: the shared server state, evaluation and run directory.

For every method of the run it builds the same :class:`fedexlora.server.Server` the
in-process engine builds (:mod:`fedexlora.run.build`'s helpers), drives it with the
:class:`fedexlora.flower.strategy.FedExLoRA` strategy, and after each round evaluates the
global model it holds (residuals folded into its base, global factors loaded) exactly as
the in-process engine does. It writes the same run directory: ``config.toml``,
``metrics.jsonl`` (rows from :func:`fedexlora.run.rounds.round_row`, with ``dropped``
filled in), checkpoints, ``summary.md`` and the plots.

The run directory is the run config's ``run-dir`` (give an absolute path when the
ServerApp runs under a SuperLink).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedexlora.flower.records import FlowerSettings, resolve_run_config, to_array_record
from fedexlora.quiet import quiet_libraries

__all__ = ["app", "make_server_app", "run_server"]


def run_server(
    grid: Grid,
    cfg,
    settings: FlowerSettings,
    *,
    say: Callable[[str], Any] = print,
) -> list[dict]:
    """Runs every method of ``cfg`` over ``grid`` and writes the run directory.

    The run directory's life is :class:`fedexlora.run.lifecycle.Run`'s, as in-process;
    here the rounds go through the :class:`FedExLoRA` strategy. With ``settings.resume``
    it continues the run in that directory from each method's last intact checkpoint (as
    ``fedexlora run --resume`` does in-process).

    Returns:
        All metrics rows.

    Raises:
        ValueError: If the configuration is invalid or asks for something the Flower
            engine cannot do, the run directory already holds a run (without
            ``resume``), or the run to resume has another configuration.
    """
    from fedexlora.bridge.adapters import set_state
    from fedexlora.flower.nodes import NodeDirectory
    from fedexlora.flower.strategy import FedExLoRA
    from fedexlora.run.build import client_adapter
    from fedexlora.run.client_step import save_client_adapter
    from fedexlora.run.lifecycle import Run
    from fedexlora.run.rounds import RoundTraffic, close_round

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
    prep = run.prep
    nodes = NodeDirectory(
        cfg.num_clients, run.fingerprint, timeout=settings.round_timeout, run_token=run.run_token()
    )

    def _save_uploads(mdl, srv, rec, m):
        """``save_client_adapters``: each upload as the PEFT adapter its client trained."""
        for up in rec.uploads:
            adapter = client_adapter(cfg, m, up.client_id) or "default"
            set_state(mdl, up.state, adapter=adapter)
            mdl.set_adapter(adapter)
            weight = rec.outcome.weights.get(up.client_id)
            save_client_adapter(
                mdl, run.layout.root, rec.round, up.client_id, int(up.num_examples), weight
            )
        mdl.set_adapter("default")
        set_state(mdl, srv.state)

    for current in run.methods():
        m, model, server = current.method, current.model, current.server
        strategy = FedExLoRA(
            server,
            nodes,
            fraction_train=cfg.fraction,
            min_train_nodes=settings.min_train_nodes,
            min_available_nodes=settings.min_available_nodes or None,
            wait_timeout=settings.wait_timeout,
            fingerprint=run.fingerprint,
            effective=False,  # apply_round measures it on the model
            secure=cfg.secure_aggregation,
        )
        if current.rows and current.rows[-1].get("privacy"):  # a resume: the last reports
            strategy.dp_reports = {
                int(c): dict(v) for c, v in current.rows[-1]["privacy"].get("clients", {}).items()
            }

        def evaluate_fn(rnd, _arrays, m=m, mdl=model, srv=server, st=strategy, cur=current):
            """After each round: fold, evaluate, and hand the row to the run."""
            if rnd == 0:
                return None  # the in-process engine does not evaluate before round 1
            rec = st.current
            privacy = None
            if cfg.dp:  # what the clients reported of their own accounting
                from fedexlora.training.privacy import privacy_row

                privacy = privacy_row(cfg.dp_epsilon, cfg.dp_delta, st.dp_reports, rec.refused)
            traffic = RoundTraffic(
                rec.round, rec.sampled, rec.uploads, rec.outcome, rec.started, rec.bytes_up,
                rec.bytes_down, rec.bytes_down_max, dropped=rec.dropped,
                refused=rec.refused, privacy=privacy,
            )  # fmt: skip
            row = close_round(
                cfg, m, mdl, srv, prep, traffic, earlier=cur.rows,
                evaluate_clients=lambda clients: st.evaluate_personal(
                    grid, clients, settings.round_timeout
                ),
                save_uploads=(
                    (lambda: _save_uploads(mdl, srv, rec, m)) if cfg.save_client_adapters else None
                ),
            )  # fmt: skip
            run.record(cur, row)
            metrics = row["metrics"]
            return MetricRecord({k: float(v) for k, v in metrics.items() if _is_number(v)})

        strategy.start(
            grid,
            initial_arrays=to_array_record(server.state.to_flat()),
            num_rounds=cfg.rounds - server.round,
            timeout=settings.round_timeout,
            evaluate_fn=evaluate_fn,
        )
    rows = run.finish()
    say(f"wrote {run.layout.metrics}")
    return rows


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
