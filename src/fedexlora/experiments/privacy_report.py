"""The private comparison's report (``fedexlora compare --dp-epsilons``).

Accuracy against epsilon per method, paired differences, and the published claims it
checks.

It reads finished cells; nothing runs. Shared table helpers are
:mod:`fedexlora.experiments.compare_report`'s.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from fedexlora.core.methods import REGISTRY
from fedexlora.experiments.compare_report import (
    _describe,
    _ms,
    _pval,
    _same,
    _steps_text,
)
from fedexlora.experiments.stats import paired
from fedexlora.run.report import higher_is_better, primary_metric

__all__ = ["CLAIMS", "plot_privacy", "privacy_report"]


CLAIMS = tuple(
    sorted(
        ((name, other, text) for name, spec in REGISTRY.items() for other, text in spec.claims),
        key=lambda claim: list(REGISTRY).index(claim[1]),
    )
)


def _eps_label(e: float) -> str:
    return "no DP" if math.isinf(e) else f"ε={e:g}"


def _final_by_seed(rows: dict, setting, eps, method: str, metric: str) -> dict[int, float]:
    out = {}
    for c, rs in rows.items():
        if c.setting == setting and c.epsilon == eps:
            vals = [x["metrics"][metric] for x in rs if x["method"] == method]
            if vals:
                out[c.seed] = vals[-1]
    return out


def _spent(rows: dict, setting, eps) -> float | None:
    """The largest epsilon any client spent in these cells, read from their rows."""
    spent = [
        x["privacy"]["epsilon"]
        for c, rs in rows.items()
        if c.setting == setting and c.epsilon == eps
        for x in rs
        if x.get("privacy") and x["privacy"].get("epsilon") is not None
    ]
    return max(spent) if spent else None


def _verdict(pairs: list) -> str:
    """``ahead``/``behind`` where the 95% CI excludes 0, else ``no clear difference``."""
    if not pairs:
        return "not run"
    ahead = sum(p.n > 1 and p.lo > 0 for p in pairs)
    behind = sum(p.n > 1 and p.hi < 0 for p in pairs)
    rest = len(pairs) - ahead - behind
    return f"ahead in {ahead}, behind in {behind}, no clear difference in {rest}"


def privacy_report(
    rows: dict, cfgs: dict, png: str, elapsed: float, reused: int, command: str | None = None
) -> str:
    """Accuracy against epsilon per method, paired differences, and the two claims.

    One table per setting (mean ± std over seeds of the final metric, one column per
    epsilon), the largest epsilon spent by any client (from the rows' ``privacy``
    objects), and for each claim the paired difference per epsilon and setting, then a
    count of where it held and the pooled paired test over every private cell and seed.
    """
    metric = primary_metric(next(iter(rows.values())))
    hib = higher_is_better(metric)
    first = cfgs[next(iter(rows))]
    seeds = sorted({c.seed for c in rows})
    settings = list(dict.fromkeys(c.setting for c in rows))
    epsilons = sorted({c.epsilon for c in rows}, key=lambda e: (math.isinf(e), e))
    methods = list(dict.fromkeys(m for c in cfgs.values() for m in c.methods))
    compute = sum(x["seconds"] for rs in rows.values() for x in rs)
    sb = _same(list(cfgs.values()), "fedsb_init")
    lines = [
        "# Accuracy under differential privacy",
        "",
        f"Task `{first.task}`, model `{first.model}`; methods {', '.join(methods)}; seeds "
        f"{seeds}; {_steps_text(first)} ({_describe(list(cfgs.values()))}); LoRA rank "
        f"{first.lora_r}, Fed-SB rank {first.fedsb_rank} (init {sb}). "
        + (
            f"DP-SGD on every client: δ={first.dp_delta:g}, clipping norm "
            f"{first.dp_max_grad_norm:g}, each client's noise multiplier set so that its ε "
            "over all its planned steps meets the budget. "
            if any(not math.isinf(e) for e in epsilons)
            else "No cell uses DP: this is the reference without it. "
        )
        + f"{len(rows)} runs; time in the rounds {compute / 60:.1f} min, wall time "
        f"of this invocation {elapsed / 60:.1f} min"
        + (f" ({reused} runs reused)" if reused else "")
        + ".",
        "",
    ]
    if command:
        lines += ["```", command, "```", ""]
    head = " | ".join(_eps_label(e) for e in epsilons)
    pooled: dict[tuple, tuple[list, list]] = {}
    per_claim: dict[tuple, list] = defaultdict(list)
    for s in settings:
        title = f"## {s.name} ({s.num_clients} clients, {s.partition}" + (
            f" α={s.alpha})" if s.partition == "dirichlet" else ")"
        )
        lines += [title, "", f"Final {metric}, mean ± std over seeds.", ""]
        lines += [f"| method | {head} |", "|---" * (len(epsilons) + 1) + "|"]
        for m in methods:
            cells = []
            for e in epsilons:
                v = list(_final_by_seed(rows, s, e, m, metric).values())
                cells.append(_ms(v) if v else "—")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        spent = [_spent(rows, s, e) for e in epsilons]
        lines.append(
            "| largest ε spent | "
            + " | ".join("—" if x is None else f"{x:.3g}" for x in spent)
            + " |"
        )
        lines += ["", "Paired differences of the final metric by seed: mean [95% CI], p.", ""]
        lines += [f"| difference | {head} |", "|---" * (len(epsilons) + 1) + "|"]
        for a, b, _ in CLAIMS:
            if a not in methods or b not in methods:
                continue
            cells = []
            for e in epsilons:
                fa = _final_by_seed(rows, s, e, a, metric)
                fb = _final_by_seed(rows, s, e, b, metric)
                common = sorted(set(fa) & set(fb))
                if not common:
                    cells.append("—")
                    continue
                p = paired([fa[k] for k in common], [fb[k] for k in common], hib)
                if not math.isinf(e):
                    per_claim[(a, b)].append(p)
                    xs, ys = pooled.setdefault((a, b), ([], []))
                    xs += [fa[k] for k in common]
                    ys += [fb[k] for k in common]
                ci = f" [{p.lo:+.3f}, {p.hi:+.3f}]" if p.n > 1 else ""
                cells.append(f"{p.mean:+.3f}{ci}, p={_pval(p.p)}")
            lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
        lines.append("")
    if pooled:
        lines += ["## The published claims, here", ""]
    for a, b, text in CLAIMS:
        if (a, b) not in pooled:
            continue
        p = paired(*pooled[(a, b)], hib)
        lines.append(
            f"- **{text}**: over the {len(per_claim[(a, b)])} private (setting, ε) cells, "
            f"{a} is {_verdict(per_claim[(a, b)])} (95% CI of the paired difference). "
            f"Pooled over every private cell and seed ({p.n} pairs): {a} − {b} = "
            f"{p.mean:+.4f} [{p.lo:+.4f}, {p.hi:+.4f}], p={_pval(p.p)}."
        )
    lines += ["", f"![{metric} against ε]({png})", ""]
    return "\n".join(lines)


def plot_privacy(rows: dict, path: Path) -> None:
    """PNG: final metric against epsilon per method (mean ± std), one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = primary_metric(next(iter(rows.values())))
    settings = list(dict.fromkeys(c.setting for c in rows))
    epsilons = sorted({c.epsilon for c in rows}, key=lambda e: (math.isinf(e), e))
    methods = list(dict.fromkeys(x["method"] for rs in rows.values() for x in rs))
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 3.8), squeeze=False)
    xs = list(range(len(epsilons)))
    for ax, s in zip(axes.flat, settings):
        for i, m in enumerate(methods):
            means, stds = [], []
            for e in epsilons:
                v = list(_final_by_seed(rows, s, e, m, metric).values())
                means.append(statistics.fmean(v) if v else math.nan)
                stds.append(statistics.stdev(v) if len(v) > 1 else 0.0)
            off = [x + (i - (len(methods) - 1) / 2) * 0.06 for x in xs]
            ax.errorbar(off, means, yerr=stds, marker="o", capsize=3, label=m)
        ax.set_xticks(xs, [_eps_label(e) for e in epsilons])
        ax.set_title(s.name)
        ax.set_ylabel(f"final {metric}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
