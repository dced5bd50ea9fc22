"""The ``fedexlora`` command line: run, export, validate."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from fedexlora.config import RESUME_SAFE
from fedexlora.experiments.bench import bench_app

app = typer.Typer(
    pretty_exceptions_show_locals=False,
    add_completion=False,
    no_args_is_help=True,
    help="Federated LoRA fine-tuning with exact aggregation (FedEx-LoRA) and its baselines.",
)
console = Console()
app.add_typer(bench_app, name="bench")
err_console = Console(stderr=True)

_RUN_FLAGS = {
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
    "engine": "engine",
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


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # escaped: a message may hold brackets (pip extras, lists) that rich would eat
    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def _quiet_libraries() -> None:
    from fedexlora.quiet import quiet_libraries

    quiet_libraries()


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


@app.command()
def run(
    config: Path | None = typer.Option(None, "--config", help="TOML file of settings."),
    out: Path | None = typer.Option(None, "--out", help="Run directory [default: runs/<time>]."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this directory."
    ),
    model: str | None = typer.Option(
        None, help="minilm, smollm2-135m, a hub name or a path [minilm]."
    ),
    task: str | None = typer.Option(
        None, help="bbc-news, gsm8k, sst2..., or a .csv/.jsonl [bbc-news]."
    ),
    method: str | None = typer.Option(
        None, help="Comma list of fedex,fedit,ffa,flora,fedsb,centralized [fedex]."
    ),
    num_clients: int | None = typer.Option(None, "--num-clients", "--clients", help="Clients [3]."),
    partition: str | None = typer.Option(None, help="iid or dirichlet [dirichlet]."),
    alpha: float | None = typer.Option(None, help="Dirichlet concentration [0.5]."),
    min_partition_size: int | None = typer.Option(None, help="Minimum examples per client [10]."),
    rounds: int | None = typer.Option(None, help="Federated rounds [3]."),
    local_epochs: float | None = typer.Option(None, help="Local epochs per round [1]."),
    local_steps: int | None = typer.Option(None, help="Local steps per round (overrides epochs)."),
    batch_size: int | None = typer.Option(None, help="Batch size [16]."),
    lr: float | None = typer.Option(None, help="Learning rate [1e-3]."),
    max_length: int | None = typer.Option(None, help="Max tokens per example [64]."),
    rank: int | None = typer.Option(None, "--rank", "-r", help="LoRA rank [8]."),
    lora_alpha: float | None = typer.Option(None, help="LoRA alpha [16]."),
    lora_dropout: float | None = typer.Option(None, help="LoRA dropout [0.05]."),
    target_modules: str | None = typer.Option(
        None, help="Comma list of LoRA targets [per architecture]."
    ),
    rslora: bool | None = typer.Option(None, "--rslora/--no-rslora", help="Rank-stabilised scale."),
    eval_batch_size: int | None = typer.Option(None, help="Evaluation batch size [64]."),
    weight_decay: float | None = typer.Option(None, help="AdamW weight decay [0]."),
    warmup_ratio: float | None = typer.Option(None, help="Fraction of steps for warm-up [0]."),
    max_grad_norm: float | None = typer.Option(None, help="Gradient clipping norm [1.0]."),
    test_fraction: float | None = typer.Option(None, help="Held-out test fraction [0.2]."),
    max_new_tokens: int | None = typer.Option(
        None, help="Tokens generated per answer (causal LM exact match) [64]."
    ),
    num_beams: int | None = typer.Option(
        None, help="Beams when generating answers; 1 is greedy [1]."
    ),
    client_ranks: str | None = typer.Option(
        None, help="Comma list: each client's LoRA rank (global rank = the largest)."
    ),
    fraction: float | None = typer.Option(
        None, help="Fraction of clients per round, rounded half up, at least one [1.0]."
    ),
    weighting: str | None = typer.Option(None, help="examples or uniform [examples]."),
    seed: int | None = typer.Option(None, help="Seed for everything random [0]."),
    max_train: int | None = typer.Option(None, help="Use only this many training examples."),
    max_test: int | None = typer.Option(None, help="Use only this many test examples."),
    residual_rank: int | None = typer.Option(None, help="Truncate residuals to this rank (lossy)."),
    max_update_norm: float | None = typer.Option(
        None, help="Reject client updates above this norm."
    ),
    engine: str | None = typer.Option(None, help="local or flower [local]."),
    save_client_adapters: bool | None = typer.Option(
        None, "--save-client-adapters/--no-save-client-adapters", help="Write client adapters."
    ),
    keep_checkpoints: int | None = typer.Option(None, help="Checkpoints kept per method [2]."),
    export: Path | None = typer.Option(None, help="Also export the final model here."),
    device: str | None = typer.Option(None, help="auto, cpu or cuda [cpu]."),
    dtype: str | None = typer.Option(
        None, help="fp32, bf16 or fp16 (base weights, autocast) [fp32]."
    ),
    quantization: str | None = typer.Option(
        None, help="nf4, fp4 or int8: quantize the base with bitsandbytes [none]."
    ),
    double_quant: bool | None = typer.Option(
        None, "--double-quant/--no-double-quant", help="Quantize the 4-bit block scales too."
    ),
    side_rank: int | None = typer.Option(
        None, help="Cap the fp32 side branch at this rank (lossy, error feedback)."
    ),
    export_format: str | None = typer.Option(
        None, help="adapter or merged [merged for fp32 bases, else adapter]."
    ),
    export_dtype: str | None = typer.Option(None, help="Merged export dtype [fp32]."),
    allow_inexact: bool | None = typer.Option(
        None, "--allow-inexact/--no-allow-inexact", help="Allow an export that rounds."
    ),
    gradient_checkpointing: bool | None = typer.Option(
        None,
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Trade compute for memory.",
    ),
    report_to: str | None = typer.Option(
        None, help="Comma list of tensorboard, mlflow: log every round there [none]."
    ),
    dp_epsilon: float | None = typer.Option(
        None, help="DP-SGD on every client: total epsilon per client over the run [off]."
    ),
    dp_delta: float | None = typer.Option(
        None, help="DP delta, below 1 / the smallest client's examples [1e-5]."
    ),
    dp_max_grad_norm: float | None = typer.Option(
        None, help="DP-SGD per-sample clipping norm [1.0]."
    ),
    fedsb_rank: int | None = typer.Option(
        None, help="Fed-SB's rank: its r x r core is what clients train and send [64]."
    ),
    fedsb_init: str | None = typer.Option(
        None,
        help="Fed-SB's frozen A and B: gradient (the authors' SVD of a sign-gradient step) "
        "or random; auto is random with --dp-epsilon, else gradient [auto].",
    ),
    fedsb_init_samples: int | None = typer.Option(
        None, help="Examples Fed-SB's gradient init is estimated on [256]."
    ),
    recipe: str | None = typer.Option(
        None,
        help="A paper experiment (see `fedexlora recipes`): its settings, and the paper's "
        "figures beside this run's; other flags override it.",
    ),
    data_dir: str | None = typer.Option(
        None,
        help="Local copies of hub datasets, in the hub's file layout "
        "(DIR/nyu-mll/glue/sst2/...) [$FEDEXLORA_DATA_DIR].",
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide progress bars."),
) -> None:
    """Federated LoRA fine-tuning: every method on identical partitions, reported side by side."""
    _quiet_libraries()
    from fedexlora.config import ConfigError, RunConfig, load_config, validate_mapping

    given = dict(locals())
    overrides = {}
    for flag, key in _RUN_FLAGS.items():
        value = given.get(flag)
        if value is None:
            continue
        if flag in ("method", "target_modules", "report_to"):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if flag == "client_ranks":
            try:
                value = [int(v) for v in str(value).split(",") if v.strip()]
            except ValueError:
                _fail(f"--client-ranks must be a comma list of integers, got {value!r}")
            if rank is None and value:
                overrides["lora_r"] = max(value)
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
        _fail(str(exc))
    if out is None:
        import time

        out = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    _execute(cfg, out, resume=resume is not None, progress=not no_progress, tasks=recipe_tasks)


def _resumed_config(resume: Path, overrides: dict, config: Path | None, out: Path | None):
    """The stored config of the run in ``resume`` with the safe flags applied.

    A flag that would change the run's results is refused, naming it; none is ignored.
    """
    from fedexlora.config import load_config

    if not (resume / "config.toml").is_file():
        _fail(f"--resume {str(resume)!r}: no run there (no config.toml)")
    if config is not None:
        _fail("--config cannot be combined with --resume: the run's own config.toml is used")
    if out is not None and Path(out).resolve() != Path(resume).resolve():
        _fail(f"--out {str(out)!r} differs from --resume {str(resume)!r}: a run resumes in place")
    stored = load_config(resume / "config.toml")
    flag_of = {key: flag for flag, key in _RUN_FLAGS.items()}
    for key, value in overrides.items():
        if key in RESUME_SAFE:
            continue
        before = getattr(stored, key)
        try:
            same = stored.replace(**{key: value}).to_dict()[key] == stored.to_dict()[key]
        except (TypeError, ValueError):
            same = False
        if not same:
            flag = "--" + flag_of.get(key, key).replace("_", "-")
            safe = ", ".join("--" + k.replace("_", "-") for k in RESUME_SAFE)
            _fail(
                f"{flag} {value!r} would change the results of the run being resumed "
                f"(it was started with {before!r}); start a new run with --out instead. "
                f"A resume may change only {safe} and --no-progress"
            )
    return load_config(
        resume / "config.toml", {k: v for k, v in overrides.items() if k in RESUME_SAFE}
    )


def _recipe_config(overrides: dict, config: Path | None):
    """The config of ``--recipe``, and the tasks to run.

    The recipe's settings with the other flags on top (each said); all of a multi-task
    recipe's tasks, unless ``--task`` picks one.
    """
    from fedexlora.config import ConfigError, validate_mapping
    from fedexlora.run.recipes import apply_recipe, get_recipe

    if config is not None:
        _fail("--recipe cannot be combined with --config: give the recipe, and flags on top")
    rest = {k: v for k, v in overrides.items() if k != "recipe"}
    try:
        recipe = get_recipe(str(overrides["recipe"]))
    except ValueError as exc:
        _fail(str(exc))
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
    from fedexlora.run.pipeline import RunError, run_experiment

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
            console.print(f"wrote {out / 'summary.md'}")
            return
        rows = run_one(cfg, out, resume)
        _print_final_table(rows, cfg.recipe)
        console.print(f"wrote {out / 'metrics.jsonl'}, {out / 'summary.md'}")
        if cfg.export:
            res = export_model(out, cfg.export)
            console.print(f"exported {cfg.methods[0]} global model to {res.path} ({res.note})")
    except (RunError, CheckpointError, ValueError) as exc:
        _fail(str(exc))
    except ImportError as exc:
        _fail(f"a required package is missing: {exc}")


@app.command("recipes")
def recipes_cmd() -> None:
    """The paper's experiments: one command each, with the paper's figure per method."""
    from fedexlora.run.recipes import recipe_table

    header, rows = recipe_table()
    table = Table(title="fedexlora run --recipe NAME (figures: the FedEx-LoRA paper)")
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    (console if console.is_terminal else Console(width=200)).print(table)


@app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="A run directory written by `fedexlora run`."),
    dest: Path = typer.Argument(..., help="Where to write the model or adapter."),
    method: str | None = typer.Option(None, help="Which method's model [the run's first]."),
    fmt: str | None = typer.Option(
        None,
        "--format",
        help="adapter (PEFT, exact on the unchanged base) or merged (Hugging Face model) "
        "[merged for fp32 bases, adapter for bf16/fp16/quantized].",
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Merged model dtype [fp32]."),
    allow_inexact: bool = typer.Option(
        False, "--allow-inexact", help="Allow a merged bf16/fp16 model (rounds the update)."
    ),
) -> None:
    """Export a run's final global model, exactly: a PEFT adapter or a merged model."""
    _quiet_libraries()
    from fedexlora.run.checkpoint import CheckpointError
    from fedexlora.run.export import export_model
    from fedexlora.run.pipeline import RunError

    try:
        res = export_model(
            run_dir, dest, method, fmt=fmt, dtype=dtype, allow_inexact=allow_inexact or None
        )
    except (RunError, CheckpointError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"exported to {res.path} ({res.note})")


@app.command()
def validate(config: Path = typer.Argument(..., help="A TOML config file.")) -> None:
    """Check a config file and list every error at once."""
    from fedexlora.config import ConfigError, load_config

    try:
        load_config(config)
    except ConfigError as exc:
        _fail(str(exc), code=1)
    console.print(f"{config}: valid")


_COMPARE_DEFAULTS = dict(
    model="minilm",
    task="bbc-news",
    method="fedex,fedit,ffa,flora,centralized",
    ranks="1,4",
    seeds="0,1,2",
    settings="iid-3,dir0.1-5",
    rounds=5,
    local_steps="12",
    total_steps=None,
    batch_size=16,
    lr=2e-3,
    lora_alpha=8.0,
    max_length=32,
    max_test=200,
    min_partition_size=10,
)
# The "when exactness matters" study (docs/WHEN_EXACTNESS_MATTERS.md): local steps per
# round x heterogeneity x clients at a fixed total of local steps per client.
_STUDIES = {
    "exactness": dict(
        method="fedex,fedit,centralized",
        ranks="4",
        seeds="0,1,2,3,4",
        settings="iid-3,dir1.0-3,dir0.1-3,iid-10,dir1.0-10,dir0.1-10",
        local_steps="4,12,24",
        total_steps=24,
        batch_size=4,
        lr=5e-3,
        max_test=None,
    ),
    # The private comparison (docs/PRIVACY.md): accuracy against epsilon, 4 methods.
    "privacy": dict(
        method="fedex,fedit,ffa,fedsb",
        ranks="8",
        seeds="0,1,2",
        settings="iid-3,dir0.1-3",
        rounds=3,
        local_steps="8",
        batch_size=32,
        lr=3e-2,
        lora_alpha=16.0,
        dp_epsilons="1,3,8,inf",
        dp_max_grad_norm=0.1,
        fedsb_init="random",
    ),
}


@app.command()
def compare(
    out: Path = typer.Option(Path("runs/compare"), help="Directory of the grid."),
    study: str | None = typer.Option(
        None,
        help="A preset grid: 'exactness' (local steps x heterogeneity x clients) or "
        "'privacy' (methods x epsilon, docs/PRIVACY.md).",
    ),
    report: Path | None = typer.Option(
        None, help="Also write the study report here (with several --local-steps)."
    ),
    model: str | None = typer.Option(None, help="Model [minilm]."),
    task: str | None = typer.Option(None, help="Task [bbc-news]."),
    method: str | None = typer.Option(None, help="Methods [fedex,fedit,ffa,flora,centralized]."),
    ranks: str | None = typer.Option(None, help="Comma list of LoRA ranks [1,4]."),
    seeds: str | None = typer.Option(None, help="Comma list of seeds [0,1,2]."),
    settings: str | None = typer.Option(
        None, help="Comma list of iid-K or dirA-K (K clients, Dirichlet alpha A) [iid-3,dir0.1-5]."
    ),
    rounds: int | None = typer.Option(None, help="Rounds per run [5]."),
    local_steps: str | None = typer.Option(
        None, help="Local steps per client and round; a comma list is an axis [12]."
    ),
    total_steps: int | None = typer.Option(
        None,
        help="Local steps per client in all: each cell runs total/steps rounds, and "
        "centralized runs once per client count.",
    ),
    batch_size: int | None = typer.Option(None, help="Batch size [16]."),
    lr: float | None = typer.Option(None, help="Learning rate [2e-3]."),
    lora_alpha: float | None = typer.Option(None, help="LoRA alpha (the paper's 8) [8]."),
    max_length: int | None = typer.Option(None, help="Max tokens per example [32]."),
    max_test: int | None = typer.Option(None, help="Test examples per evaluation [200]."),
    full_test: bool = typer.Option(False, help="Evaluate on the whole test split."),
    min_partition_size: int | None = typer.Option(None, help="Minimum examples per client [10]."),
    dp_epsilons: str | None = typer.Option(
        None,
        help="Comma list of DP budgets per client, inf for none (e.g. 1,3,8,inf): an axis, "
        "reported in privacy.md (or --report) [no DP].",
    ),
    dp_delta: float | None = typer.Option(None, help="DP delta of the private cells [1e-5]."),
    dp_max_grad_norm: float | None = typer.Option(
        None, help="DP-SGD clipping norm of the private cells [1.0]."
    ),
    fedsb_rank: int | None = typer.Option(None, help="Fed-SB's rank [64]."),
    fedsb_init: str | None = typer.Option(
        None, help="Fed-SB's init, gradient or random; auto: random with DP [auto]."
    ),
    max_train: int | None = typer.Option(None, help="Training examples in all [all]."),
) -> None:
    """Grid of methods x settings x ranks x seeds on identical partitions -> comparison.md.

    The defaults are sized to finish in about 45 minutes on 2 idle CPU cores: 5 rounds of
    12 local steps (60 steps per client in all), 32 tokens per article, 200 test articles.
    `--study exactness` runs the "when exactness matters" study instead (see
    docs/WHEN_EXACTNESS_MATTERS.md); flags given with it override its values.
    """
    _quiet_libraries()
    from fedexlora.config import ConfigError, validate_mapping
    from fedexlora.experiments.compare import Setting, run_grid

    given = dict(
        model=model,
        task=task,
        method=method,
        ranks=ranks,
        seeds=seeds,
        settings=settings,
        rounds=rounds,
        local_steps=local_steps,
        total_steps=total_steps,
        batch_size=batch_size,
        lr=lr,
        lora_alpha=lora_alpha,
        max_length=max_length,
        max_test=max_test,
        min_partition_size=min_partition_size,
        dp_epsilons=dp_epsilons,
        dp_delta=dp_delta,
        dp_max_grad_norm=dp_max_grad_norm,
        fedsb_rank=fedsb_rank,
        fedsb_init=fedsb_init,
        max_train=max_train,
    )
    if study is not None and study not in _STUDIES:
        _fail(f"--study: unknown study {study!r}; choose from {', '.join(_STUDIES)}")
    opts = {**_COMPARE_DEFAULTS, **_STUDIES.get(study or "", {})}
    opts.update({k: v for k, v in given.items() if v is not None})
    if full_test:
        if max_test is not None:
            _fail("--full-test and --max-test contradict each other: give one")
        opts["max_test"] = None

    def items(flag: str, value: str) -> list[str]:
        out = [x.strip() for x in value.split(",") if x.strip()]
        if not out:
            _fail(f"{flag} is empty (got {value!r})")
        return out

    def ints(flag: str, value: str) -> list[int]:
        try:
            return [int(x) for x in items(flag, value)]
        except ValueError:
            _fail(f"{flag} must be a comma list of integers, got {value!r}")

    parsed = []
    for s in items("--settings", opts["settings"]):
        kind, _, k = s.rpartition("-")
        try:
            if kind == "iid":
                parsed.append(Setting(s, int(k), "iid"))
            elif kind.startswith("dir"):
                parsed.append(Setting(s, int(k), "dirichlet", float(kind[3:])))
            else:
                raise ValueError(s)
        except ValueError:
            _fail(f"--settings: cannot parse {s!r}; use iid-K or dirA-K, e.g. iid-3,dir0.1-5")
    rank_list = ints("--ranks", opts["ranks"])
    seed_list = ints("--seeds", opts["seeds"])
    steps_list = ints("--local-steps", opts["local_steps"])
    if any(x < 1 for x in steps_list):
        _fail(f"--local-steps must be >= 1, got {opts['local_steps']!r}")
    if opts["total_steps"] is not None and opts["total_steps"] < 1:
        _fail(f"--total-steps must be >= 1, got {opts['total_steps']}")
    eps_list = None
    if opts.get("dp_epsilons") is not None:
        try:
            eps_list = [float(x) for x in items("--dp-epsilons", opts["dp_epsilons"])]
        except ValueError:
            _fail(
                f"--dp-epsilons must be a comma list of numbers or inf, got {opts['dp_epsilons']!r}"
            )
        if any(not e > 0 for e in eps_list):
            _fail(f"--dp-epsilons must all be > 0 (inf: no DP), got {opts['dp_epsilons']!r}")
    if report is not None and len(steps_list) < 2 and not eps_list:
        _fail(
            "--report writes the study over several --local-steps or --dp-epsilons; "
            "give at least two local steps, or --dp-epsilons"
        )
    cfg, errs = validate_mapping(
        dict(
            model=opts["model"],
            task=opts["task"],
            methods=opts["method"],
            rounds=opts["rounds"],
            local_steps=steps_list[0],
            batch_size=opts["batch_size"],
            lr=opts["lr"],
            lora_alpha=opts["lora_alpha"],
            max_length=opts["max_length"],
            max_test=opts["max_test"],
            min_partition_size=opts["min_partition_size"],
            **{
                k: opts[k]
                for k in ("dp_delta", "dp_max_grad_norm", "fedsb_rank", "fedsb_init", "max_train")
                if opts.get(k) is not None
            },
        )
    )
    if errs:
        _fail(str(ConfigError(errs)))
    command = ["fedexlora compare"] + [f"--study {study}"] * (study is not None)
    command += [f"--out {out}"] + [f"--report {report}"] * (report is not None)
    command += [f"--{k.replace('_', '-')} {v}" for k, v in given.items() if v is not None] + [
        "--full-test"
    ] * full_test
    try:
        path = run_grid(
            cfg,
            out,
            command=" ".join(command),
            settings=parsed,
            ranks=rank_list,
            seeds=seed_list,
            local_steps=steps_list if len(steps_list) > 1 else None,
            total_steps=opts["total_steps"],
            epsilons=eps_list,
            report=report,
            console=console,
        )
    except ValueError as exc:
        _fail(str(exc))
    console.print(path.read_text())
    console.print(f"wrote {path}")


def main() -> None:  # pragma: no cover
    """Entry point for ``python -m fedexlora``."""
    app(prog_name="fedexlora")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
