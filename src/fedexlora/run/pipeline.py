"""The in-process engine's whole run: every method on identical partitions.

The run directory and its life (checks, config, partitions, rows, checkpoints, resume,
trackers, summary) are :class:`fedexlora.run.lifecycle.Run`'s; this module only trains
each method's rounds in this process (:func:`fedexlora.run.simulation.run_method`).
"""

from __future__ import annotations

from pathlib import Path

from fedexlora.config import RunConfig
from fedexlora.run.layout import RunError, append_row, write_atomic, write_rows
from fedexlora.run.lifecycle import Run
from fedexlora.run.restore import (
    apply_base_deltas,
    base_deltas,
    load_task_for,
    restore_latest,
    restore_model,
    restore_run,
)
from fedexlora.run.simulation import run_method

__all__ = [
    "RunError",
    "append_row",
    "apply_base_deltas",
    "base_deltas",
    "load_task_for",
    "restore_latest",
    "restore_model",
    "restore_run",
    "run_experiment",
    "write_atomic",
    "write_rows",
]


def run_experiment(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    console=None,
) -> list[dict]:
    """Runs every method of ``cfg`` in this process and writes the run directory.

    The directory gets ``config.toml``, ``metrics.jsonl`` (one row per method and round,
    appended and fsynced as each round ends), ``summary.md``, PNG plots and, per method,
    ``checkpoints/<method>/round-XXXX`` after every round.

    Args:
        cfg: A validated configuration.
        out_dir: The run directory.
        resume: Continue a run in ``out_dir`` from its last complete round.
        progress: Show progress bars.
        console: A ``rich`` console for messages (plain ``print`` when ``None``).

    Returns:
        All metrics rows.

    Raises:
        RunError: If ``out_dir`` holds a run and ``resume`` is not set, or the reverse.
        CheckpointError: If a checkpoint is corrupt or does not match the configuration.
    """
    say = console.print if console is not None else print
    run = Run(cfg, out_dir, resume=resume, say=say)
    for current in run.methods():
        run_method(
            cfg,
            current.method,
            run.prep,
            out_dir=run.layout.root,
            progress=progress,
            model=current.model,
            server=current.server,
            after_round=lambda row, _srv, _mdl, _m=current: run.record(_m, row),
            history=current.rows,
            personal=current.personal,
        )
    return run.finish()
