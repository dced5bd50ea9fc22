"""Memory beside the base against exactness: FedEx exact, under side budgets, and FedIT.

Runs ``fedexlora run`` on the embedded SmolLM2-135M (the embedded GSM8K items) at
FlowerTune-like sampling (20 clients, a fraction of them a round, LoRA on every attention
and MLP projection) for each base precision, once per setting: FedEx-LoRA exact (no
budget) with FedIT beside it, and FedEx-LoRA under each ``--side-budget``. Then it reads
every round's row: ``side_bytes`` (what every client holds beside its base, from the side
branches' tensors), ``effective_deviation`` (the model against the ideal average of the
clients' models, measured on the model, relative to the round's update) and, under a
budget, ``approximation_gap`` (what the server keeps back). It prints one table per
precision and writes a plot of memory against deviation.

Usage::

    python benchmarks/side_budget_tradeoff.py --out runs/tradeoff            # run, then report
    python benchmarks/side_budget_tradeoff.py --out runs/tradeoff --report   # report only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def _settings(budgets: list[float]) -> list[tuple[str, list[str], str]]:
    """``(name, extra flags, methods)`` of each run."""
    out = [("exact", [], "fedex,fedit")]
    out += [(f"budget-{b:g}", ["--side-budget", f"{b:g}"], "fedex") for b in budgets]
    return out


def _flags(prec: str) -> list[str]:
    return ["--quantization", prec] if prec in ("nf4", "fp4", "int8") else ["--dtype", prec]


def run(args) -> None:
    """Each precision and setting, in its own ``fedexlora run`` (skipped when done)."""
    for prec in args.precisions:
        for name, extra, methods in _settings(args.budgets):
            out = Path(args.out) / prec / name
            if (out / "summary.md").is_file():
                continue
            cmd = [
                sys.executable, "-m", "fedexlora", "run", "--model", "smollm2-135m",
                "--task", "gsm8k", "--method", methods, "--clients", str(args.clients),
                "--fraction", str(args.fraction), "--rounds", str(args.rounds),
                "--rank", str(args.rank), "--lora-alpha", str(2 * args.rank),
                "--local-steps", str(args.local_steps), "--batch-size", "4",
                "--max-length", "128", "--max-test", "4", "--max-new-tokens", "8",
                "--partition", "iid", "--min-partition-size", "2", "--lr", str(args.lr),
                "--out", str(out), "--no-progress", *_flags(prec), *extra,
            ]  # fmt: skip
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True, env=os.environ)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _base_bytes(prec: str, rank: int) -> int:
    """The adapted layers' stored base bytes (what ``--side-budget`` is a fraction of)."""
    from fedexlora.bridge.fold import base_nbytes
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.config import RunConfig
    from fedexlora.run.build import new_model
    from fedexlora.run.restore import load_task_for

    kw = {"quantization": prec} if prec in ("nf4", "fp4", "int8") else {"dtype": prec}
    cfg = RunConfig(model="smollm2-135m", task="gsm8k", lora_r=rank, **kw)
    model, _ = new_model(cfg, load_task_for(cfg), "fedex")
    return sum(base_nbytes(layer) for layer in lora_layers(model).values())


def report(args) -> str:
    """The tables, from the runs' rows; the plot beside them."""
    lines, series = [], {}
    for prec in args.precisions:
        base = _base_bytes(prec, args.rank)
        lines += [
            f"**{prec}** (adapted layers' base: {base / 1e6:.1f} MB; beside it FedIT holds "
            "only the adapter, measured as one client's upload; k = "
            f"{max(1, round(args.clients * args.fraction))} of {args.clients}, r = {args.rank}, "
            f"{args.rounds} rounds)",
            "",
            "| run | side branch MB at round 1 / 10 / last (x base) | beside the base, last "
            "round: x FedIT's | deviation from the ideal: max over rounds (round 1 / 10 / "
            "last) | held back, last round |",
            "|---|---|---|---|---|",
        ]
        for name, _, methods in _settings(args.budgets):
            path = Path(args.out) / prec / name / "metrics.jsonl"
            if not path.is_file():
                lines.append(f"| {name} | not run | | | |")
                continue
            rows = _rows(path)
            first = next(r for r in rows if r["accepted"])
            adapters = first["bytes_up"] / len(first["accepted"])  # one upload: the factors
            for m in methods.split(","):
                rs = [r for r in rows if r["method"] == m]
                if not rs:
                    continue
                label = "fedit" if m == "fedit" else f"fedex, {name}"
                pick = [rs[0], rs[min(9, len(rs) - 1)], rs[-1]]
                mem = " / ".join(f"{r.get('side_bytes', 0) / 1e6:.1f}" for r in pick)
                last = rs[-1].get("side_bytes", 0) / base
                dev = [r["effective_deviation"]["max"] for r in rs]
                gap = rs[-1].get("approximation_gap", {}).get("max")
                beside = (rs[-1].get("side_bytes", 0) + adapters) / adapters
                lines.append(
                    f"| {label} | {mem} ({last:.2f}x) | {beside:.1f}x | {max(dev):.2g} ("
                    + " / ".join(f"{r['effective_deviation']['max']:.2g}" for r in pick)
                    + f") | {'–' if gap is None else f'{gap:.2g}'} |"
                )
                series[f"{prec}: {label}"] = (
                    [r.get("side_bytes", 0) / 1e6 for r in rs],
                    dev,
                )
        lines.append("")
    text = "\n".join(lines)
    print(text)
    _plot(series, Path(args.out) / "tradeoff.png")
    return text


def _plot(series: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (mem, dev) in series.items():
        ax.plot(mem, [max(d, 1e-12) for d in dev], marker=".", label=label)
    ax.set_xlabel("side branch beside the base, MB (every client)")
    ax.set_ylabel("model's deviation from the ideal, per round")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("SmolLM2-135M: memory against exactness, one point a round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the runs go")
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["nf4", "bf16"])
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 0.25])  # fmt: skip
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--local-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--report", action="store_true", help="only read the runs already made")
    args = p.parse_args(argv)
    if not args.report:
        run(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
