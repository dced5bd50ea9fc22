"""The Flower ServerApp: the shared server state, evaluation and run directory.

For every method of the run it builds the same :class:`fedexlora.server.Server` the
in-process engine builds (:func:`fedexlora.run.pipeline`'s helpers), drives it with the
:class:`fedexlora.flower.strategy.FedExLoRA` strategy, and after each round evaluates the
global model it holds (residuals folded into its base, global factors loaded) exactly as
the in-process engine does. It writes the same run directory: ``config.toml``,
``metrics.jsonl`` (rows from :func:`fedexlora.run.engine.round_row`, with ``dropped``
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

    With ``settings.resume`` it continues the run in that directory from each method's
    last intact checkpoint (as ``fedexlora run --resume`` does in-process).

    Returns:
        All metrics rows.

    Raises:
        ValueError: If the configuration is invalid or asks for something the Flower
            engine cannot do, the run directory already holds a run (without
            ``resume``), or the run to resume has another configuration.
    """
    import uuid

    from fedexlora.bridge.adapters import set_state
    from fedexlora.flower.strategy import FedExLoRA, NodeDirectory
    from fedexlora.run.checkpoint import config_fingerprint, save_checkpoint
    from fedexlora.run.engine import (
        apply_round,
        client_adapter,
        new_model,
        new_server,
        prepare,
        round_row,
        save_client_adapter,
    )
    from fedexlora.run.pipeline import (
        RunError,
        append_row,
        base_deltas,
        load_task_for,
        note_partition,
        restore_run,
        write_atomic,
        write_rows,
    )
    from fedexlora.run.recipes import recipe_section
    from fedexlora.run.report import write_summary
    from fedexlora.run.trackers import open_trackers

    cfg = cfg.replace(engine="flower").validate()  # one validation for every entry point
    fingerprint = config_fingerprint(cfg.to_dict())
    if settings.resume:
        out = Path(settings.resume)
        if not (out / "config.toml").is_file():
            raise RunError(f"resume {str(out)!r}: no run there (no config.toml)")
    else:
        out = Path(settings.run_dir or Path("runs") / time.strftime("flower-%Y%m%d-%H%M%S"))
    metrics_path = out / "metrics.jsonl"
    if not settings.resume and metrics_path.exists() and metrics_path.stat().st_size > 0:
        raise RunError(
            f"run directory {str(out)!r} already holds a run; resume it (`resume` in the "
            "run config, or fedexlora run --resume) or choose another directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    token_path = out / "run-token"
    if settings.resume and token_path.is_file():
        run_token = token_path.read_text().strip()
    else:
        run_token = uuid.uuid4().hex
        write_atomic(token_path, run_token)
    if not settings.resume:
        write_atomic(out / "config.toml", cfg.to_toml())

    task = load_task_for(cfg)
    first_model, tokenizer = new_model(cfg, task, cfg.methods[0])
    prep = prepare(cfg, tokenizer, task)
    say(f"task {cfg.task}: {len(task.train)} train / {len(task.test)} test")
    say(prep.partition_table)
    if cfg.dp:  # each client checks its own too; this names the problem before round 1
        from fedexlora.training.privacy import check_delta

        check_delta(cfg.dp_delta, [len(p) for p in prep.parts])
    if not settings.resume:
        note_partition(cfg, task, out)
    nodes = NodeDirectory(
        cfg.num_clients, fingerprint, timeout=settings.round_timeout, run_token=run_token
    )

    restored: dict[str, tuple] = {}
    done_rows: dict[str, list[dict]] = {}
    if settings.resume:
        restored, done_rows = restore_run(cfg, task, out, fingerprint, say)
    else:
        metrics_path.write_text("")

    def _save_uploads(mdl, srv, rec, out_dir, m):
        """``save_client_adapters``: each upload as the PEFT adapter its client trained."""
        for up in rec.uploads:
            adapter = client_adapter(cfg, m, up.client_id) or "default"
            set_state(mdl, up.state, adapter=adapter)
            mdl.set_adapter(adapter)
            weight = rec.outcome.weights.get(up.client_id)
            save_client_adapter(mdl, out_dir, rec.round, up.client_id, int(up.num_examples), weight)
        mdl.set_adapter("default")
        set_state(mdl, srv.state)

    trackers = open_trackers(cfg, out, settings.resume)
    all_rows: list[dict] = []
    for method in cfg.methods:
        if method in restored:
            model, server = restored.pop(method)
        else:
            model = first_model if first_model is not None else new_model(cfg, task, method)[0]
            server = new_server(cfg, method, model)
        first_model = None
        rows: list[dict] = list(done_rows.get(method, []))
        if server.round >= cfg.rounds:
            all_rows.extend(rows)
            continue
        strategy = FedExLoRA(
            server,
            nodes,
            fraction_train=cfg.fraction,
            min_train_nodes=settings.min_train_nodes,
            min_available_nodes=settings.min_available_nodes or None,
            wait_timeout=settings.wait_timeout,
            fingerprint=fingerprint,
        )
        if rows and rows[-1].get("privacy"):  # a resume: the clients' last reports
            strategy.dp_reports = {
                int(c): dict(v) for c, v in rows[-1]["privacy"].get("clients", {}).items()
            }

        def evaluate_fn(rnd, _arrays, m=method, mdl=model, srv=server, st=strategy, rs=rows):
            """After each round: fold, evaluate, write the row and a checkpoint."""
            if rnd == 0:
                return None  # the in-process engine does not evaluate before round 1
            rec = st.current
            rnd = rec.round
            metrics, measured = apply_round(cfg, m, rnd, mdl, srv, rec.outcome, prep, rec.uploads)
            if cfg.save_client_adapters:
                _save_uploads(mdl, srv, rec, out, m)
            row = round_row(
                m,
                rnd,
                metrics,
                rec.outcome,
                rec.uploads,
                seconds=time.perf_counter() - rec.started,
                bytes_up=rec.bytes_up,
                bytes_down=rec.bytes_down,
                approximate=cfg.approximate,
                sampled=rec.sampled,
                dropped=rec.dropped,
                effective=measured,
                bytes_down_max=rec.bytes_down_max,
                server_bytes=srv.nbytes(),
                test_examples=len(prep.task.test),
            )
            if cfg.dp:  # what the clients reported of their own accounting
                from fedexlora.training.privacy import privacy_row

                row["privacy"] = privacy_row(
                    cfg.dp_epsilon, cfg.dp_delta, st.dp_reports, rec.refused
                )
                if rec.refused:
                    row["note"] = (
                        f"clients {sorted(rec.refused)} were not trained: their privacy "
                        f"budget (epsilon {cfg.dp_epsilon}) would be exceeded"
                    )
            rs.append(row)
            append_row(metrics_path, row)
            trackers.log_row(row)
            meta = {"rows": rs, "fingerprint": fingerprint, "parts": prep.parts}
            meta["config"] = cfg.to_dict()
            save_checkpoint(
                out / "checkpoints" / m,
                srv,
                meta=meta,
                keep=cfg.keep_checkpoints,
                base=base_deltas(mdl),
            )
            return MetricRecord({k: float(v) for k, v in metrics.items() if _is_number(v)})

        t0 = time.perf_counter()
        strategy.start(
            grid,
            initial_arrays=to_array_record(server.state.to_flat()),
            num_rounds=cfg.rounds - server.round,
            timeout=settings.round_timeout,
            evaluate_fn=evaluate_fn,
        )
        dropped = sorted({c for r in rows for c in r["dropped"]})
        say(
            f"{method}: {len(rows) - len(done_rows.get(method, []))} rounds in "
            f"{time.perf_counter() - t0:.1f}s"
            + (f" (clients dropped at some round: {dropped})" if dropped else "")
        )
        all_rows.extend(rows)
        del model
    if settings.resume:  # restored rows were written first: every method's rows in order
        write_rows(metrics_path, all_rows)
    write_summary(out, all_rows, cfg.to_toml(), extra=recipe_section(cfg, all_rows))
    trackers.finish()
    say(f"wrote {metrics_path}")
    return all_rows


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
