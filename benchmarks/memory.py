"""Peak memory of the in-process simulation against the number of clients.

The in-process engine keeps one base model however many clients it simulates: each
client's turn loads the global adapter into the shared model, trains, and uploads its
factors. So the peak resident set should stay flat as the client count grows.

Each client count runs ``python -m fedexlora run`` in a fresh subprocess (MiniLM-L6 on
bbc-news, one round, two local steps per client, IID split so that every count gets the
same data); its peak resident set is the child's own ``ru_maxrss`` from ``os.wait4``. A
second kind of child only imports the package and loads the LoRA model, for reference.

Usage::

    python benchmarks/memory.py                    # 2, 5, 10, 20 clients
    python benchmarks/memory.py --clients 2,20,50 --json mem.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD_ONLY = (
    "from fedexlora.bridge.models import load_model; "
    "load_model('minilm', causal=False, num_labels=5, r=8)"
)


def child_peak(cmd: list[str], log: Path) -> tuple[int, float]:
    """Runs ``cmd``; returns (the child's peak RSS in bytes, wall seconds)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(
            f"{' '.join(cmd)} failed ({proc.returncode}); see {log}:\n{log.read_text()[-2000:]}"
        )
    return usage.ru_maxrss * 1024, wall  # ru_maxrss is in KiB on Linux


def run_cmd(clients: int, out: Path, args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fedexlora",
        "run",
        "--clients",
        str(clients),
        "--method",
        args.method,
        "--rounds",
        "1",
        "--local-steps",
        str(args.local_steps),
        "--max-train",
        str(args.max_train),
        "--max-test",
        str(args.max_test),
        "--max-length",
        "32",
        "--partition",
        "iid",
        "--no-progress",
        "--out",
        str(out),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="2,5,10,20")
    ap.add_argument("--method", default="fedex")
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--max-train", type=int, default=400)
    ap.add_argument("--max-test", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedex-mem-") as tmp:
        tmp = Path(tmp)
        peak, wall = child_peak([sys.executable, "-c", LOAD_ONLY], tmp / "load.log")
        rows.append(
            {
                "clients": 0,
                "what": "import + load MiniLM LoRA model",
                "peak_rss": peak,
                "seconds": wall,
            }
        )
        print(f"load only: {peak / 1e6:.0f} MB ({wall:.0f}s)", file=sys.stderr, flush=True)
        for k in counts:
            out = tmp / f"run-{k}"
            peak, wall = child_peak(run_cmd(k, out, args), tmp / f"run-{k}.log")
            metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            sampled = len(metrics[0]["sampled"])
            if sampled != k:
                sys.exit(f"run with {k} clients trained {sampled}")
            rows.append(
                {
                    "clients": k,
                    "what": f"fedexlora run, {k} clients",
                    "peak_rss": peak,
                    "seconds": wall,
                    "bytes_down": metrics[0]["bytes_down"],
                    "bytes_up": metrics[0]["bytes_up"],
                }
            )
            print(f"{k} clients: {peak / 1e6:.0f} MB ({wall:.0f}s)", file=sys.stderr, flush=True)
    base = next(r for r in rows if r["clients"] == counts[0])
    print("| run | peak RSS (MB) | vs first | wall s |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['what']} | {r['peak_rss'] / 1e6:.0f} | "
            f"{r['peak_rss'] / base['peak_rss']:.3f} | {r['seconds']:.0f} |"
        )
    last = next(r for r in rows if r["clients"] == counts[-1])
    print(
        f"\npeak RSS ratio {counts[-1]} vs {counts[0]} clients: "
        f"{last['peak_rss'] / base['peak_rss']:.3f}"
    )
    print(
        "command per row: "
        + " ".join(run_cmd(0, Path("OUT"), args)[1:]).replace("--clients 0", "--clients K")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
