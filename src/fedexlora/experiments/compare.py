"""``fedexlora compare``: a grid of methods x settings x seeds on identical partitions.

This module plans and runs the grid (which cell reruns, resumes or is reused); its
reports are in :mod:`fedexlora.experiments.compare_report`, their plots in
:mod:`fedexlora.experiments.compare_plots`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import MISSING, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedexlora.config import ADDED_LATER, RESUME_SAFE, RunConfig, load_run_config
from fedexlora.core.methods import REGISTRY
from fedexlora.experiments.cells import Cell, Setting
from fedexlora.experiments.compare_plots import plot_comparison, plot_gap
from fedexlora.experiments.compare_report import _aggregate, comparison_table, exactness_report
from fedexlora.experiments.privacy_report import plot_privacy, privacy_report
from fedexlora.run.layout import RunLayout
from fedexlora.run.report import intact_rows
from fedexlora.run.stopping import RULE, cell_done, until_stop

__all__ = [
    "DEFAULT_SETTINGS",
    "cell_changes",
    "comparison_table",
    "exactness_report",
    "run_grid",
]


DEFAULT_SETTINGS = (
    Setting("iid-3", 3, "iid"),
    Setting("dir0.1-5", 5, "dirichlet", 0.1),
)


# A cell that differs only in settings that never change results is reused; ``rounds``
# is handled apart (a shorter finished cell is extended by a resume), and so is
# ``methods``: a method's rows do not depend on the others beside it (each starts from
# the seed's model, partitions and data order; fp32_side_branch, which follows the
# methods, is compared as this grid resolves it, but for a grid of methods without a
# residual that leaves it unset), so a cell gains a method by a resume
# that runs only that one, and a grid of fewer methods reads, extends or resumes only
# its own in a larger cell (the others' rows are kept).
_NOT_RESULTS = set(RESUME_SAFE) | {"methods"}


def cell_changes(old: dict, new: RunConfig) -> list[str]:
    """What differs between a cell's saved config (``old``) and the config it needs.

    A setting missing from ``old`` (added to fedex-lora since) counts as its default.
    Returns one ``name: old → new`` string per difference, ``rounds`` included when the
    saved cell ran more rounds than asked (fewer rounds are extended by a resume).
    """
    changes = []
    # No row of a method without a residual (FedIT's kind: its server step returns none,
    # so no side branch is ever built) depends on fp32_side_branch: a grid of those alone
    # that leaves it unset reads their rows in a cell run beside an exact method, where
    # it resolved on (and a resume of theirs takes the cell's value: Run.open)
    plain = not new.methods_where(lambda s: s.keeps_residual, unknown=True)
    follows = plain and new.fp32_side_branch is None
    new = new.resolved()  # as the cell would run, and wrote its config.toml
    for f in fields(RunConfig):
        if f.name in _NOT_RESULTS or (follows and f.name == "fp32_side_branch"):
            continue
        default = f.default if f.default_factory is MISSING else f.default_factory()
        default = ADDED_LATER.get(f.name, default)  # what a cell from before it ran with
        was = old.get(f.name, default)
        now = getattr(new, f.name)
        if f.name == "weighting":  # unset: each method's own (a cell of before it was unset)
            was, now = (_weightings(w, new.methods) for w in (was, now))
        if was != now and not (_num(was) and _num(now) and float(was) == float(now)):
            changes.append(f"{f.name}: {was!r} → {now!r}")
    if old.get("rounds", 0) > new.rounds:
        changes.append(f"rounds: {old['rounds']} → {new.rounds}")
    return changes


def _weightings(weighting: str | None, methods: list[str]) -> tuple[str, ...]:
    """Each method's weighting under ``weighting`` (``None``: the method's own)."""
    return tuple(
        weighting or (REGISTRY[m].weighting if m in REGISTRY else "examples") for m in methods
    )


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plan(
    base: RunConfig, settings, ranks, seeds, local_steps, total_steps, epsilons=None
) -> list[tuple[Cell, RunConfig]]:
    """Every cell of the grid with its validated configuration."""
    steps_axis: list[int | None] = list(local_steps) if local_steps else [None]
    eps_axis: list[float | None] = [float(e) for e in epsilons] if epsilons else [None]
    if any(e is not None and not e > 0 for e in eps_axis):
        raise ValueError(f"--dp-epsilons must be > 0 (inf: no DP), got {epsilons}")
    axes = {"--settings": [s.name for s in settings], "--ranks": ranks, "--seeds": seeds,
            "--local-steps": local_steps or [], "--dp-epsilons": epsilons or []}  # fmt: skip
    for flag, axis in axes.items():
        twice = [str(x) for x in dict.fromkeys(axis) if list(axis).count(x) > 1]
        if twice:  # a cell twice: its second run would find the first one's directory
            raise ValueError(f"{flag} lists {', '.join(twice)} more than once; list each once")
    if total_steps is not None:
        if base.local_steps is None and not local_steps:
            raise ValueError("--total-steps needs --local-steps (the rounds are their quotient)")
        bad = [s for s in steps_axis if s is not None and (s < 1 or total_steps % s)]
        if None in steps_axis and total_steps % base.local_steps:
            bad.append(base.local_steps)
        if bad:
            raise ValueError(
                f"--total-steps {total_steps} must be a multiple of every --local-steps value "
                f"(not of {', '.join(str(b) for b in bad)}), so that every cell trains as "
                "many local steps in all"
            )
    methods = list(base.methods)
    # the pooled, one-party references (centralized): a ceiling once per client count
    pooled = list(dict.fromkeys(m for m in methods if m in REGISTRY and not REGISTRY[m].federated))
    ceiling = total_steps is not None and bool(pooled)
    fed_methods = [m for m in methods if m not in pooled] if ceiling else methods
    if not fed_methods:
        raise ValueError("the grid needs a federated method besides centralized")
    plan = []
    for s in settings:
        for r in ranks:
            for st in steps_axis:
                for seed in seeds:
                    for eps in eps_axis:
                        changes = dict(
                            num_clients=s.num_clients,
                            partition=s.partition,
                            alpha=s.alpha,
                            lora_r=r,
                            seed=seed,
                            methods=fed_methods,
                        )
                        if st is not None:
                            changes["local_steps"] = st
                        if total_steps is not None:
                            changes["rounds"] = total_steps // (st or base.local_steps)
                        if eps is not None:
                            changes["dp_epsilon"] = None if math.isinf(eps) else eps
                        cell = Cell(s, r, st, seed, epsilon=eps)
                        plan.append((cell, base.replace(**changes).validate()))
    # centralized once per client count: all clients' steps in one round
    for ref in pooled if ceiling else []:
        for k in sorted({s.num_clients for s in settings}):
            s = Setting(f"{ref}-{k}", k, "iid")
            for r in ranks:
                for seed in seeds:
                    cfg = base.replace(
                        num_clients=k,
                        partition="iid",
                        lora_r=r,
                        seed=seed,
                        methods=[ref],
                        local_steps=total_steps,
                        rounds=1,
                    ).validate()
                    plan.append((Cell(s, r, None, seed, ceiling=True), cfg))
    return plan


def run_grid(
    base: RunConfig,
    out: str | Path,
    *,
    settings=DEFAULT_SETTINGS,
    ranks=(1, 4),
    seeds=(0, 1, 2),
    local_steps=None,
    total_steps: int | None = None,
    epsilons=None,
    report: str | Path | None = None,
    command: str | None = None,
    progress: bool = False,
    console=None,
    target: float | None = None,
    target_fraction: float = 0.9,
    train: bool = True,
) -> Path:
    """Runs every cell of the grid with all of ``base.methods`` and reports.

    Each cell is a normal run directory (``fedexlora run``). A finished cell is reused
    only when its saved configuration matches the one it needs (apart from settings that
    do not change results, see :func:`cell_changes`); a shorter one is extended, an
    interrupted one resumes, and any other is moved aside to ``<cell>.replaced-N`` and
    rerun, with the reason printed. Within a cell, every method sees the same partitions,
    initial adapters and data order.

    Args:
        base: The configuration every cell starts from.
        out: The grid's directory.
        settings: The federation settings (an axis).
        ranks: LoRA ranks (an axis).
        seeds: Seeds (an axis).
        local_steps: Optional list of local steps per round: an axis of its own.
        total_steps: Local steps per client in all. Each cell then runs
            ``total_steps // local_steps`` rounds, so every cell costs the same, and
            ``centralized`` runs once per client count (the ceiling) instead of per cell.
        epsilons: Optional DP budgets per client (``inf``: no DP): an axis of its own,
            reported in ``privacy.md`` (accuracy against epsilon, paired differences).
        report: Where to also write the study report (with ``local_steps`` or
            ``epsilons``).
        command: The command line, quoted in the study report.
        progress: Progress bars.
        console: A ``rich`` console.
        target: The primary metric's value for the "bytes to target" column (``None``:
            ``target_fraction`` of centralized's in the same table).
        target_fraction: See ``target``.
        train: ``False``: train nothing, and write the report only when every cell has
            finished (a report never quotes an unfinished cell).

    Returns:
        The path of ``comparison.md``.

    Raises:
        ValueError: If ``train`` is ``False`` and a cell has not finished (each is named,
            with what it lacks).
    """
    from fedexlora.run.inprocess import run_experiment

    say = console.print if console is not None else print
    out = Path(out)
    plan = _plan(base, settings, ranks, seeds, local_steps, total_steps, epsilons)
    if not plan:
        raise ValueError("the grid is empty: give at least one setting, rank and seed")
    # each cell's state, read once: what the loop below does with it, or why it cannot
    status = {cell: _status(out / cell.dirname(), cfg) for cell, cfg in plan}
    if not train:
        unfinished = [
            f"{cell.dirname()} ({why or action})"
            for cell, (action, why) in status.items()
            if action != "done"
        ]
        if unfinished:
            raise ValueError(
                f"--report-only: {len(unfinished)} of {len(plan)} cells in {out} have not "
                f"finished: {'; '.join(unfinished)}. Run the same command without "
                "--report-only to train them"
            )
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reused = 0
    # Seed by seed: an interrupted grid has every cell for its first seeds.
    for i, (cell, cfg) in enumerate(sorted(plan, key=lambda p: p[0].seed), 1):
        d = out / cell.dirname()
        action, why = status[cell]
        label = f"[{i}/{len(plan)}] {cell.dirname()}"
        if action == "done":
            reused += 1
            say(f"{label} (done)")
            continue
        if action == "replace":
            n = 1
            while d.with_name(f"{d.name}.replaced-{n}").exists():
                n += 1
            aside = d.with_name(f"{d.name}.replaced-{n}")
            d.rename(aside)
            say(f"{label}: rerun, its settings changed ({why}); the old run is in {aside}")
        elif action == "resume":
            say(f"{label}: {why}")
        else:
            say(label)
        # a resumed cell's config.toml then records the rounds run and, beside this
        # invocation's methods, every method it holds rows of (fedexlora.run.lifecycle)
        run_experiment(cfg, d, resume=action == "resume", progress=progress, console=console)
    elapsed = time.perf_counter() - t0
    # each method's rows up to where this invocation's stopping rule stops it
    rows = {cell: until_stop(cfg, _rows_of(cfg, out / cell.dirname())) for cell, cfg in plan}
    # as each cell ran, with this grid's methods (a cell may hold more) and this
    # invocation's stopping rule, which cut the rows above
    cfgs = {
        cell: _saved_config(out / cell.dirname()).replace(
            methods=cfg.methods, **{k: getattr(cfg, k) for k in RULE}
        )
        for cell, cfg in plan
    }
    md = comparison_table(
        rows, cfgs, elapsed, reused=reused, target=target, target_fraction=target_fraction
    )
    path = out / "comparison.md"
    path.write_text(md)
    plot_comparison(rows, out / "comparison.png")
    (out / "comparison.json").write_text(json.dumps(_aggregate(rows), indent=1))
    studies = [("exactness.md", exactness_report, plot_gap)] if local_steps else []
    if epsilons:  # the private comparison (with a local-steps axis too: beside it)
        report = None if studies else report
        studies.append(("privacy.md", privacy_report, plot_privacy))
    for name, write, plot in studies:
        target = Path(report) if report else out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        png = target.with_suffix(".png")
        target.write_text(write(rows, cfgs, png.name, elapsed, reused, command))
        plot(rows, png)
        say(f"wrote {target}")
    return path


def _rows_of(cfg: RunConfig, d: Path) -> list[dict]:
    """The cell's rows of ``cfg``'s methods (the cell may hold more)."""
    return [r for r in intact_rows(RunLayout(d).metrics) if r["method"] in cfg.methods]


def _saved_config(d: Path) -> RunConfig:
    return load_run_config(RunLayout(d).config)  # a cell from before: as it ran


def _status(d: Path, cfg: RunConfig) -> tuple[str, str]:
    """``new``, ``done``, ``resume`` or ``replace``, and why."""
    toml = RunLayout(d).config
    if not toml.is_file():
        return ("replace", "it holds no config.toml") if d.exists() else ("new", "")
    try:
        old = tomllib.loads(toml.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return "replace", f"its config.toml is unreadable: {exc}"
    # a default that follows the methods (fp32_side_branch: on where one is exact) is
    # resolved for this grid's methods, as a new cell of the grid would run: a cell that
    # ran otherwise is rerun, so that no table mixes the two (a grid of methods without
    # a residual ignores the side branch's settings: their rows do not depend on them)
    changes = cell_changes(old, cfg)
    if changes:
        return "replace", "; ".join(changes)
    metrics = RunLayout(d).metrics
    rows = _rows_of(cfg, d) if metrics.is_file() else []
    n = len(rows)
    if cell_done(cfg, rows):  # every round of every method, or stopped by the rule
        return "done", ""
    why = []
    gained = [m for m in cfg.methods if m not in old.get("methods", [])]
    if gained:
        why.append(f"gains {', '.join(gained)}")
    if old.get("rounds") != cfg.rounds:
        why.append(f"extended from {old.get('rounds')} to {cfg.rounds} rounds")
    if why:
        return "resume", "; ".join(why)
    said = f"resumed ({n} of {len(cfg.methods) * cfg.rounds} rows done)"
    # a cell whose methods stopped under another rule goes on under this one (the rule
    # changes no row; a method without a checkpoint to resume from runs from round 1)
    rule = [f"{k} {old.get(k)} → {getattr(cfg, k)}" for k in RULE if old.get(k) != getattr(cfg, k)]
    return "resume", said + (f"; its stopping rule changed ({', '.join(rule)})" if rule else "")
