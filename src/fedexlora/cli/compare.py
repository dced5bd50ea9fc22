"""``fedexlora compare``: a grid of methods x settings x ranks x seeds on identical partitions."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

from fedexlora.cli._common import console, fail, quiet_libraries, write_error
from fedexlora.cli.options import command, config_params, in_flags, option
from fedexlora.config import FLAGS
from fedexlora.run.stopping import RULE

__all__ = ["compare_cmd"]

_COMPARE_DEFAULTS = dict(
    model="minilm",
    task="bbc-news",
    methods="fedex,fedit,ffa,flora,centralized",
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
LLM_MODULES = (
    "arithmetic__add_or_sub",
    "arithmetic__mul",
    "comparison__pair",
    "comparison__kth_biggest",
    "numbers__gcd",
    "numbers__is_prime",
    "numbers__round_number",
    "numbers__place_value",
)
"""``--study llm``'s modules: 8 with short exact answers, two per client at ``group-4``."""
# The "when exactness matters" study (docs/WHEN_EXACTNESS_MATTERS.md): local steps per
# round x heterogeneity x clients at a fixed total of local steps per client.
_STUDIES = {
    "exactness": dict(
        methods="fedex,fedit,centralized",
        ranks="4",
        seeds="0,1,2,3,4",
        settings="iid-3,dir1.0-3,dir0.1-3,iid-10,dir1.0-10,dir0.1-10",
        local_steps="4,12,24",
        total_steps=24,
        batch_size=4,
        lr=5e-3,
        max_test=None,
    ),
    # Every method to convergence (issue #58): each stops after 3 rounds without a new best,
    # not before round 10 (at most 30 rounds, the same rule and budget for all), the whole
    # test split, and bytes to reach 0.9 of centralized LoRA's accuracy.
    "convergence": dict(
        methods="fedex,fedit,ffa,flora,fedsb,flexlora,fedsvd,lorafair,rolora,hetlora,fedsa,"
        "frlora,centralized",
        ranks="4",
        seeds="0,1,2",
        settings="iid-3,dir0.5-3,dir0.1-10",
        rounds=30,
        stop_patience=3,
        stop_min_rounds=10,
        local_steps="12",
        max_test=None,
    ),
    # The LLM study (issue #58 item 3): SmolLM2-135M on DeepMind's mathematics questions,
    # clients by module (non-IID by topic), LoRA on every attention and MLP projection,
    # exact match on a held-out set of its own seed; the convergence study's stopping rule.
    "llm": dict(
        model="smollm2-135m",
        task="deepmind-math:" + ",".join(LLM_MODULES),
        methods="fedex,fedit,ffa,flora,fedsvd,frlora,fedsb,centralized",
        ranks="8",
        seeds="0,1,2",
        settings="group-4",
        rounds=30,
        stop_patience=3,
        stop_min_rounds=10,
        stop_metric="loss",  # 80 questions' exact match moves by noise from round to round
        local_steps="8",
        batch_size=8,
        lr=1e-3,
        lora_alpha=16.0,
        max_length=96,
        max_train=400,
        max_test=80,
        max_new_tokens=12,
        min_partition_size=8,
    ),
    # The private comparison (docs/PRIVACY.md): accuracy against epsilon, 4 methods.
    "privacy": dict(
        methods="fedex,fedit,ffa,fedsb",
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


STOPPING = ("rounds", *RULE)
"""A study's budget and stopping rule (all resume-safe: they change no row)."""


def study_rule(study: str) -> dict:
    """The stopping rule and budget of preset grid ``study``, as config fields.

    Raises:
        KeyError: If there is no such study.
    """
    return {k: v for k, v in _STUDIES[study].items() if k in STOPPING}


# The panels of `fedexlora compare --help`, in the order they are shown.
STUDY = "Study and output"
GRID = "Grid axes"
DATA = "Model and data"
TRAINING = "Training"
PRIVACY = "Privacy and Fed-SB"
_CONFIG_PANELS = {
    DATA: (
        "model",
        "task",
        "max_length",
        "max_train",
        "max_test",
        "max_new_tokens",
        "min_partition_size",
        "device",
    ),
    TRAINING: (
        "rounds",
        "stop_patience",
        "stop_min_rounds",
        "stop_at",
        "stop_metric",
        "batch_size",
        "lr",
        "lora_alpha",
        "weighting",
    ),
    PRIVACY: ("dp_delta", "dp_max_grad_norm", "fedsb_rank", "fedsb_init"),
}
"""The config fields ``compare`` offers, by panel: their options are the run's
(:mod:`fedexlora.cli.options`), with the grid's defaults."""


def _params() -> list[inspect.Parameter]:
    def fields(panel: str) -> list[inspect.Parameter]:
        return config_params(_CONFIG_PANELS[panel], defaults=_COMPARE_DEFAULTS, panel=panel)

    return [
        option(
            "A preset grid: 'exactness' (local steps x heterogeneity x clients), 'privacy' "
            "(methods x epsilon, docs/PRIVACY.md), 'convergence' (every method until it "
            "stops improving, docs/METHODS.md) or 'llm' (SmolLM2-135M on deepmind-math, "
            "clients by module, docs/LARGE_MODELS.md)",
            "--study",
            panel=STUDY,
        ),
        option(
            "Directory of the grid",
            "--out",
            panel=STUDY,
            default=Path("runs/compare"),
            default_text="runs/compare",
            kind=Path,
        ),
        option(
            "The primary metric's value whose bytes comparison.md gives per method "
            "('bytes to target')",
            "--target",
            panel=STUDY,
            default_text="--target-fraction of centralized's",
            kind=float,
        ),
        option(
            "The fraction of centralized's final metric used as the target",
            "--target-fraction",
            panel=STUDY,
            default=0.9,
            default_text="0.9",
            kind=float,
        ),
        option(
            "Train nothing: write the report from the cells already finished, or name "
            "those that have not (and exit with an error)",
            "--report-only",
            panel=STUDY,
            default=False,
            default_text="off",
            kind=bool,
        ),
        option(
            "Also write the study report here (with several --local-steps or --dp-epsilons)",
            "--report",
            panel=STUDY,
            kind=Path,
        ),
        *config_params(["methods"], defaults=_COMPARE_DEFAULTS, panel=GRID),
        option("Comma list of LoRA ranks", "--ranks", panel=GRID, default_text="1,4"),
        option("Comma list of seeds", "--seeds", panel=GRID, default_text="0,1,2"),
        option(
            "Comma list of iid-K, dirA-K or group-K: K clients, Dirichlet alpha A, or "
            "whole groups (a task's modules) dealt to K clients",
            "--settings",
            panel=GRID,
            default_text="iid-3,dir0.1-5",
        ),
        option(
            "Local steps per client and round; a comma list is an axis",
            "--local-steps",
            panel=GRID,
            default_text="12",
        ),
        option(
            "Local steps per client in all: each cell runs total/steps rounds, and "
            "centralized runs once per client count",
            "--total-steps",
            panel=GRID,
            default_text="off",
            kind=int,
        ),
        option(
            "Comma list of DP budgets per client, inf for none (e.g. 1,3,8,inf): an axis, "
            "reported in privacy.md or --report",
            "--dp-epsilons",
            panel=GRID,
            default_text="no DP",
        ),
        *fields(DATA),
        option(
            "Evaluate on the whole test split instead of --max-test",
            "--full-test",
            panel=DATA,
            default=False,
            default_text="off",
            kind=bool,
        ),
        *fields(TRAINING),
        *fields(PRIVACY),
    ]


@command(_params())
def compare_cmd(**given) -> None:
    """Grid of methods x settings x ranks x seeds on identical partitions -> comparison.md.

    The defaults are sized to finish in about 45 minutes on 2 idle CPU cores: 5 rounds of
    12 local steps (60 steps per client in all), 32 tokens per article, 200 test articles.
    `--study exactness` runs the "when exactness matters" study instead (see
    docs/WHEN_EXACTNESS_MATTERS.md); flags given with it override its values.
    """
    quiet_libraries()
    from fedexlora.config import ConfigError, validate_mapping
    from fedexlora.experiments.cells import Setting
    from fedexlora.experiments.compare import run_grid
    from fedexlora.training.privacy import DPCheckError

    study, out, report = given.pop("study"), given.pop("out"), given.pop("report")
    report_only = given.pop("report_only")
    target, fraction = given.pop("target"), given.pop("target_fraction")
    if not 0 < fraction <= 1:
        fail(f"--target-fraction must be in (0, 1], got {fraction}")
    if target is not None and not math.isfinite(target):
        fail(f"--target must be a finite number, got {target}")
    full_test, max_test = given.pop("full_test"), given["max_test"]
    if study is not None and study not in _STUDIES:
        fail(f"--study: unknown study {study!r}; choose from {', '.join(_STUDIES)}")
    opts = {**_COMPARE_DEFAULTS, **_STUDIES.get(study or "", {})}
    opts.update({k: v for k, v in given.items() if v is not None})
    if full_test:
        if max_test is not None:
            fail("--full-test and --max-test contradict each other: give one")
        opts["max_test"] = None

    def items(flag: str, value: str) -> list[str]:
        out = [x.strip() for x in value.split(",") if x.strip()]
        if not out:
            fail(f"{flag} is empty (got {value!r})")
        return out

    def ints(flag: str, value: str) -> list[int]:
        try:
            return [int(x) for x in items(flag, value)]
        except ValueError:
            fail(f"{flag} must be a comma list of integers, got {value!r}")

    parsed = []
    for s in items("--settings", opts["settings"]):
        kind, _, k = s.rpartition("-")
        try:
            if kind == "iid":
                parsed.append(Setting(s, int(k), "iid"))
            elif kind == "group":
                parsed.append(Setting(s, int(k), "group"))
            elif kind.startswith("dir"):
                parsed.append(Setting(s, int(k), "dirichlet", float(kind[3:])))
            else:
                raise ValueError(s)
        except ValueError:
            fail(
                f"--settings: cannot parse {s!r}; use iid-K, dirA-K or group-K (K clients, "
                "Dirichlet alpha A, whole groups per client), e.g. iid-3,dir0.1-5"
            )
    for s in parsed:
        if s.num_clients < 1:
            fail(f"--settings: {s.name!r} has {s.num_clients} clients; K must be >= 1")
        if s.partition == "dirichlet" and not (math.isfinite(s.alpha) and s.alpha > 0):
            fail(f"--settings: {s.name!r} has Dirichlet alpha {s.alpha}; A must be > 0")
    rank_list = ints("--ranks", opts["ranks"])
    if any(r < 1 for r in rank_list):
        fail(f"--ranks must all be >= 1, got {opts['ranks']!r}")
    seed_list = ints("--seeds", opts["seeds"])
    steps_list = ints("--local-steps", opts["local_steps"])
    if any(x < 1 for x in steps_list):
        fail(f"--local-steps must be >= 1, got {opts['local_steps']!r}")
    if opts["total_steps"] is not None and opts["total_steps"] < 1:
        fail(f"--total-steps must be >= 1, got {opts['total_steps']}")
    eps_list = None
    if opts.get("dp_epsilons") is not None:
        try:
            eps_list = [float(x) for x in items("--dp-epsilons", opts["dp_epsilons"])]
        except ValueError:
            fail(
                f"--dp-epsilons must be a comma list of numbers or inf, got {opts['dp_epsilons']!r}"
            )
        if any(not e > 0 for e in eps_list):
            fail(f"--dp-epsilons must all be > 0 (inf: no DP), got {opts['dp_epsilons']!r}")
    if report is not None and len(steps_list) < 2 and not eps_list:
        fail(
            "--report writes the study over several --local-steps or --dp-epsilons; "
            "give at least two local steps, or --dp-epsilons"
        )
    offered = ["methods", *(k for keys in _CONFIG_PANELS.values() for k in keys)]
    mapping = {k: opts[k] for k in offered if opts.get(k) is not None}
    cfg, errs = validate_mapping({**mapping, "local_steps": steps_list[0]})
    if errs:
        typed = {k: v for k, v in given.items() if v is not None}
        fail(str(in_flags(ConfigError(errs), typed)))
    _check_paths(cfg, out, report, rows_only=report_only)
    command = ["fedexlora compare"] + [f"--study {study}"] * (study is not None)
    command += [f"--target {target}"] * (target is not None)
    command += [f"--out {out}"] + [f"--report {report}"] * (report is not None)
    flag = {**FLAGS, **{k: "--" + k.replace("_", "-") for k in given if k not in FLAGS}}
    command += [f"{flag[k]} {v}" for k, v in given.items() if v is not None] + [
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
            target=target,
            target_fraction=fraction,
            train=not report_only,
        )
    except (ValueError, DPCheckError) as exc:
        fail(str(exc))
    except OSError as exc:  # a disk full or read-only mid-grid: cells resume
        why = write_error(exc, "the same fedexlora compare command")
        if why is None:
            raise
        fail(why, code=1)
    console.print(path.read_text())
    console.print(f"wrote {path}")


def _check_paths(cfg, out: Path, report: Path | None, rows_only: bool = False) -> None:
    """``--out``, ``--report`` and the task, checked before the grid writes or trains.

    ``rows_only`` (``--report-only``): the report needs the cells' rows alone, so neither
    the model, the data nor the device is checked (a grid trained on another machine,
    with its GPU or its data, is reported here), only where the report goes.
    """
    from fedexlora.run.export import output_dir_error
    from fedexlora.run.layout import RunError, RunLayout
    from fedexlora.run.preflight import check_inputs

    if rows_only:
        problem = output_dir_error(Path(out))
        if problem is not None:
            fail(f"--out {str(out)!r}: {problem}")
    else:
        if RunLayout(out).holds_run():  # a grid holds its cells' runs in subdirectories
            fail(
                f"--out {str(out)!r} holds a run of `fedexlora run`, not a compare grid; "
                "choose another directory"
            )
        try:  # --out may hold an earlier grid, whose cells are reused
            check_inputs(cfg, out)
        except RunError as exc:
            fail(str(exc))
    if report is not None:
        if Path(report).is_dir():
            fail(f"--report {str(report)!r} is a directory; give a file such as study.md")
        problem = output_dir_error(Path(report).parent)
        if problem is not None:
            fail(f"--report {str(report)!r}: its directory {problem}")
