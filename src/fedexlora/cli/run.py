"""``fedexlora run``: a federated run of one or more methods, from flags, a file or a recipe."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from fedexlora.cli._common import console, fail, quiet_libraries
from fedexlora.config import RESUME_SAFE, ConfigError
from fedexlora.core.methods import REGISTRY

__all__ = ["RUN_FLAGS", "run_cmd"]

RUN_FLAGS = {
    # flag name -> config key, for the flags that map one to one
    "model": "model",
    "task": "task",
    "method": "methods",
    "num_clients": "num_clients",
    "partition": "partition",
    "alpha": "alpha",
    "min_partition_size": "min_partition_size",
    "rounds": "rounds",
    "local_epochs": "local_epochs",
    "local_steps": "local_steps",
    "batch_size": "batch_size",
    "lr": "lr",
    "max_length": "max_length",
    "rank": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "rslora": "rslora",
    "fraction": "fraction",
    "weighting": "weighting",
    "seed": "seed",
    "max_train": "max_train",
    "max_test": "max_test",
    "residual_rank": "residual_rank",
    "max_update_norm": "max_update_norm",
    "secure_aggregation": "secure_aggregation",
    "engine": "engine",
    "trainer": "trainer",
    "save_client_adapters": "save_client_adapters",
    "keep_checkpoints": "keep_checkpoints",
    "export": "export",
    "device": "device",
    "dtype": "dtype",
    "client_ranks": "client_ranks",
    "eval_batch_size": "eval_batch_size",
    "max_grad_norm": "max_grad_norm",
    "max_new_tokens": "max_new_tokens",
    "num_beams": "num_beams",
    "test_fraction": "test_fraction",
    "warmup_ratio": "warmup_ratio",
    "weight_decay": "weight_decay",
    "gradient_checkpointing": "gradient_checkpointing",
    "quantization": "quantization",
    "double_quant": "double_quant",
    "side_rank": "side_rank",
    "fp32_side_branch": "fp32_side_branch",
    "export_format": "export_format",
    "export_dtype": "export_dtype",
    "allow_inexact": "allow_inexact",
    "report_to": "report_to",
    "dp_epsilon": "dp_epsilon",
    "dp_delta": "dp_delta",
    "dp_max_grad_norm": "dp_max_grad_norm",
    "fedsb_rank": "fedsb_rank",
    "fedsb_init": "fedsb_init",
    "fedsb_init_samples": "fedsb_init_samples",
    "data_dir": "data_dir",
    "recipe": "recipe",
}
"""Each ``run`` flag that sets one config key, by its parameter name."""

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

# The panels of `fedexlora run --help`, in the order they are shown. A default is written
# "(default: X)" in the help text: the flags default to None (unset, so that a --config
# file or a --recipe can set them), and brackets would be read as rich markup.
SETTINGS = "Settings"
MODEL = "Model and LoRA"
DATA = "Data"
METHOD = "Method"
FEDERATION = "Federation"
TRAINING = "Training"
EVALUATION = "Evaluation"
PRECISION = "Device, precision and memory"
PRIVACY = "Privacy"
OUTPUT = "Output and resume"
EXPORT = "Export"


def run_cmd(
    # Settings
    config: Path | None = typer.Option(
        None,
        "--config",
        help="TOML file of settings (see `fedexlora validate`); flags override it.",
        rich_help_panel=SETTINGS,
    ),
    recipe: str | None = typer.Option(
        None,
        help="A paper experiment (see `fedexlora recipes`): its settings, and the paper's "
        "figures beside this run's; other flags override it.",
        rich_help_panel=SETTINGS,
    ),
    # Model and LoRA
    model: str | None = typer.Option(
        None,
        help="minilm, smollm2-135m, a hub name such as org/name, or a local directory "
        "(default: minilm).",
        rich_help_panel=MODEL,
    ),
    rank: int | None = typer.Option(
        None, "--rank", "-r", help="LoRA rank (default: 8).", rich_help_panel=MODEL
    ),
    lora_alpha: float | None = typer.Option(
        None, help="LoRA alpha (default: 16).", rich_help_panel=MODEL
    ),
    lora_dropout: float | None = typer.Option(
        None, help="LoRA dropout (default: 0.05).", rich_help_panel=MODEL
    ),
    target_modules: str | None = typer.Option(
        None,
        help="Comma list of LoRA targets (default: per architecture).",
        rich_help_panel=MODEL,
    ),
    rslora: bool | None = typer.Option(
        None,
        "--rslora/--no-rslora",
        help="Rank-stabilised scale (default: off).",
        rich_help_panel=MODEL,
    ),
    # Data
    task: str | None = typer.Option(
        None,
        help="bbc-news, gsm8k, sst2..., or a .csv/.jsonl file (default: bbc-news).",
        rich_help_panel=DATA,
    ),
    data_dir: str | None = typer.Option(
        None,
        help="Local copies of hub datasets, in the hub's file layout, "
        "DIR/nyu-mll/glue/sst2/... (default: $FEDEXLORA_DATA_DIR).",
        rich_help_panel=DATA,
    ),
    max_length: int | None = typer.Option(
        None, help="Max tokens per example (default: 64).", rich_help_panel=DATA
    ),
    test_fraction: float | None = typer.Option(
        None, help="Held-out test fraction (default: 0.2).", rich_help_panel=DATA
    ),
    max_train: int | None = typer.Option(
        None, help="Use only this many training examples (default: all).", rich_help_panel=DATA
    ),
    max_test: int | None = typer.Option(
        None, help="Use only this many test examples (default: all).", rich_help_panel=DATA
    ),
    # Method
    method: str | None = typer.Option(
        None,
        help=f"Comma list of {', '.join(REGISTRY)}; `fedexlora methods` describes each "
        "(default: fedex).",
        rich_help_panel=METHOD,
    ),
    residual_rank: int | None = typer.Option(
        None,
        help="Truncate FedEx-LoRA's residuals to this rank, which is lossy (default: exact).",
        rich_help_panel=METHOD,
    ),
    fedsb_rank: int | None = typer.Option(
        None,
        help="Fed-SB's rank: its r x r core is what clients train and send (default: 64).",
        rich_help_panel=METHOD,
    ),
    fedsb_init: str | None = typer.Option(
        None,
        help="Fed-SB's frozen A and B: gradient (the authors' SVD of a sign-gradient step) "
        "or random; auto is random with --dp-epsilon, else gradient (default: auto).",
        rich_help_panel=METHOD,
    ),
    fedsb_init_samples: int | None = typer.Option(
        None,
        help="Examples Fed-SB's gradient init is estimated on (default: 256).",
        rich_help_panel=METHOD,
    ),
    # Federation
    num_clients: int | None = typer.Option(
        None,
        "--num-clients",
        "--clients",
        help="Clients (default: 3).",
        rich_help_panel=FEDERATION,
    ),
    partition: str | None = typer.Option(
        None, help="iid or dirichlet (default: dirichlet).", rich_help_panel=FEDERATION
    ),
    alpha: float | None = typer.Option(
        None, help="Dirichlet concentration (default: 0.5).", rich_help_panel=FEDERATION
    ),
    min_partition_size: int | None = typer.Option(
        None, help="Minimum examples per client (default: 10).", rich_help_panel=FEDERATION
    ),
    rounds: int | None = typer.Option(
        None, help="Federated rounds (default: 3).", rich_help_panel=FEDERATION
    ),
    fraction: float | None = typer.Option(
        None,
        help="Fraction of clients per round, rounded half up, at least one (default: 1.0).",
        rich_help_panel=FEDERATION,
    ),
    weighting: str | None = typer.Option(
        None,
        help="How client updates are weighted: examples or uniform (default: each "
        "method's own: uniform for fedsa, as its release; examples otherwise).",
        rich_help_panel=FEDERATION,
    ),
    client_ranks: str | None = typer.Option(
        None,
        help="Comma list: each client's LoRA rank; the global rank is the largest "
        "(default: every client at --rank).",
        rich_help_panel=FEDERATION,
    ),
    max_update_norm: float | None = typer.Option(
        None,
        help="Reject client updates above this norm (default: off).",
        rich_help_panel=FEDERATION,
    ),
    secure_aggregation: bool | None = typer.Option(
        None,
        "--secure-aggregation/--no-secure-aggregation",
        help="Flower's SecAgg+: the server sees only sums of the uploads, and FedEx stays "
        "exact; see docs/PRIVACY.md (default: off).",
        rich_help_panel=FEDERATION,
    ),
    engine: str | None = typer.Option(
        None,
        help="local (in process) or flower, a Flower simulation (default: local).",
        rich_help_panel=FEDERATION,
    ),
    # Training
    trainer: str | None = typer.Option(
        None,
        help="builtin, or trl: each client trains with TRL's SFTTrainer (causal-LM tasks; "
        "needs the trl extra) (default: builtin).",
        rich_help_panel=TRAINING,
    ),
    local_epochs: float | None = typer.Option(
        None, help="Local epochs per round (default: 1).", rich_help_panel=TRAINING
    ),
    local_steps: int | None = typer.Option(
        None,
        help="Local steps per round; overrides --local-epochs.",
        rich_help_panel=TRAINING,
    ),
    batch_size: int | None = typer.Option(
        None, help="Batch size (default: 16).", rich_help_panel=TRAINING
    ),
    lr: float | None = typer.Option(
        None, help="Learning rate (default: 1e-3).", rich_help_panel=TRAINING
    ),
    weight_decay: float | None = typer.Option(
        None, help="AdamW weight decay (default: 0).", rich_help_panel=TRAINING
    ),
    warmup_ratio: float | None = typer.Option(
        None, help="Fraction of steps for warm-up (default: 0).", rich_help_panel=TRAINING
    ),
    max_grad_norm: float | None = typer.Option(
        None, help="Gradient clipping norm (default: 1.0).", rich_help_panel=TRAINING
    ),
    seed: int | None = typer.Option(
        None, help="Seed for everything random (default: 0).", rich_help_panel=TRAINING
    ),
    # Evaluation
    eval_batch_size: int | None = typer.Option(
        None, help="Evaluation batch size (default: 64).", rich_help_panel=EVALUATION
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        help="Tokens generated per answer, causal LM exact match (default: 64).",
        rich_help_panel=EVALUATION,
    ),
    num_beams: int | None = typer.Option(
        None,
        help="Beams when generating answers; 1 is greedy (default: 1).",
        rich_help_panel=EVALUATION,
    ),
    # Device, precision and memory
    device: str | None = typer.Option(
        None, help="auto, cpu or cuda (default: cpu).", rich_help_panel=PRECISION
    ),
    dtype: str | None = typer.Option(
        None,
        help="fp32, bf16 or fp16: base weights and autocast (default: fp32).",
        rich_help_panel=PRECISION,
    ),
    quantization: str | None = typer.Option(
        None,
        help="nf4, fp4 or int8: quantize the base with bitsandbytes (default: none).",
        rich_help_panel=PRECISION,
    ),
    double_quant: bool | None = typer.Option(
        None,
        "--double-quant/--no-double-quant",
        help="Quantize the 4-bit block scales too (default: off).",
        rich_help_panel=PRECISION,
    ),
    side_rank: int | None = typer.Option(
        None,
        help="Cap the fp32 side branch at this rank, lossy with error feedback (default: exact).",
        rich_help_panel=PRECISION,
    ),
    fp32_side_branch: bool | None = typer.Option(
        None,
        "--fp32-side-branch/--no-fp32-side-branch",
        help="Keep an fp32 base's residuals beside it, not rounded into W: exact at any "
        "learning rate, one more matmul per LoRA layer (default: on for exact methods "
        "without DP; --no-fp32-side-branch folds them into W).",
        rich_help_panel=PRECISION,
    ),
    gradient_checkpointing: bool | None = typer.Option(
        None,
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Trade compute for memory (default: off).",
        rich_help_panel=PRECISION,
    ),
    # Privacy
    dp_epsilon: float | None = typer.Option(
        None,
        help="DP-SGD on every client: total epsilon per client over the run (default: off).",
        rich_help_panel=PRIVACY,
    ),
    dp_delta: float | None = typer.Option(
        None,
        help="DP delta, below 1 / the smallest client's examples (default: 1e-5).",
        rich_help_panel=PRIVACY,
    ),
    dp_max_grad_norm: float | None = typer.Option(
        None, help="DP-SGD per-sample clipping norm (default: 1.0).", rich_help_panel=PRIVACY
    ),
    # Output and resume
    out: Path | None = typer.Option(
        None, "--out", help="Run directory (default: runs/<time>).", rich_help_panel=OUTPUT
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        help="Continue the run in this directory (it may change only the settings that "
        "leave results alone).",
        rich_help_panel=OUTPUT,
    ),
    keep_checkpoints: int | None = typer.Option(
        None, help="Checkpoints kept per method (default: 2).", rich_help_panel=OUTPUT
    ),
    save_client_adapters: bool | None = typer.Option(
        None,
        "--save-client-adapters/--no-save-client-adapters",
        help="Write client adapters (default: off).",
        rich_help_panel=OUTPUT,
    ),
    report_to: str | None = typer.Option(
        None,
        help="Comma list of tensorboard, mlflow: log every round there (default: none).",
        rich_help_panel=OUTPUT,
    ),
    no_progress: bool = typer.Option(
        False, "--no-progress", help="Hide progress bars.", rich_help_panel=OUTPUT
    ),
    # Export
    export: Path | None = typer.Option(
        None, help="Also export the final model here.", rich_help_panel=EXPORT
    ),
    export_format: str | None = typer.Option(
        None,
        help="adapter or merged (default: merged for fp32 bases, adapter with a side "
        "branch: bf16/fp16, quantized, --fp32-side-branch).",
        rich_help_panel=EXPORT,
    ),
    export_dtype: str | None = typer.Option(
        None, help="Merged export dtype (default: fp32).", rich_help_panel=EXPORT
    ),
    allow_inexact: bool | None = typer.Option(
        None,
        "--allow-inexact/--no-allow-inexact",
        help="Allow an export that rounds (default: off).",
        rich_help_panel=EXPORT,
    ),
) -> None:
    """Federated LoRA fine-tuning: every method on identical partitions, reported side by side."""
    quiet_libraries()
    from fedexlora.config import RunConfig, load_config, validate_mapping

    given = dict(locals())
    overrides = {}
    for flag, key in RUN_FLAGS.items():
        value = given.get(flag)
        if value is None:
            continue
        if flag in ("method", "target_modules", "report_to"):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if flag == "client_ranks":
            try:
                value = [int(v) for v in str(value).split(",") if v.strip()]
            except ValueError:
                fail(f"--client-ranks must be a comma list of integers, got {value!r}")
        if isinstance(value, Path):
            value = str(value)
        overrides[key] = value
    recipe_tasks: tuple[str, ...] = ()
    try:
        if resume is not None:
            cfg = _resumed_config(resume, overrides, config, out)
            out = resume
        elif "recipe" in overrides:
            cfg, recipe_tasks = _recipe_config(overrides, config)
        elif config is not None:
            cfg = load_config(config, overrides)
        else:
            cfg_or_none, errs = validate_mapping(overrides)
            if errs:
                raise ConfigError(errs)
            cfg = cfg_or_none or RunConfig()
    except ConfigError as exc:
        fail(str(in_flags(exc, overrides)))
    if out is None:
        import time

        out = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    _execute(cfg, out, resume=resume is not None, progress=not no_progress, tasks=recipe_tasks)


def in_flags(exc: ConfigError, typed: dict) -> ConfigError:
    """``exc`` with each setting the user gave as a flag named as the flag they typed.

    The configuration names its keys (`lora_r`); a user who typed ``--rank`` reads
    `--rank`. Settings from a TOML file keep their key, which is what the file says.
    """
    import click

    flag_of = {}
    for param in click.get_current_context().command.params:
        key = RUN_FLAGS.get(param.name or "")
        if key in typed and param.opts:
            flag_of[key] = param.opts[0]
    errors = []
    for message in exc.errors:
        for key, flag in flag_of.items():
            message = message.replace(f"`{key}`", f"`{flag}`")
        errors.append(message)
    return type(exc)(errors)


def _resumed_config(resume: Path, overrides: dict, config: Path | None, out: Path | None):
    """The stored config of the run in ``resume`` with the safe flags applied.

    A flag that would change the run's results is refused, naming it; none is ignored.
    """
    from fedexlora.config import load_run_config
    from fedexlora.run.layout import RunLayout

    stored_config = RunLayout(resume).config
    if not stored_config.is_file():
        fail(f"--resume {str(resume)!r}: no run there (no config.toml)")
    if config is not None:
        fail("--config cannot be combined with --resume: the run's own config.toml is used")
    if out is not None and Path(out).resolve() != Path(resume).resolve():
        fail(f"--out {str(out)!r} differs from --resume {str(resume)!r}: a run resumes in place")
    stored = load_run_config(stored_config)
    flag_of = {key: flag for flag, key in RUN_FLAGS.items()}
    for key, value in overrides.items():
        if key in RESUME_SAFE:
            continue
        before = getattr(stored, key)
        try:
            # getattr, not to_dict(): a setting left unset (None) is not in the dict
            same = getattr(stored.replace(**{key: value}), key) == getattr(stored, key)
        except (TypeError, ValueError):
            same = False
        if not same:
            flag = "--" + flag_of.get(key, key).replace("_", "-")
            safe = ", ".join("--" + k.replace("_", "-") for k in RESUME_SAFE)
            fail(
                f"{flag} {value!r} would change the results of the run being resumed "
                f"(it was started with {before!r}); start a new run with --out instead. "
                f"A resume may change only {safe} and --no-progress"
            )
    return load_run_config(stored_config, {k: v for k, v in overrides.items() if k in RESUME_SAFE})


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
    from fedexlora.run.layout import RunError, RunLayout
    from fedexlora.run.pipeline import check_inputs, run_experiment
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
    except (RunError, CheckpointError, ValueError, DPCheckError) as exc:
        fail(str(exc))
    except ImportError as exc:
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        fix = f"; fix: pip install 'fedex-lora[{extra}]'" if extra else ""
        fail(f"a required package is missing: {exc}{fix}")
    if cfg.export:
        try:
            res = export_model(out, cfg.export)
        except (RunError, CheckpointError, ValueError, OSError) as exc:
            fail(
                f"the run in {str(out)!r} is complete, but its export failed: {exc}; "
                f"export it again with: fedexlora export {out} DEST"
            )
        console.print(f"exported {cfg.methods[0]} global model to {res.path} ({res.note})")


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
