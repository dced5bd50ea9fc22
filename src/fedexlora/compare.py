"""``fedexlora compare``: a grid of methods x settings x seeds on identical partitions."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .config import RunConfig
from .pipeline import run_experiment
from .report import best_value, higher_is_better, primary_metric, read_metrics

__all__ = ["DEFAULT_SETTINGS", "Setting", "comparison_table", "run_grid"]


@dataclass(frozen=True)
class Setting:
    """One federation setting of the grid.

    Attributes:
        name: Label used in tables, e.g. ``iid-3``.
        num_clients: Clients.
        partition: ``iid`` or ``dirichlet``.
        alpha: Dirichlet concentration.
    """

    name: str
    num_clients: int
    partition: str
    alpha: float = 0.5


DEFAULT_SETTINGS = (
    Setting("iid-3", 3, "iid"),
    Setting("dir0.1-5", 5, "dirichlet", 0.1),
)


def _cell_dir(out: Path, setting: Setting, rank: int, seed: int) -> Path:
    return out / f"{setting.name}_r{rank}_seed{seed}"


def run_grid(
    base: RunConfig,
    out: str | Path,
    *,
    settings=DEFAULT_SETTINGS,
    ranks=(1, 4),
    seeds=(0, 1, 2),
    progress: bool = False,
    console=None,
) -> Path:
    """Runs every (setting, rank, seed) cell with all of ``base.methods`` and reports.

    Each cell is a normal run directory (``fedexlora run``), so a cell that already
    finished is reused and an interrupted one resumes. Within a cell, every method sees
    the same partitions, initial adapters and data order.

    Returns:
        The path of ``comparison.md``.
    """
    say = console.print if console is not None else print
    out = Path(out)
    cells = [(s, r, seed) for s in settings for r in ranks for seed in seeds]
    if not cells:
        raise ValueError("the grid is empty: give at least one setting, rank and seed")
    # Every cell's config is checked before the first one runs.
    cfgs = [
        base.replace(
            num_clients=s.num_clients, partition=s.partition, alpha=s.alpha, lora_r=r, seed=seed
        ).validate()
        for s, r, seed in cells
    ]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reused = 0
    for i, ((s, r, seed), cfg) in enumerate(zip(cells, cfgs), 1):
        d = _cell_dir(out, s, r, seed)
        done = (d / "metrics.jsonl").exists() and len(read_metrics(d / "metrics.jsonl")) == len(
            cfg.methods
        ) * cfg.rounds
        say(f"[{i}/{len(cells)}] {s.name} r={r} seed={seed}" + (" (done)" if done else ""))
        reused += done
        if not done:
            run_experiment(
                cfg, d, resume=(d / "config.toml").exists(), progress=progress, console=console
            )
    elapsed = time.perf_counter() - t0
    rows = {c: read_metrics(_cell_dir(out, *c) / "metrics.jsonl") for c in cells}
    md = comparison_table(rows, base, settings, ranks, seeds, elapsed, reused=reused)
    path = out / "comparison.md"
    path.write_text(md)
    _plot(rows, settings, ranks, out / "comparison.png")
    (out / "comparison.json").write_text(json.dumps(_aggregate(rows), indent=1))
    return path


def _aggregate(rows: dict) -> dict:
    """Per (setting, rank, method): lists over seeds of final/best metric, bytes, deviation."""
    agg: dict = defaultdict(lambda: defaultdict(list))
    for (s, r, _seed), rs in rows.items():
        metric = primary_metric(rs)
        by_method = defaultdict(list)
        for row in rs:
            by_method[row["method"]].append(row)
        for m, mrs in by_method.items():
            key = f"{s.name}|r{r}|{m}"
            vals = [x["metrics"][metric] for x in mrs]
            agg[key]["metric"].append(metric)
            agg[key]["final"].append(vals[-1])
            agg[key]["best"].append(best_value(metric, vals))
            agg[key]["bytes"].append(sum(x["bytes_up"] + x["bytes_down"] for x in mrs))
            agg[key]["deviation"].append(statistics.fmean(x["deviation"]["mean"] for x in mrs))
            agg[key]["effective"].append(max(x["effective_deviation"]["max"] for x in mrs))
    return {k: dict(v) for k, v in agg.items()}


def _ms(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}"


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def _paired(agg: dict, key: str, a: str, b: str, metric: str) -> str | None:
    """``a − b`` of the final metric, paired by seed (same partitions and start), mean ± std.

    "Ahead" means better: higher, or lower for a loss or perplexity.
    """
    xa, xb = agg.get(f"{key}|{a}"), agg.get(f"{key}|{b}")
    if xa is None or xb is None:
        return None
    diffs = [u - v for u, v in zip(xa["final"], xb["final"])]
    sign = 1 if higher_is_better(metric) else -1
    wins = sum(sign * d > 0 for d in diffs)
    ties = sum(d == 0 for d in diffs)
    plus = "+" if statistics.fmean(diffs) >= 0 else ""
    return (
        f"{a} − {b}, final metric paired by seed: {plus}{_ms(diffs)} "
        f"({wins} ahead, {ties} tied, {len(diffs) - wins - ties} behind)"
    )


def comparison_table(
    rows, base: RunConfig, settings, ranks, seeds, elapsed: float, reused: int = 0
) -> str:
    """Markdown: one table per (setting, rank), mean ± std over seeds per method."""
    agg = _aggregate(rows)
    metric = primary_metric(next(iter(rows.values())))
    compute = sum(x["seconds"] for rs in rows.values() for x in rs)
    steps = (
        f"{base.rounds * base.local_steps} local steps per client in all"
        if base.local_steps
        else f"{base.rounds * base.local_epochs:g} local epochs per client in all"
    )
    lines = [
        "# fedex-lora comparison",
        "",
        f"Task `{base.task}`, model `{base.model}`; methods {', '.join(base.methods)}; "
        f"seeds {list(seeds)}; {base.rounds} rounds of "
        + (
            f"{base.local_steps} local steps"
            if base.local_steps
            else f"{base.local_epochs} local epochs"
        )
        + f" (batch {base.batch_size}, lr {base.lr}, max_length {base.max_length}"
        + (f", {base.max_train} train examples" if base.max_train else "")
        + (f", {base.max_test} test examples" if base.max_test else "")
        + "). `centralized` trains on the pooled data with as many steps per round as all "
        "clients together. Within a (setting, rank, seed) cell every method sees the same "
        "partitions, initial adapters and data order.",
        "",
        f"Sizing: {len(rows)} runs of {len(base.methods)} methods, {steps}. "
        f"Time in the rounds, summed over every run: {compute / 60:.1f} min; "
        f"wall time of this invocation: {elapsed / 60:.1f} min"
        + (f" ({reused} of {len(rows)} runs reused from an earlier invocation)" if reused else "")
        + ".",
        "",
    ]
    for s in settings:
        for r in ranks:
            lines += [
                f"## {s.name} ({s.num_clients} clients, {s.partition}"
                + (f" α={s.alpha}" if s.partition == "dirichlet" else "")
                + f"), r={r}",
                "",
                f"| method | final {metric} | best {metric} | total bytes | mean deviation "
                "| max effective deviation |",
                "|---|---|---|---|---|---|",
            ]
            for m in base.methods:
                a = agg.get(f"{s.name}|r{r}|{m}")
                if a is None:
                    continue
                lines.append(
                    f"| {m} | {_ms(a['final'])} | {_ms(a['best'])} | "
                    f"{_mb(statistics.fmean(a['bytes']))} | "
                    f"{statistics.fmean(a['deviation']):.3g} | {max(a['effective']):.2g} |"
                )
            lines.append("")
            paired = _paired(agg, f"{s.name}|r{r}", "fedex", "fedit", metric)
            if paired:
                lines += [paired, ""]
    lines += [
        "*deviation*: relative Frobenius deviation of the averaged-factor product from the "
        "ideal update, mean over layers and rounds (what FedIT loses). *effective "
        "deviation*: the same for the update actually applied.",
        "",
        "![final metric per method](comparison.png)",
        "",
    ]
    return "\n".join(lines)


def _plot(rows, settings, ranks, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = _aggregate(rows)
    panels = [(s, r) for s in settings for r in ranks]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (s, r) in zip(axes[0], panels):
        keys = [k for k in agg if k.startswith(f"{s.name}|r{r}|")]
        names = [k.rsplit("|", 1)[1] for k in keys]
        means = [statistics.fmean(agg[k]["final"]) for k in keys]
        stds = [
            statistics.stdev(agg[k]["final"]) if len(agg[k]["final"]) > 1 else 0.0 for k in keys
        ]
        ax.bar(names, means, yerr=stds, capsize=3)
        lo = min((m - sd for m, sd in zip(means, stds)), default=0.0)
        hi = max((m + sd for m, sd in zip(means, stds)), default=1.0)
        bottom = max(0.0, math.floor(lo * 10) / 10 - 0.05)
        ax.set_ylim(bottom, hi + 0.05 * max(hi - bottom, 1e-6))  # room for the error bars
        ax.set_title(f"{s.name}, r={r}")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
