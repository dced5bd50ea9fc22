"""``fedexlora run``: a federated run of one or more methods, from flags, a file or a recipe."""

from __future__ import annotations

import inspect
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedexlora.cli._common import console, fail, quiet_libraries, write_error
from fedexlora.cli.options import command, config_params, from_flags, in_flags, option
from fedexlora.config import OUTPUT, SETTINGS, ConfigError

__all__ = ["run_cmd"]

_EXTRAS = {
    "flwr": "flower",
    "ray": "flower",
    "trl": "trl",
    "bitsandbytes": "quantization",
    "opacus": "privacy",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "sacrebleu": "nlg",
    "nltk": "nlg",
    "pycocoevalcap": "nlg",
}
"""The package extra that installs a module, by the module's top-level name."""


def _params() -> list[inspect.Parameter]:
    """Every config field's option (:mod:`fedexlora.cli.options`), and the run's own."""
    fields = config_params()
    panel = [p.default.rich_help_panel for p in fields]
    settings = option(
        "TOML file of settings (see `fedexlora validate`); flags override it",
        "--config",
        panel=SETTINGS,
        kind=Path,
    )
    out = option("Run directory", "--out", panel=OUTPUT, default_text="runs/<time>", kind=Path)
    resume = option(
        "Continue the run in this directory (it may change only the settings that leave "
        "results alone)",
        "--resume",
        panel=OUTPUT,
        kind=Path,
    )
    no_progress = option(
        "Hide progress bars", "--no-progress", panel=OUTPUT, default=False, kind=bool
    )
    first_output = panel.index(OUTPUT)
    last_output = len(panel) - panel[::-1].index(OUTPUT)
    return [
        settings,
        *fields[:first_output],
        out,
        resume,
        *fields[first_output:last_output],
        no_progress,
        *fields[last_output:],
    ]


@command(_params())
def run_cmd(**given) -> None:
    """Federated LoRA fine-tuning: every method on identical partitions, reported side by side."""
    quiet_libraries()
    from fedexlora.config import RunConfig, validate_mapping

    config, out, resume = given["config"], given["out"], given["resume"]
    overrides, errs = from_flags(given)
    if errs:
        fail("; ".join(errs))
    recipe_tasks: tuple[str, ...] = ()
    try:
        if resume is not None:
            cfg = _resumed_config(resume, overrides, config, out)
            out = resume
        elif "recipe" in overrides:
            cfg, recipe_tasks = _recipe_config(overrides, config)
        elif config is not None:
            from fedexlora.run.recipes import get_recipe, load_config_file

            cfg = load_config_file(config, overrides)  # a recipe it names, applied
            if cfg.recipe is not None and not _names_task(config, overrides):
                recipe_tasks = get_recipe(cfg.recipe).tasks  # every task, as --recipe runs
        else:
            cfg_or_none, errs = validate_mapping(overrides)
            if errs:
                raise ConfigError(errs)
            cfg = cfg_or_none or RunConfig()
    except ConfigError as exc:
        fail(str(in_flags(exc, overrides)))
    if resume is None and "fp32_side_branch" in overrides and cfg.low_precision:
        flag = "--fp32-side-branch" if overrides["fp32_side_branch"] else "--no-fp32-side-branch"
        fail(
            f"{flag} applies to an fp32 base; a bf16/fp16 or quantized base always keeps its "
            f"residuals in an fp32 side branch (--dtype {cfg.dtype}"
            + (f", --quantization {cfg.quantization}" if cfg.quantization else "")
            + f"); fix: drop {flag}"
        )
    if out is None:
        import time

        out = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    progress = not given["no_progress"]
    _execute(cfg, out, resume=resume is not None, progress=progress, tasks=recipe_tasks)


def _names_task(config: Path, overrides: dict) -> bool:
    """Whether ``--task`` or the (valid) config file picks a task."""
    from fedexlora.config import read_config, setting_name

    return any(setting_name(k) == "task" for k in read_config(config, overrides))


def _resumed_config(resume: Path, overrides: dict, config: Path | None, out: Path | None):
    """The stored config of the run in ``resume`` with the flags applied that may change.

    A flag that would change the run's results is refused, naming it
    (:func:`fedexlora.config.resumed_config`); none is ignored.
    """
    from fedexlora.config import resumed_config
    from fedexlora.run.layout import RunLayout

    stored_config = RunLayout(resume).config
    if not stored_config.is_file():
        fail(f"--resume {str(resume)!r}: no run there (no config.toml)")
    if config is not None:
        fail("--config cannot be combined with --resume: the run's own config.toml is used")
    if out is not None and Path(out).resolve() != Path(resume).resolve():
        fail(f"--out {str(out)!r} differs from --resume {str(resume)!r}: a run resumes in place")
    return resumed_config(stored_config, overrides)


def _recipe_config(overrides: dict, config: Path | None):
    """The config of ``--recipe``, and the tasks to run.

    The recipe's settings with the other flags on top (each said); all of a multi-task
    recipe's tasks, unless ``--task`` picks one.
    """
    from fedexlora.config import ConfigError, validate_mapping
    from fedexlora.run.recipes import apply_recipe, get_recipe

    if config is not None:
        fail("--recipe cannot be combined with --config: give the recipe, and flags on top")
    rest = {k: v for k, v in overrides.items() if k != "recipe"}
    try:
        recipe = get_recipe(str(overrides["recipe"]))
    except ValueError as exc:
        fail(str(exc))
    mapping, notes = apply_recipe(recipe, rest)
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    cfg, errs = validate_mapping(mapping)
    if errs:
        raise ConfigError(errs)
    return cfg, (recipe.tasks if "task" not in rest else (cfg.task,))


def _execute(cfg, out: Path, *, resume: bool, progress: bool, tasks=()) -> None:
    from fedexlora.run.checkpoint import CheckpointError
    from fedexlora.run.export import export_model
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.layout import RunError, RunLayout
    from fedexlora.run.preflight import check_inputs
    from fedexlora.run.workers import WorkerGroupError
    from fedexlora.training.privacy import DPCheckError

    try:  # everything the run reads and writes, before it writes anything
        check_inputs(cfg, out, resume=resume, tasks=tasks)
    except RunError as exc:
        fail(str(exc))
    layout = RunLayout(out)
    console.print(f"[bold]fedex-lora[/bold] run -> {out}  methods={','.join(cfg.methods)}")

    def run_one(c, directory, again: bool) -> list[dict]:
        if c.engine == "flower":
            from fedexlora.flower.simulation import run_flower_experiment

            return run_flower_experiment(
                c, directory, progress=progress, console=console, resume=again
            )
        return run_experiment(c, directory, resume=again, progress=progress, console=console)

    try:
        if len(tasks) > 1:  # every task of a multi-task recipe, on either engine
            from fedexlora.run.lifecycle import run_tasks

            run_tasks(cfg, tasks, out, run_one, say=console.print)
            console.print(f"wrote {layout.summary}")
            return
        rows = run_one(cfg, out, resume)
        _print_final_table(rows, cfg.recipe)
        console.print(f"wrote {layout.metrics}, {layout.summary}")
        _fail_if_diverged(rows, cfg, out)
    except (RunError, CheckpointError, ValueError, DPCheckError) as exc:
        fail(str(exc))
    except WorkerGroupError as exc:  # a rank died: the rounds done are checkpointed
        fix = "fix that, then " if exc.at_start else ""  # the same start would fail again
        fail(f"{exc}; {fix}continue the run with: fedexlora run --resume {out}", code=1)
    except OSError as exc:  # a disk full or read-only mid-run
        why = write_error(exc, f"fedexlora run --resume {out}")
        if why is None:
            raise
        fail(why, code=1)
    except ImportError as exc:
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        fix = f"; fix: pip install 'fedex-lora[{extra}]'" if extra else ""
        fail(f"a required package is missing: {exc}{fix}")
    if cfg.export:
        try:
            res = export_model(
                out, cfg.export, fmt=cfg.resolved_export_format, dtype=cfg.export_dtype,
                allow_inexact=cfg.allow_inexact,
            )  # fmt: skip
        except (RunError, CheckpointError, ValueError, OSError) as exc:
            fail(
                f"the run in {str(out)!r} is complete, but its export failed: {exc}; "
                f"export it again with: fedexlora export {out} DEST"
            )
        console.print(f"exported {cfg.methods[0]} global model to {res.path} ({res.note})")


def _fail_if_diverged(rows: list[dict], cfg, out: Path) -> None:
    """Exit 1, before any export, when a method's training loss became NaN or Inf."""
    from fedexlora.run.report import diverged

    gone = diverged(rows)
    if gone:
        which = ", ".join(f"{m} in round {r}" for m, r in gone.items())
        fail(
            f"training diverged ({which}): the clients' training loss is not a finite "
            "number, and an upload that is not finite is rejected; the rows are kept in "
            f"{str(out)!r}, nothing is exported. Lower --lr (now {cfg.lr:g})",
            code=1,
        )


def _print_final_table(rows: list[dict], recipe: str | None = None) -> None:
    from fedexlora.run.report import summary_table

    header, cells = summary_table(rows)
    if recipe is not None:  # the paper's figure beside the run's, as summary.md has it
        from fedexlora.run.recipes import get_recipe, paper_beside

        found = get_recipe(recipe)
        paper = paper_beside(found, rows)
        if not paper:
            console.print(
                f"note: the paper's figure for {found.name} is the average over "
                f"{len(found.tasks)} tasks; summary.md says how this task compares",
                highlight=False,
            )
        header = [*header, "paper", "run x100 − paper"]
        for c in cells:
            theirs, diff = paper.get(c[0].split(" ")[0], (None, None))
            c += ["—", "—"] if theirs is None else [f"{theirs:.2f}", f"{diff:+.2f}"]
    table = Table(title="final results")
    # logs and pipes get 80 columns by default, which truncates this table
    out = console if console.is_terminal else Console(width=160)
    for h in header:
        table.add_column(h)
    for c in cells:
        table.add_row(*c)
    out.print(table)
