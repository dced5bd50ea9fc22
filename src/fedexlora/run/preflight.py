"""Checks before a run: what it will read and write, found before it writes anything.

:func:`check_inputs` is what the command line runs first, whichever engine the run asks
for: the run directory and the export directory can be written, Flower (and its
simulation) can be imported when the run needs them, the device exists, and each task
loads (a hub task: its name). A configuration that validates
(:meth:`fedexlora.config.RunConfig.validate`) can still fail here; nothing is written
until it passes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from fedexlora.config import RunConfig
from fedexlora.run.export import export_dest_error, output_dir_error
from fedexlora.run.layout import RunError, RunLayout
from fedexlora.run.restore import load_task_for

__all__ = ["check_inputs", "input_problems"]


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
    if not resume:
        problem = output_dir_error(out)
        if problem is not None:
            raise RunError(f"--out {str(out)!r} {problem}")
        layout = RunLayout(out)
        if layout.holds_run():
            raise RunError(
                f"--out {str(out)!r} already holds a run; pass --resume to continue it or "
                "choose another directory"
            )
        # files a run writes, in a directory that is no run (it would have metrics.jsonl):
        # the user's own (a config.toml given to --config, notes), which the run would replace
        theirs = [f for f in ("config.toml", "summary.md") if (Path(out) / f).exists()]
        if theirs and not layout.metrics.exists():
            raise RunError(
                f"--out {str(out)!r} holds {theirs[0]}, which is not a run's and which the "
                "run would overwrite; choose a new or empty directory"
            )
    else:
        problem = _rounds_done_error(cfg, out)
        if problem is not None:
            raise RunError(problem)
    if cfg.export:
        exp, run = Path(cfg.export).expanduser().resolve(), Path(out).expanduser().resolve()
        if exp == run or exp in run.parents:
            raise RunError(
                f"--export {str(cfg.export)!r} is --out or holds it; fix: export to a "
                "directory outside the run's"
            )
    problems = input_problems(cfg, tasks)
    if problems:
        raise RunError(problems[0])


def input_problems(cfg: RunConfig, tasks: Sequence[str] = ()) -> list[str]:
    """Every problem with what ``cfg`` reads and needs, its run directory aside.

    The export directory, Flower (and its simulation) when the run needs them, the
    device, each task (loaded when local; a hub task by its name and metrics) and the
    maximum length against the model's positions. ``fedexlora validate`` lists them all;
    :func:`check_inputs` raises the first.

    Args:
        cfg: A validated configuration.
        tasks: The tasks of a multi-task recipe (default: ``cfg.task``).

    Returns:
        One message per problem, each naming its input; empty when there is none.
    """
    from fedexlora.run.build import resolve_device

    problems = []
    if cfg.export:
        problem = export_dest_error(cfg.export)
        if problem is not None:
            problems.append(f"--export {str(cfg.export)!r} {problem}")
    if cfg.engine == "flower" or cfg.secure_aggregation:
        what = "--engine flower" if cfg.engine == "flower" else "--secure-aggregation"
        try:
            import flwr  # noqa: F401
        except ImportError as exc:
            problems.append(
                f"{what} needs Flower (flwr), which cannot be imported ({exc}); {_FLOWER_FIX}"
            )
        else:
            if cfg.engine == "flower" and importlib.util.find_spec("ray") is None:
                problems.append(f"--engine flower needs Flower's simulation (ray); {_FLOWER_FIX}")
    try:
        resolve_device(cfg.device)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        from fedexlora.run.workers import devices_error

        problem = devices_error(cfg)
        if problem is not None:
            problems.append(problem)
    for task in tasks or (cfg.task,):
        problem = _task_error(cfg.replace(task=task))
        if problem is not None:
            problems.append(problem)
    problem = _max_length_error(cfg)
    if problem is not None:
        problems.append(problem)
    return problems


def _rounds_done_error(cfg: RunConfig, out: str | Path) -> str | None:
    """Why resuming the run in ``out`` for ``cfg.rounds`` rounds would do nothing it asks.

    A run that has written rows past ``cfg.rounds`` cannot be cut back by a resume.
    """
    from fedexlora.run.report import read_metrics

    metrics = RunLayout(out).metrics
    try:
        done = max((int(r["round"]) for r in read_metrics(metrics)), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a torn or missing file: the resume itself names it
    if done > cfg.rounds:
        return (
            f"--rounds {cfg.rounds}: the run in {str(out)!r} has already trained {done} "
            f"rounds, and a resume only adds rounds; fix: --rounds {done + 1} or more to "
            f"continue it (or `fedexlora export {out} DEST` to use it as it is)"
        )
    return None


def _max_length_error(cfg: RunConfig) -> str | None:
    """Why ``cfg.max_length`` exceeds the model's positions, from its config alone."""
    from fedexlora.bridge.models import model_config
    from fedexlora.run.build import check_max_length

    try:
        config = model_config(cfg.model)
    except (ValueError, OSError):
        return None  # loading the model names what is wrong with it
    try:
        check_max_length(cfg, config)
    except ValueError as exc:
        return str(exc)
    return None


def _task_error(cfg: RunConfig) -> str | None:
    """Why ``cfg.task`` cannot be loaded, or ``None``; a hub task's name only is checked."""
    from fedexlora.run.build import check_train_rows
    from fedexlora.run.stopping import stop_metric_error
    from fedexlora.tasks.data import hub_task

    try:
        if not hub_task(cfg.task):  # a file, an embedded task or an unknown name: quick
            task = load_task_for(cfg)
            check_train_rows(cfg, task)
            return stop_metric_error(cfg, task.metric_names)
    except ValueError as exc:
        return str(exc)
    return None  # a hub task's metrics are checked once it loads (Run.start)
