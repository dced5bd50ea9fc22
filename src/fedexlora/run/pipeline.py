"""The in-process engine's whole run: every method on identical partitions.

The run directory and its life (checks, config, partitions, rows, checkpoints, resume,
trackers, summary) are :class:`fedexlora.run.lifecycle.Run`'s; this module only trains
each method's rounds in this process (:func:`fedexlora.run.simulation.run_method`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

from fedexlora.config import RunConfig
from fedexlora.run.export import output_dir_error
from fedexlora.run.layout import RunError
from fedexlora.run.lifecycle import Run
from fedexlora.run.restore import load_task_for
from fedexlora.run.simulation import run_method
from fedexlora.server.server import ClientUpload

__all__ = ["check_inputs", "run_experiment"]


_FLOWER_FIX = "fix: pip install 'fedex-lora[flower]'"


def check_inputs(
    cfg: RunConfig,
    out: str | Path,
    *,
    resume: bool = False,
    tasks: Sequence[str] = (),
) -> None:
    """Checks what a run will read and write, before it writes anything.

    A configuration that validates may still name a directory that cannot be written,
    a device this machine lacks, a package that cannot be imported, or a task that does
    not exist or a data file that cannot be read. Each is found here, not after the run
    has written its ``config.toml`` (or, for ``export``, after it has trained). Local
    tasks (files, the embedded ones) are loaded to check them; hub tasks, which are
    downloaded, only have their names checked.

    Args:
        cfg: A validated configuration.
        out: The run directory.
        resume: Whether the run in ``out`` is continued (it is then there already).
        tasks: The tasks of a multi-task recipe (default: ``cfg.task``).

    Raises:
        RunError: Naming the first problem and the input it comes from.
    """
    from fedexlora.run.engine import resolve_device

    if not resume:
        problem = output_dir_error(out)
        if problem is not None:
            raise RunError(f"--out {str(out)!r} {problem}")
    if cfg.export:
        problem = output_dir_error(cfg.export)
        if problem is not None:
            raise RunError(f"--export {str(cfg.export)!r} {problem}")
    if cfg.engine == "flower" or cfg.secure_aggregation:
        what = "--engine flower" if cfg.engine == "flower" else "--secure-aggregation"
        try:
            import flwr  # noqa: F401
        except ImportError as exc:
            raise RunError(
                f"{what} needs Flower (flwr), which cannot be imported ({exc}); {_FLOWER_FIX}"
            ) from None
        if cfg.engine == "flower" and importlib.util.find_spec("ray") is None:
            raise RunError(f"--engine flower needs Flower's simulation (ray); {_FLOWER_FIX}")
    try:
        resolve_device(cfg.device)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    for task in tasks or (cfg.task,):
        problem = _task_error(cfg.replace(task=task))
        if problem is not None:
            raise RunError(problem)


def _task_error(cfg: RunConfig) -> str | None:
    """Why ``cfg.task`` cannot be loaded, or ``None``; a hub task's name only is checked."""
    from fedexlora.tasks.data import hub_task

    try:
        if not hub_task(cfg.task):  # a file, an embedded task or an unknown name: quick
            load_task_for(cfg)
    except ValueError as exc:
        return str(exc)
    return None


def run_experiment(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    console=None,
    local_update: Callable[..., ClientUpload] | None = None,
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
        local_update: Each client's training step (:func:`fedexlora.run.engine.local_update`
            when ``None``): a caller may wrap it to watch clients or play faulty ones.

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
            **({} if local_update is None else {"local_update": local_update}),
        )
    return run.finish()
