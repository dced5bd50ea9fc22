"""Reports from ``metrics.jsonl``: markdown tables, a terminal table and PNG plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from fedexlora.core.units import format_bytes
from fedexlora.run.layout import RunLayout

__all__ = [
    "best_value",
    "diverged",
    "final_rows",
    "higher_is_better",
    "intact_rows",
    "layer_group",
    "plot_deviation",
    "plot_metrics",
    "primary_metric",
    "read_metrics",
    "summary_table",
    "time_split_table",
    "write_summary",
]


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def intact_rows(path: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` that parse (none where it is missing).

    A crash may leave the last line torn: a resume, ``compare`` and
    ``scripts/keep_cells.py`` read past it (the round runs again from its checkpoint).
    """
    rows = []
    path = Path(path)
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "method" in row and "round" in row:
                rows.append(row)
    return rows


def final_rows(rows: list[dict]) -> dict[str, dict]:
    """The last round's row of each method, in first-seen method order."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["method"] not in out or r["round"] >= out[r["method"]]["round"]:
            out[r["method"]] = r
    return out


def primary_metric(rows: list[dict]) -> str:
    """The headline metric of metrics rows: the first key of their ``metrics``."""
    return next(iter(rows[0]["metrics"])) if rows and rows[0]["metrics"] else "loss"


def higher_is_better(metric: str) -> bool:
    """False for a loss or perplexity, True for every other metric."""
    return metric not in ("loss", "perplexity")


def best_value(metric: str, values: list[float]) -> float:
    """The best of ``values``: the highest, or the lowest for a loss or perplexity."""
    return max(values) if higher_is_better(metric) else min(values)


PROPORTIONS = ("accuracy", "exact_match")


def wilson(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``p`` measured on ``n`` examples."""
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def sampled_examples(row: dict) -> int:
    """How many test examples a row's headline proportion is a plain fraction of.

    0 when it is a mean over sub-tasks (commonsense's ``accuracy`` averages eight
    ``accuracy_<task>``), whose interval a single Wilson interval would understate.
    """
    if any(str(k).startswith("accuracy_") for k in row.get("metrics", {})):
        return 0
    return int(row.get("test_examples") or 0)


def _loss(value: float | None) -> str:
    """A row's train loss; ``None``: not sent (under DP no client sends its loss)."""
    return "not sent (DP)" if value is None else f"{value:.4f}"


def _final(metric: str, value: float, n: int) -> str:
    if metric in PROPORTIONS and n and math.isfinite(value):
        lo, hi = wilson(value, n)
        return f"{value:.4f} [{lo:.3f}, {hi:.3f}]"
    return f"{value:.4f}"


def summary_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the final table: one line per method.

    A proportion (accuracy, exact match) carries its 95% Wilson interval over the test
    examples it was measured on.
    """
    metric = primary_metric(rows)
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    header = [
        "method",
        f"final {metric}",
        f"best {metric}",
        "final train loss",
        "bytes up",
        "bytes down",
        "deviation (mean)",
        "effective deviation (max)",
        "seconds",
    ]
    cells = []
    for method, rs in by_method.items():
        vals = [r["metrics"].get(metric, float("nan")) for r in rs]
        last = rs[-1]
        best = best_value(metric, vals)
        label = method + (" (approximate)" if last.get("approximate") else "")
        label += " (personalized)" if "personalized" in last else ""
        devs = [r["deviation"]["mean"] for r in rs if r["deviation"]["mean"] is not None]
        effs = [r["effective_deviation"]["max"] for r in rs]
        effs = [e for e in effs if e is not None]
        cells.append(
            [
                label,
                _final(metric, vals[-1], sampled_examples(last)),
                f"{best:.4f}",
                _loss(last.get("train_loss")),
                format_bytes(sum(r["bytes_up"] for r in rs)),
                format_bytes(sum(r["bytes_down"] for r in rs)),
                f"{sum(devs) / len(devs):.3g}" if devs else "n/a",
                f"{max(effs):.2g}" if effs else "n/a",
                f"{sum(r['seconds'] for r in rs):.1f}",
            ]
        )
    return header, cells


def _exactness(rows: list[dict]) -> str:
    """Which methods of ``rows`` the registry declares exact, and which not, as a sentence.

    Methods without clients or without a global model (no deviation to measure), and
    names the registry does not know (an old run's), are left out.
    """
    from fedexlora.core.methods import REGISTRY
    from fedexlora.core.methods.spec import EXACT_BOUND

    exact, inexact = [], []
    for method in final_rows(rows):
        spec = REGISTRY.get(method)
        if spec is None or not spec.federated or spec.personalized:
            continue
        if any(r.get("approximate") for r in rows if r["method"] == method):
            continue  # lossy by the run's own choice (--residual-rank, --side-rank)
        (exact if spec.exact else inexact).append(f"{method} ({spec.title})")
    text = ""
    if exact:
        text += (
            f" Exact: {', '.join(exact)}: float rounding only (over {EXACT_BOUND:g} for any "
            "other cause, the run fails)."
        )
    if inexact:
        text += f" Not exact, by design: {', '.join(inexact)}: what their aggregation loses."
    return text


_ROUNDING_SHOWN = 1e-6
"""An exact method's rounding, folded into fp32 weights, gets a line above this (the side
branch's is about 1e-7)."""


def _rounding(rows: list[dict]) -> list[str]:
    """Per exact method over :data:`_ROUNDING_SHOWN`: its fp32 rounding, and the option.

    A round over ``ROUNDING_MARGIN`` times its ``rounding_floor`` (what fp32's rounding of
    the weights explains) is not blamed on rounding: the line says so.
    """
    from fedexlora.core.methods import REGISTRY
    from fedexlora.core.methods.spec import ROUNDING_MARGIN

    out = []
    for method in final_rows(rows):
        spec = REGISTRY.get(method)
        effs = [r["effective_deviation"].get("max") for r in rows if r["method"] == method]
        effs = [e for e in effs if e is not None]
        if spec is None or not spec.exact or not effs or max(effs) <= _ROUNDING_SHOWN:
            continue
        if any(r.get("approximate") for r in rows if r["method"] == method):
            continue
        over = [
            r
            for r in rows
            if r["method"] == method
            and r.get("rounding_floor") is not None
            and (r["effective_deviation"].get("max") or 0) > ROUNDING_MARGIN * r["rounding_floor"]
        ]
        if over:
            worst = max(over, key=lambda r: r["effective_deviation"]["max"])
            out.append(
                f"- not rounding: {method}'s model is {worst['effective_deviation']['max']:.2g} "
                f"of round {worst['round']}'s update from the ideal, over the "
                f"{ROUNDING_MARGIN * worst['rounding_floor']:.2g} that fp32's rounding of its "
                "weights explains: the model departs from what the server computed "
                "(metrics.jsonl has every round)."
            )
            continue
        out.append(
            f"- fp32 rounding: {method}'s model is up to {max(effs):.2g} of a round's update "
            "from the ideal: fp32's rounding of the residuals folded into the weights (6e-8 "
            "of a weight), larger the smaller the update. "
            "`--fp32-side-branch` keeps the residuals beside the weights instead, exact to "
            "about 1e-7, for one more matmul per LoRA layer in the forward pass, which grows "
            "with the residuals held (docs/LARGE_MODELS.md)."
        )
    return out


def diverged(rows: list[dict]) -> dict[str, int]:
    """Each method whose clients' training loss stopped being a finite number, and its round.

    The first such round of each. A DP row's ``train_loss`` is ``null`` (not sent), never
    a divergence.
    """
    out: dict[str, int] = {}
    for r in rows:
        loss = r.get("train_loss")
        if isinstance(loss, float) and not math.isfinite(loss) and r["method"] not in out:
            out[r["method"]] = r["round"]
    return out


def _no_clients(rows: list[dict]) -> str:
    """``; `centralized` sends nothing`` for the methods of ``rows`` without clients."""
    from fedexlora.core.methods import REGISTRY

    pooled = [m for m in final_rows(rows) if m in REGISTRY and not REGISTRY[m].federated]
    if not pooled:
        return ""
    return (
        "; "
        + ", ".join(f"`{m}`" for m in pooled)
        + (" send" if len(pooled) > 1 else " sends")
        + " nothing"
    )


SPLIT_PARTS = ("train", "setup", "evaluate", "aggregate", "apply", "checkpoint")
"""The parts of ``split_seconds`` that add up (``train_max`` is one client's share)."""


def time_split_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Where each method's seconds went, summed over its rounds (``split_seconds``).

    One line per method whose rows hold a split; ``other`` is what no part holds (under
    Flower: the messages and the clients' waiting). A part not measured (a Flower client
    under DP-SGD or secure aggregation sends no seconds) is ``n/a``, and so is the ratio
    of the round to its clients' training steps plus its evaluation. The steps count by
    the wall seconds in which a client trained (``train_wall``: clients training in
    parallel count once), ``train`` in rows written before it.
    """
    header = ["method", *SPLIT_PARTS, "other", "total", "total / (training + evaluate)"]
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if isinstance(r.get("split_seconds"), dict):
            by_method[r["method"]].append(r["split_seconds"])
    cells = []
    for method, splits in by_method.items():
        sums = {
            p: None if any(s.get(p) is None for s in splits) else sum(s[p] for s in splits)
            for p in (*SPLIT_PARTS, "total")
        }
        other = sums["total"] - sum(sums[p] or 0.0 for p in SPLIT_PARTS)
        # the wall seconds in which a client trained (clients in parallel count once)
        wall = (
            None
            if any(s.get("train_wall") is None for s in splits)
            else sum(s["train_wall"] for s in splits)
        )
        training = sums["train"] if wall is None else wall
        base = None if training is None else training + sums["evaluate"]
        cells.append(
            [method]
            + ["n/a" if sums[p] is None else f"{sums[p]:.1f}" for p in SPLIT_PARTS]
            + [f"{other:.1f}", f"{sums['total']:.1f}"]
            + [f"{sums['total'] / base:.2f}" if base else "n/a"]
        )
    return header, cells


def _markdown(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines)


def write_summary(
    out_dir: str | Path,
    rows: list[dict],
    config_text: str = "",
    extra: str | None = None,
    *,
    folded_fp32: bool = False,
) -> Path:
    """Writes ``summary.md`` (final table, plots, notes) and the PNG plots it references.

    ``extra`` is a markdown section put before the plots (a recipe's paper figures beside
    the run's). ``folded_fp32``: the residuals were folded into fp32 weights (no side
    branch), so an exact method's figure includes fp32's rounding of the weights, which
    a line then gives.
    """
    layout = RunLayout(out_dir)
    header, cells = summary_table(rows)
    plot_metrics(rows, layout.metrics_plot)
    has_dev = any(r["deviation"].get("per_layer") for r in rows)
    if has_dev:
        plot_deviation(rows, layout.deviation_plot)
    parts = [
        "# fedex-lora run summary",
        "",
        _markdown(header, cells),
        "",
        "- *deviation*: relative Frobenius deviation of the averaged-factor product "
        "`B̄Ā` from the ideal update `Σ p_i B_i A_i`, per layer, averaged over layers and "
        "rounds: what plain factor averaging (FedIT) loses.",
        "- *effective deviation*: measured on the model after each round: its effective "
        "weights (base, side branch and adapter, as the forward pass applies them) "
        "against the ideal average of the clients' models, relative to the round's "
        "update." + _exactness(rows),
        "- Bytes are counted from the tensors sent" + _no_clients(rows) + ".",
    ]
    if any("personalized" in r for r in rows):
        parts.append(
            "- *personalized* (FedSA-LoRA): each client keeps its own B and task head, so "
            "there is no global model and no deviation from one (n/a). Its metrics are each "
            "client's own model on a test split drawn like its training data, averaged "
            "weighted by test examples (`personalized` in `metrics.jsonl` has each client's)."
        )
    n = max((sampled_examples(r) for r in rows), default=0)
    if n and primary_metric(rows) in PROPORTIONS:
        parts.append(
            f"- Uncertainty: the final {primary_metric(rows)} is measured on {n} test "
            "examples; brackets give its 95% Wilson interval, the test-sampling error "
            "alone. This is one run, one seed: a difference between methods here carries "
            "no seed-to-seed variation and no paired test. `fedexlora compare` runs seeds "
            "and gives paired 95% confidence intervals and p-values."
        )
    for method, rnd in diverged(rows).items():
        parts.append(
            f"- **`{method}` diverged** in round {rnd}: its clients' training loss is not a "
            "finite number. An upload that is not finite is rejected, so the global model "
            "keeps the last round whose uploads were. Lower the learning rate (`lr`)."
        )
    if folded_fp32:
        parts += _rounding(rows)
    if any(r.get("approximate") for r in rows):
        parts.append(
            "- Methods marked *(approximate)* truncated the residual (`residual_rank`) or "
            "capped the side branch (`side_rank`, `side_budget`); the remainder is kept on "
            "the server as error feedback."
        )
    private = [r for r in rows if r.get("privacy")]
    if private:
        last: dict[str, dict] = {}
        for r in private:
            last[r["method"]] = r["privacy"]
        p0 = next(iter(last.values()))
        head = (
            f"- Differential privacy: every client trained with DP-SGD (Opacus; per-sample "
            f"clipping and Gaussian noise, Poisson sampling) within epsilon "
            f"{p0['epsilon_budget']:g} at delta {p0['delta']:g} over its planned steps"
        )
        told = {m: v for m, v in last.items() if not v.get("kept_by_clients")}
        if told:
            spent = ", ".join(f"{m} {v['epsilon']:.3g}" for m, v in told.items())
            parts.append(
                f"{head}; the largest epsilon any client has spent: {spent} "
                f"({p0['accountant']} accountant, orders {p0['orders'][0]}-"
                f"{p0['orders'][1]}). Each row's `privacy` object in metrics.jsonl gives "
                "every client's noise multiplier, sampling rate and steps, so any "
                "accountant can recompute it."
            )
        kept = sorted(set(last) - set(told))
        if kept:
            parts.append(
                f"{head if not told else '- DP-SGD'} ({', '.join(kept)}: under secure "
                "aggregation each client kept its accounting to itself, since its sampling "
                "rate would tell its example count; the server learned only which clients "
                "refused to train, their budget spent)."
            )
        randomness = sorted({v.get("randomness") for v in last.values()} - {None})
        if any(v.startswith("seeded") for v in randomness):
            parts.append(
                "- **DP-SGD's sampling and noise were seeded (`dp_reproducible`): this run is "
                "not private against anyone who knows the seed**, the server included; it "
                "repeats bit for bit, for simulations only."
            )
        elif randomness:
            parts.append(
                "- DP-SGD's sampling and noise (and, under secure aggregation, the stochastic "
                "rounding) were drawn on each client from OS entropy, never from the seed."
            )
        parts.append(
            "- No client sent its training loss (a noiseless figure of its data, outside "
            "DP-SGD's guarantee): the rows' `train_loss` is `null`."
        )
        refused = sorted({(r["method"], r["round"], tuple(r["privacy"]["refused"]))
                          for r in private if r["privacy"]["refused"]})  # fmt: skip
        for method, rnd, ids in refused:
            parts.append(
                f"- {method}, round {rnd}: clients {list(ids)} were not trained, their "
                "privacy budget spent"
            )
    rejected = [(r["method"], r["round"], r["rejected"]) for r in rows if r.get("rejected")]
    for method, rnd, rej in rejected:
        for cid, why in rej.items():
            parts.append(f"- {method}, round {rnd}: rejected client {cid}: {why}")
    split_header, split_cells = time_split_table(rows)
    if split_cells:
        parts += [
            "",
            "Where the seconds went, summed over each method's rounds (`split_seconds` in "
            "`metrics.jsonl`, timed around the calls that do the work; `other`: what no "
            "part holds, under Flower the messages and the clients' waiting; `training` in "
            "the ratio: the wall seconds in which a client trained, clients training in "
            "parallel counted once):",
            "",
            _markdown(split_header, split_cells),
        ]
    if extra:
        parts += ["", extra]
    parts += ["", f"![metric per round]({layout.metrics_plot.name})"]
    if has_dev:
        parts += ["", f"![per-layer deviation]({layout.deviation_plot.name})"]
    if config_text:
        parts += ["", "## Configuration", "", "```toml", config_text.strip(), "```"]
    path = layout.summary
    path.write_text("\n".join(parts) + "\n")
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_rounds(ax) -> None:
    """Rounds are whole numbers: no fractional ticks on the x axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_metrics(rows: list[dict], path: str | Path) -> Path:
    """PNG of the primary metric per round, one line per method."""
    plt = _plt()
    metric = primary_metric(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    for method, rs in by_method.items():
        ax.plot(
            [r["round"] for r in rs], [r["metrics"].get(metric) for r in rs], "o-", label=method
        )
    _integer_rounds(ax)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def layer_group(name: str) -> str:
    """``...layer.3.attention.self.query`` -> ``query``: the module's own name."""
    return name.rsplit(".", 1)[-1]


def plot_deviation(rows: list[dict], path: str | Path) -> Path:
    """PNG of the per-layer-group deviation over rounds, one panel per method."""
    plt = _plt()
    methods = [
        m
        for m in final_rows(rows)
        if any(r["method"] == m and r["deviation"].get("per_layer") for r in rows)
    ]
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.8), squeeze=False)
    for ax, method in zip(axes[0], methods):
        rs = [r for r in rows if r["method"] == method]
        groups: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rs:
            for name, v in r["deviation"].get("per_layer", {}).items():
                groups[layer_group(name)][r["round"]].append(v)
        for g, by_round in sorted(groups.items()):
            xs = sorted(by_round)
            ax.plot(xs, [sum(by_round[x]) / len(by_round[x]) for x in xs], "o-", label=g)
        ax.set_title(method)
        _integer_rounds(ax)
        ax.set_xlabel("round")
        ax.set_ylabel("relative deviation of B̄Ā from ideal")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
