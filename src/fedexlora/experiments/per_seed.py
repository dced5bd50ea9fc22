"""The per-seed lines of ``comparison.md``: what a mean over seeds hides.

Each method's final value and rounds on each seed, its mean effective deviation and the
side branch a client held; and, for the method measured against the others (FedEx-LoRA),
how it compared round by round with each on each seed. Read from the rows alone.
"""

from __future__ import annotations

import math
import statistics

from fedexlora.core.units import format_bytes
from fedexlora.run.report import higher_is_better

__all__ = ["per_seed_lines", "round_by_round"]


def _g(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g}"


def per_seed_lines(agg: dict, key: str, methods: list[str], metric: str) -> list[str]:
    """One line per method of group ``key``, per seed.

    On each seed: the final value (rounds run), the mean effective deviation and, where
    one was held, the side branch.
    """
    lines = [
        f"Per seed: final {metric} (rounds run), mean effective deviation (over layers and "
        "rounds, relative to each round's update) and, where there is one, the side branch "
        "each client held after the last round.",
        "",
    ]
    for m in methods:
        a = agg[f"{key}|{m}"]
        side = a["side_bytes"] if any(a["side_bytes"]) else None  # None: rows from before
        seeds = []
        for i, seed in enumerate(a["seed"]):
            text = (
                f"seed {seed} {a['final'][i]:.4f} ({a['rounds'][i]}), {_g(a['effective_mean'][i])}"
            )
            if side:
                held = "n/a" if side[i] is None else format_bytes(side[i])
                text += f", side branch {held}"
            seeds.append(text)
        lines.append(f"- {m}: {'; '.join(seeds)}")
    return [*lines, ""]


def round_by_round(agg: dict, key: str, ours: str, other: str, metric: str) -> str | None:
    """``ours`` against ``other``, round by round, or None where they share no round.

    On each seed both ran, over the rounds both ran: in how many ``ours`` was ahead, tied
    and behind, and the mean of ``ours − other``.
    """
    a, b = agg.get(f"{key}|{ours}"), agg.get(f"{key}|{other}")
    if a is None or b is None:
        return None
    theirs = dict(zip(b["seed"], b["by_round"], strict=True))
    said = []
    for seed, mine in zip(a["seed"], a["by_round"], strict=True):
        both = sorted(set(mine) & set(theirs.get(seed, {})))
        if not both:
            continue
        diff = [mine[r] - theirs[seed][r] for r in both]
        better = [d if higher_is_better(metric) else -d for d in diff]
        said.append(
            f"seed {seed} ahead in {sum(d > 0 for d in better)} of {len(both)}, tied in "
            f"{sum(d == 0 for d in better)}, behind in {sum(d < 0 for d in better)}, mean "
            f"{ours} − {other} {statistics.fmean(diff):+.4f}"
        )
    if not said:
        return None
    lower = "" if higher_is_better(metric) else f" ({metric}: lower is better)"
    return f"- {ours} − {other} round by round{lower}, over the rounds both ran: {'; '.join(said)}"
