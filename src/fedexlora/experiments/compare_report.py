"""The reports of ``fedexlora compare``: per-cell tables and the exactness study.

Their plots are :mod:`fedexlora.experiments.compare_plots`; the private comparison's
report is :mod:`fedexlora.experiments.privacy_report`.

Everything here reads finished cells (their metrics rows and configs); nothing runs.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import TYPE_CHECKING

from fedexlora.config import RunConfig
from fedexlora.core.methods import REGISTRY
from fedexlora.core.units import format_bytes
from fedexlora.experiments.per_seed import per_seed_lines, round_by_round
from fedexlora.experiments.stats import paired
from fedexlora.run.report import best_value, higher_is_better, primary_metric

if TYPE_CHECKING:
    from fedexlora.experiments.cells import Cell

__all__ = ["comparison_table", "exactness_report"]


# The methods measured against a baseline in reports, each with its baseline, in registry
# order: fedex against fedit. The exactness study is about the first pair.
_BASELINES = tuple((name, spec.baseline) for name, spec in REGISTRY.items() if spec.baseline)
_OURS, _BASE = _BASELINES[0]


def _key(cell: Cell, method: str) -> str:
    steps = "" if cell.steps is None else f"|s{cell.steps}"
    eps = "" if cell.epsilon is None else f"|eps{cell.epsilon:g}"
    return f"{cell.setting.name}|r{cell.rank}{steps}{eps}|{method}"


def _aggregate(rows: dict) -> dict:
    """Per (setting, rank, steps, method): lists over seeds of final/best metric, bytes..."""
    agg: dict = defaultdict(lambda: defaultdict(list))
    for cell, rs in sorted(rows.items(), key=lambda kv: kv[0].seed):
        metric = primary_metric(rs)
        by_method = defaultdict(list)
        for row in rs:
            by_method[row["method"]].append(row)
        for m, mrs in by_method.items():
            a = agg[_key(cell, m)]
            vals = [x["metrics"][metric] for x in mrs]
            a["seed"].append(cell.seed)
            a["metric"].append(metric)
            a["final"].append(vals[-1])
            # every metric's last and best value (a stopping rule may read another metric)
            a["last_metrics"].append(dict(mrs[-1]["metrics"]))
            a["best_metrics"].append(
                {k: best_value(k, [x["metrics"][k] for x in mrs]) for k in mrs[-1]["metrics"]}
            )
            a["best"].append(best_value(metric, vals))
            a["bytes"].append(sum(x["bytes_up"] + x["bytes_down"] for x in mrs))
            a["rounds"].append(len(mrs))
            a["curve"].append(_curve(mrs, metric))
            a["by_round"].append({x["round"]: x["metrics"][metric] for x in mrs})
            a["round_bytes"].append(statistics.fmean(x["bytes_up"] + x["bytes_down"] for x in mrs))
            # rows written before server_seconds existed have none
            secs = [x["server_seconds"] for x in mrs if x.get("server_seconds") is not None]
            a["server_seconds"].append(statistics.fmean(secs) if secs else float("nan"))
            devs = [x["deviation"]["mean"] for x in mrs]
            effs = [x["effective_deviation"]["max"] for x in mrs]
            # a personalized method (FedSA-LoRA) has no global model: no deviation (nan)
            nan = float("nan")
            a["deviation"].append(nan if None in devs else statistics.fmean(devs))
            a["effective"].append(nan if None in effs else max(effs))
            eff_means = [x["effective_deviation"].get("mean") for x in mrs]
            a["effective_mean"].append(nan if None in eff_means else statistics.fmean(eff_means))
            # what a client holds beside its base after the last round (side-branch runs)
            a["side_bytes"].append(mrs[-1].get("side_bytes"))
            a["adapter_bytes"].append(mrs[-1].get("adapter_bytes"))
    return {k: dict(v) for k, v in agg.items()}


def _curve(mrs: list[dict], metric: str) -> list[tuple[int, float]]:
    """Per round: the bytes sent up and down so far, and the metric after it."""
    out, total = [], 0
    for x in mrs:
        total += x["bytes_up"] + x["bytes_down"]
        out.append((total, x["metrics"][metric]))
    return out


def to_target(curve: list[tuple[int, float]], target: float, higher: bool = True) -> int | None:
    """Bytes sent until the metric first reached ``target``; ``None`` if it never did."""
    tol = 1e-9 * max(1.0, abs(target))  # 0.9 x 0.8 is 0.7200000000000001 in floats
    for sent, value in curve:
        if (value >= target - tol) if higher else (value <= target + tol):
            return sent
    return None


def _bytes_to_target(curves: list, target: float | None, higher: bool) -> str:
    """Mean bytes to the target over the seeds that reached it, and how many did."""
    if target is None:
        return "n/a"
    hits = [b for b in (to_target(c, target, higher) for c in curves) if b is not None]
    if not hits:
        return f"never (0/{len(curves)})"
    return f"{format_bytes(statistics.fmean(hits))} ({len(hits)}/{len(curves)})"


def _ci(xs: list[float]) -> str:
    """The 95% t interval of the mean over seeds."""
    if len(xs) < 2:
        return "n/a"
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    m = statistics.fmean(xs)
    return f"[{m - half:.4f}, {m + half:.4f}]"


def _ms_int(xs: list[int]) -> str:
    return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"


def _ms(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}"


def _pair(agg: dict, key: str, a: str, b: str, metric: str):
    """The paired ``a − b`` of the final metric over the seeds both have, or None."""
    xa, xb = agg.get(f"{key}|{a}"), agg.get(f"{key}|{b}")
    if xa is None or xb is None:
        return None
    fa, fb = dict(zip(xa["seed"], xa["final"])), dict(zip(xb["seed"], xb["final"]))
    seeds = sorted(set(fa) & set(fb))
    if not seeds:
        return None
    return paired([fa[s] for s in seeds], [fb[s] for s in seeds], higher_is_better(metric))


def _paired_line(agg: dict, key: str, a: str, b: str, metric: str) -> str | None:
    p = _pair(agg, key, a, b, metric)
    if p is None:
        return None
    return (
        f"{a} − {b}, final {metric} paired by seed: {p.text()} "
        f"({p.ahead} ahead, {p.tied} tied, {p.behind} behind)"
    )


def _same(cfgs, attr: str):
    vals = {repr(getattr(c, attr)) for c in cfgs}
    return getattr(next(iter(cfgs)), attr) if len(vals) == 1 else None


def _describe(cfgs: list[RunConfig]) -> str:
    """The settings every cell shares, read from the cells' own configs."""
    parts = []
    for attr, label in (
        ("batch_size", "batch"),
        ("lr", "lr"),
        ("lora_alpha", "lora_alpha"),
        ("max_length", "max_length"),
        ("max_train", "train examples"),
        ("max_test", "test examples"),
    ):
        v = _same(cfgs, attr)
        if v is not None:
            parts.append(f"{label} {v}")
        elif len({repr(getattr(c, attr)) for c in cfgs}) > 1:
            parts.append(f"{label} varies by cell")
    return ", ".join(parts)


def _rule_lines(cfgs: list[RunConfig], metric: str) -> list[str]:
    """The stopping rule the rows were read under (this report's), or none."""
    rules = {(c.stop_patience, c.stop_min_rounds, c.stop_at, c.stop_metric) for c in cfgs}
    if rules == {(None, None, None, None)}:
        return []
    if len(rules) > 1:
        return ["Stopping rule: varies by cell (each cell's config.toml).", ""]
    patience, warm, at, read = next(iter(rules))
    read = read or metric
    parts = []
    if patience is not None:
        parts.append(
            f"after {patience} round{'s' if patience != 1 else ''} without a new best {read}"
            + (f", not before round {warm}" if warm else "")
        )
    if at is not None:
        parts.append(f"once its {read} reaches {at:g}")
    return [f"Stopping rule: a method stops {', or '.join(parts)}.", ""]


def _steps_text(cfg: RunConfig) -> str:
    rounds = f"{cfg.rounds} round{'s' if cfg.rounds != 1 else ''}"
    if cfg.local_steps:
        return f"{rounds} of {cfg.local_steps} local step{'s' if cfg.local_steps != 1 else ''}"
    return f"{rounds} of {cfg.local_epochs:g} local epochs"


def comparison_table(
    rows: dict,
    cfgs: dict,
    elapsed: float,
    reused: int = 0,
    *,
    target: float | None = None,
    target_fraction: float = 0.9,
) -> str:
    """Markdown: one table per (setting, rank, steps), mean ± std over seeds per method.

    Args:
        rows: Per :class:`Cell`, its metrics rows.
        cfgs: Per cell, the configuration it ran with (its labels come from there).
        elapsed: Wall seconds of this invocation.
        reused: Cells reused from an earlier invocation.
        target: The primary metric's value whose bytes each method's row gives
            ("bytes to target"); ``None``: ``target_fraction`` of centralized's mean final
            value in the same table (``n/a`` without centralized).
        target_fraction: See ``target``.
    """
    agg = _aggregate(rows)
    metric = primary_metric(next(iter(rows.values())))
    compute = sum(x["seconds"] for rs in rows.values() for x in rs)
    all_cfgs = list(cfgs.values())
    first = all_cfgs[0]
    seeds = sorted({c.seed for c in rows})
    methods = list(dict.fromkeys(m for c in all_cfgs for m in c.methods))
    totals = {
        c.rounds * c.local_steps if c.local_steps else c.rounds * c.local_epochs
        for cell, c in cfgs.items()
        if not cell.ceiling
    }
    unit = "local steps" if first.local_steps else "local epochs"
    total = (
        f"{next(iter(totals)):g} {unit} per client in all"
        if len(totals) == 1
        else f"{unit} per client vary by cell"
    )
    rounds = _steps_text(first) if len({_steps_text(c) for c in all_cfgs}) == 1 else None
    lines = [
        "# fedex-lora comparison",
        "",
        f"Task `{first.task}`, model `{first.model}`; methods {', '.join(methods)}; "
        f"seeds {seeds}; "
        + (rounds or "rounds and local steps per cell as in its heading")
        + f" ({_describe(all_cfgs)}). `centralized` trains on the pooled data with as many "
        "steps per round as all clients together. Within a cell every method sees the same "
        "partitions, initial adapters and data order. Each figure is read from the cell's "
        "own `config.toml` and `metrics.jsonl`.",
        "",
        f"Sizing: {len(rows)} runs, {total}. "
        f"Time in the rounds, summed over every run: {compute / 60:.1f} min; "
        f"wall time of this invocation: {elapsed / 60:.1f} min"
        + (f" ({reused} of {len(rows)} runs reused from an earlier invocation)" if reused else "")
        + ".",
        "",
        "Differences between methods are paired by seed (same partition and start): mean, "
        "95% confidence interval (t distribution) and two-sided paired t-test.",
        "",
        *_rule_lines(all_cfgs, metric),
    ]
    groups = list(dict.fromkeys(c.group for c in rows))
    for g in groups:
        s, r, st, ceiling, eps = g
        cell = next(c for c in rows if c.group == g)
        cfg = cfgs[cell]
        head = f"## {s.name} ({s.num_clients} clients, {s.partition}" + (
            f" α={s.alpha}" if s.partition == "dirichlet" else ""
        )
        head += f"), r={r}" + (f", {_steps_text(cfg)}" if st is not None or ceiling else "")
        if eps is not None:
            head += ", no DP" if math.isinf(eps) else f", DP ε={eps:g} δ={cfg.dp_delta:g}"
        key = _key(cell, "x").rsplit("|", 1)[0]
        present = [m for m in methods if f"{key}|{m}" in agg]
        goal = target
        if goal is None and f"{key}|centralized" in agg:
            goal = target_fraction * statistics.fmean(agg[f"{key}|centralized"]["final"])
        # the metric the stopping rule read, where it is not the one compared
        read = cfg.stop_metric if cfg.stop_metric not in (None, metric) else None
        also = f" final {read} | best {read} |" if read else ""
        lines += [
            head,
            "",
            f"| method | final {metric} | 95% CI | best {metric} |{also} rounds | total bytes "
            "| bytes per round | bytes to target | server ms per round | mean deviation "
            "| max effective deviation |",
            "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if read else ""),
        ]
        for m in present:
            a = agg[f"{key}|{m}"]
            dev, eff = statistics.fmean(a["deviation"]), max(a["effective"])
            personal = math.isnan(dev)  # no global model (FedSA-LoRA)
            srv = statistics.fmean(a["server_seconds"])
            rule = (
                f" {_ms([x[read] for x in a['last_metrics']])} | "
                f"{_ms([x[read] for x in a['best_metrics']])} |"
                if read
                else ""
            )
            lines.append(
                f"| {m}{' (personalized)' if personal else ''} | {_ms(a['final'])} | "
                f"{_ci(a['final'])} | {_ms(a['best'])} |{rule} {_ms_int(a['rounds'])} | "
                f"{format_bytes(statistics.fmean(a['bytes']))} | "
                f"{format_bytes(statistics.fmean(a['round_bytes']))} | "
                f"{_bytes_to_target(a['curve'], goal, higher_is_better(metric))} | "
                + ("n/a | " if math.isnan(srv) else f"{1e3 * srv:.3g} | ")
                + ("n/a | n/a |" if personal else f"{dev:.3g} | {eff:.2g} |")
            )
        lines.append("")
        held = [  # rows from before adapter_bytes existed have side_bytes alone
            m
            for m in present
            if None not in agg[f"{key}|{m}"]["side_bytes"] + agg[f"{key}|{m}"]["adapter_bytes"]
        ]
        if held:

            def mean_bytes(m: str, what: str, key: str = key) -> str:
                return format_bytes(statistics.fmean(agg[f"{key}|{m}"][what]))

            lines += [
                "Held by each client beside its base after the last round (mean over seeds): "
                + "; ".join(
                    f"{m} LoRA factors {mean_bytes(m, 'adapter_bytes')} + side branch "
                    f"{mean_bytes(m, 'side_bytes')}"
                    for m in held
                )
                + ".",
                "",
            ]
        if goal is not None:
            lines += [
                f"Target {metric}: {goal:.4f}"
                + ("" if target is not None else f" ({target_fraction:g} of centralized's)")
                + "; bytes to target: up and down until a method's first round at or past it, "
                "mean over the seeds that reached it (how many did).",
                "",
            ]
        for ours in (m for m, _ in _BASELINES if m in present):
            for other in present:
                if other != ours:
                    line = _paired_line(agg, key, ours, other, metric)
                    if line:
                        lines += [f"- {line}"]
            lines.append("")
        if len({s for m in present for s in agg[f"{key}|{m}"]["seed"]}) > 1:
            lines += per_seed_lines(agg, key, present, metric)
            for ours in (m for m, _ in _BASELINES if m in present):
                for other in present:
                    if other != ours:
                        line = round_by_round(agg, key, ours, other, metric)
                        lines += [line] if line else []
                lines.append("")
    lines += [
        "*deviation*: relative Frobenius deviation of the averaged-factor product from the "
        "ideal one (the clients' weighted mean of B_i A_i, the whole update from the base), "
        "mean over layers and rounds (what FedIT's averaging loses). *effective deviation*: "
        "how far the model's weights are from the ideal average of the clients' models, "
        "relative to the round's update (||W - W_ideal|| / ||W_ideal - W_before||), over "
        "layers and rounds. *bytes per round*: up and "
        "down, all clients, mean over rounds. *server ms per round*: the server's own work "
        "in a round (payloads, validation, aggregation), mean over rounds and seeds. "
        "*rounds*: rounds run (fewer than asked where the stopping rule stopped the method). "
        "*95% CI*: of the mean final value over the seeds (t distribution).",
        "",
        "![final metric per method](comparison.png)",
        "",
    ]
    return "\n".join(lines)


def _ceiling_of(rows: dict, k: int, rank: int) -> list[float]:
    out = []
    for c, rs in rows.items():
        if c.ceiling and c.setting.num_clients == k and c.rank == rank:
            metric = primary_metric(rs)
            out.append(rs[-1]["metrics"][metric])
    return out


def exactness_report(
    rows: dict, cfgs: dict, png: str, elapsed: float, reused: int, command: str | None = None
) -> str:
    """The "when exactness matters" study: fedex − fedit per cell, with its uncertainty.

    One row per (setting, rank, local steps): both methods' final metric over the seeds,
    the paired difference with its 95% CI and paired t-test, FedIT's deviation and
    effective deviation, and the centralized ceiling for that client count.
    """
    agg = _aggregate(rows)
    fed = {c: rs for c, rs in rows.items() if not c.ceiling}
    metric = primary_metric(next(iter(fed.values())))
    hib = higher_is_better(metric)
    first = cfgs[next(iter(fed))]
    seeds = sorted({c.seed for c in fed})
    totals = sorted({cfgs[c].rounds * (cfgs[c].local_steps or 0) for c in fed})
    compute = sum(x["seconds"] for rs in rows.values() for x in rs)
    lines = [
        "| setting | local steps × rounds | fedex | fedit | fedex − fedit [95% CI] | p "
        "| FedIT deviation (mean) | FedIT effective deviation (max) | centralized |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table = []
    for g in dict.fromkeys(c.group for c in fed):
        s, r, st = g[:3]
        cell = next(c for c in fed if c.group == g)
        key = _key(cell, "x").rsplit("|", 1)[0]
        p = _pair(agg, key, _OURS, _BASE, metric)
        a, b = agg.get(f"{key}|{_OURS}"), agg.get(f"{key}|{_BASE}")
        if p is None or a is None or b is None:
            continue
        ceil = _ceiling_of(rows, s.num_clients, r)
        table.append((s, st, p, b))
        ci = f"{p.mean:+.4f} [{p.lo:+.4f}, {p.hi:+.4f}]" if p.n > 1 else f"{p.mean:+.4f}"
        lines.append(
            f"| {s.name} | {st} × {cfgs[cell].rounds} | {_ms(a['final'])} | {_ms(b['final'])} "
            f"| {ci} | {_pval(p.p)} | {statistics.fmean(b['deviation']):.3f} "
            f"| {max(b['effective']):.3f} | {_ms(ceil) if ceil else '—'} |"
        )
    better = [t for t in table if t[2].n > 1 and (t[2].lo > 0 if hib else t[2].hi < 0)]
    worse = [t for t in table if t[2].n > 1 and (t[2].hi < 0 if hib else t[2].lo > 0)]
    gaps, devs = _gap_points(rows)
    fit = _fit(devs, gaps)
    holm = _holm(
        [t[2].p for t in table if t[2].n > 1 and t[2].mean * (1 if hib else -1) > 0],
        sum(t[2].n > 1 for t in table),
    )
    pooled = []
    for st in dict.fromkeys(t[1] for t in table):
        a_all, b_all = [], []
        for c, rs in fed.items():
            if c.steps != st:
                continue
            last = {x["method"]: x["metrics"][metric] for x in rs}
            if _OURS in last and _BASE in last:
                a_all.append(last[_OURS])
                b_all.append(last[_BASE])
        if len(a_all) > 1:
            q = paired(a_all, b_all, hib)
            pooled.append(
                f"  - {st} local steps per round: {q.text()} "
                f"({q.ahead} ahead, {q.tied} tied, {q.behind} behind)"
            )
    summary = [
        f"- FedEx-LoRA ahead of FedIT with a 95% CI above zero in **{len(better)} of "
        f"{len(table)}** cells"
        + (
            ": " + ", ".join(f"{t[0].name} at {t[1]} steps ({t[2].mean:+.4f})" for t in better)
            if better
            else ""
        )
        + ".",
        f"- FedIT ahead with a CI below zero in {len(worse)} of {len(table)} cells"
        + (": " + ", ".join(f"{t[0].name} at {t[1]} steps" for t in worse) if worse else "")
        + ".",
        f"- In the other {len(table) - len(better) - len(worse)} cells the interval "
        "includes zero: no difference this study can detect.",
        f"- {len(table)} cells are {len(table)} tests: at the 5% level about "
        f"{0.05 * len(table):.1f} would come out significant by chance. With Holm's "
        f"correction for the {len(table)} tests, {holm} cell(s) stay significant.",
    ]
    if pooled:
        summary += [
            "- Pooled over every setting and seed (one pair per setting and seed; paired "
            "t-test), by local steps per round:",
            *pooled,
        ]
    if fit:
        summary.append(
            f"- Across all {len(gaps)} (cell, seed) pairs, the gap grows by "
            f"{fit[0]:+.3f} [95% CI {fit[1]:+.3f}, {fit[2]:+.3f}] {metric} per unit of "
            f"FedIT's mean deviation (least squares; r = {fit[3]:.2f})."
        )
    head = [
        "# When exactness matters: FedEx-LoRA against FedIT",
        "",
        *([f"Written by `{command}`.", ""] if command else []),
        f"Task `{first.task}`, model `{first.model}`, r={first.lora_r}; seeds {seeds}; "
        f"{', '.join(str(t) for t in totals)} local steps per client in all, split into "
        f"rounds of the local steps each row names; {_describe(list(cfgs.values()))}"
        + ("; the whole test split" if first.max_test is None else "")
        + ". `centralized` trains once per client count on the pooled data, as many steps as "
        "all clients together: the ceiling.",
        "",
        "fedex and fedit columns: final "
        f"{metric}, mean ± std over seeds. The difference is paired by seed (same partition, "
        "initial adapters and data order): mean, 95% confidence interval from the t "
        "distribution, and the two-sided paired t-test's p-value (n = seeds). The "
        "deviation is FedIT's own: how far its averaged factors' product is from the ideal "
        "update, relative, mean over layers and rounds; the effective deviation is that of "
        "the update it applied, max over rounds.",
        "",
        f"Compute: {len(rows)} runs, {compute / 60:.1f} min in the rounds; this invocation "
        f"{elapsed / 60:.1f} min wall"
        + (f", {reused} runs reused from earlier invocations" if reused else "")
        + ".",
        "",
        *lines,
        "",
        "## What it shows",
        "",
        *summary,
        "",
        f"![accuracy gap against FedIT's deviation, one point per cell and seed]({png})",
        "",
    ]
    return "\n".join(head)


def _holm(pvalues: list[float], tests: int, level: float = 0.05) -> int:
    """How many of ``pvalues`` stay significant under Holm's step-down correction.

    ``tests`` is the number of tests made (every cell of the table); ``pvalues`` need
    only hold those that could reject, the smallest first after sorting.
    """
    n = 0
    for i, p in enumerate(sorted(p for p in pvalues if not math.isnan(p))):
        if p > level / (tests - i):
            break
        n += 1
    return n


def _pval(p: float) -> str:
    if math.isnan(p):
        return "—"
    return f"{p:.2g}" if p >= 1e-4 else "<1e-4"


def _gap_points(rows: dict) -> tuple[list[float], list[float]]:
    """Per (cell, seed): fedex − fedit final metric, and FedIT's mean deviation."""
    gaps, devs = [], []
    for c, rs in rows.items():
        if c.ceiling:
            continue
        metric = primary_metric(rs)
        by = defaultdict(list)
        for x in rs:
            by[x["method"]].append(x)
        if _OURS in by and _BASE in by:
            gaps.append(by[_OURS][-1]["metrics"][metric] - by[_BASE][-1]["metrics"][metric])
            devs.append(statistics.fmean(x["deviation"]["mean"] for x in by[_BASE]))
    return gaps, devs


def _fit(x: list[float], y: list[float]):
    """Least-squares slope of y on x with its 95% CI, and r; None when undefined."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    from scipy import stats

    res = stats.linregress(x, y)
    half = float(stats.t.ppf(0.975, len(x) - 2)) * res.stderr
    return res.slope, res.slope - half, res.slope + half, res.rvalue


# -- the private comparison (``--dp-epsilons``) --------------------------------------
# The published claims the methods' specs make, ``(method, other, text)``: "method ahead
# of other". Listed by the method they are measured against, in registry order (then by
# claimant): Fed-SB's over FedEx-LoRA, then FFA-LoRA's over FedIT.
