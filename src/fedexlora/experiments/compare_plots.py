"""The plots of ``fedexlora compare``: final metric per method, and the exactness study's gap.

They read the same finished cells as :mod:`fedexlora.experiments.compare_report`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from fedexlora.experiments.compare_report import _aggregate, _gap_points, _key

__all__ = ["plot_comparison", "plot_gap"]


def plot_gap(rows: dict, path: Path) -> None:
    """PNG: fedex − fedit against FedIT's deviation, one point per cell and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    groups = defaultdict(lambda: ([], []))
    for c, rs in rows.items():
        if c.ceiling:
            continue
        g, d = _gap_points({c: rs})
        if g:
            groups[(c.setting.name, c.steps)][0].append(d[0])
            groups[(c.setting.name, c.steps)][1].append(g[0])
    # colour: local steps per round; marker: the setting (clients and heterogeneity)
    settings = list(dict.fromkeys(k[0] for k in groups))
    steps = sorted({k[1] for k in groups}, key=lambda s: (s is None, s or 0))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "os^vD<>pPX*h"
    for (name, st), (xs, ys) in groups.items():
        ax.scatter(
            xs,
            ys,
            label=f"{name}, {st} steps/round",
            marker=markers[settings.index(name) % len(markers)],
            color=colours[steps.index(st) % len(colours)],
            s=24,
            alpha=0.8,
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("FedIT's mean deviation from the ideal update")
    ax.set_ylabel("fedex − fedit, final metric")
    ax.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comparison(rows: dict, path: Path) -> None:
    """PNG: final metric per method, mean ± std over seeds, one panel per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = _aggregate(rows)
    panels = list(dict.fromkeys(_key(c, "x").rsplit("|", 1)[0] for c in rows))
    cols = min(len(panels), 6)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        keys = [k for k in agg if k.startswith(f"{panel}|")]
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
        ax.set_title(panel.replace("|", ", "))
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
