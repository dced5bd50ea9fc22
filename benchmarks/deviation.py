"""The paper's deviation analysis, read off the metrics of `fedexlora compare` grids.

The paper plots how far FedIT's update (the product of averaged factors) is from the
ideal one (the average of the client products), per layer, for Q and V, and reports that
the deviation is larger for Q than for V, smaller in deeper layers, grows with more local
epochs and shrinks over rounds. Every row of `metrics.jsonl` carries that deviation per
layer (`deviation.per_layer`: ``||B̄Ā − Σ p_i B_i A_i||_F / ||Σ p_i B_i A_i||_F``, computed
by the server from the uploads), so this script only reads it back; it trains nothing.

It uses the rows of one method (``fedit`` by default: the deviation along FedIT's own
trajectory), averaged over every run of each grid, and prints:

* Q vs V: mean deviation of the query layers and of the value layers;
* depth: mean deviation per layer index (Q and V together);
* rounds: mean deviation per round;
* local steps: when several grids are given (say, the same grid at 6 and at 12 local
  steps per round), one line per grid: its mean deviation over the rounds all grids have.

Usage::

    python benchmarks/deviation.py runs/compare
    python benchmarks/deviation.py runs/compare-6steps runs/compare --json dev.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from fedexlora.config import load_config

_LAYER = re.compile(r"\.(\d+)\.")


def _kind(name: str) -> str:
    low = name.lower()
    for key, kind in (("query", "Q"), ("q_proj", "Q"), ("value", "V"), ("v_proj", "V")):
        if key in low:
            return kind
    return "other"


def grid_deviation(grid: Path, method: str = "fedit") -> dict:
    """Deviation of ``method``'s rows in every run under ``grid``, by kind, depth, round."""
    by_kind, by_depth, by_round = defaultdict(list), defaultdict(list), defaultdict(list)
    steps, runs = set(), 0
    for metrics in sorted(grid.glob("*/metrics.jsonl")):
        cfg = load_config(metrics.parent / "config.toml")
        steps.add(cfg.local_steps or f"{cfg.local_epochs:g} epochs")
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r["method"] == method]
        runs += bool(rows)
        for row in rows:
            per_layer = row["deviation"]["per_layer"]
            by_round[row["round"]].append(statistics.fmean(per_layer.values()))
            for name, value in per_layer.items():
                by_kind[_kind(name)].append(value)
                depth = _LAYER.search(name)
                if depth:
                    by_depth[int(depth.group(1))].append(value)
    if not runs:
        raise SystemExit(f"error: no {method!r} rows in any {grid}/*/metrics.jsonl")
    mean = {k: statistics.fmean(v) for k, v in sorted(by_kind.items())}
    return {
        "grid": str(grid),
        "runs": runs,
        "local_steps": sorted(map(str, steps)),
        "all": statistics.fmean(x for v in by_kind.values() for x in v),
        "kind": mean,
        "depth": {d: statistics.fmean(v) for d, v in sorted(by_depth.items())},
        "round": {r: statistics.fmean(v) for r, v in sorted(by_round.items())},
    }


def _print_row(title: str, values: dict) -> None:
    """A one-row markdown table: the keys as columns, the deviation below them."""
    print(f"\n| {title} | " + " | ".join(map(str, values)) + " |")
    print("|---|" + "---|" * len(values))
    print("| deviation | " + " | ".join(f"{v:.4f}" for v in values.values()) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grids", nargs="+", type=Path, help="output directories of fedexlora compare")
    ap.add_argument("--method", default="fedit", help="whose trajectory [fedit]")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    results = [grid_deviation(g, args.method) for g in args.grids]
    for res in results:
        print(f"\n{res['grid']}: {res['runs']} runs of {args.method}, "
              f"local steps per round {', '.join(res['local_steps'])}")  # fmt: skip
        print("| layers | mean relative deviation |\n|---|---|")
        for kind, value in res["kind"].items():
            print(f"| {kind} | {value:.4f} |")
        _print_row("layer index", res["depth"])
        _print_row("round", res["round"])
    if len(results) > 1:
        # Deviation shrinks over rounds, so grids are compared over the rounds they share.
        common = min(max(res["round"]) for res in results)
        print(f"\n| grid | local steps per round | mean deviation, rounds 1-{common} |")
        print("|---|---|---|")
        for res in results:
            shared = statistics.fmean(v for r, v in res["round"].items() if r <= common)
            res["shared_rounds_mean"] = shared
            print(f"| {res['grid']} | {', '.join(res['local_steps'])} | {shared:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
