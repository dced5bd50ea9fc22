"""Where a round's time goes, on both engines: the split every row holds, and the ratios.

Runs one job (by default the README's: MiniLM-L6 on BBC News, fedex, 3 clients, 3 rounds,
one local epoch) with ``python -m fedexlora run`` once per engine, each in a fresh child
process, and reads back each round's ``split_seconds`` (:mod:`fedexlora.run.timing`:
timed around the calls that do the work; a Flower client's own seconds come back in its
reply). It prints, per engine and round, the clients' training steps (their sum, and the
longest client's), their set-up and reset, the evaluation, the server's aggregation, the
outcome applied to the global model, the checkpoint, what no part holds (``other``: on
Flower, the messages, Ray and the clients' waiting), the round's wall time, and the
ratios the issue's goal names:

- ``round / (train + eval)``: the round's wall time over its clients' training steps
  (summed: clients one after another) plus its evaluation;
- ``round / (train_wall + eval)``: the same over the wall seconds in which at least one
  client trained (clients training in parallel, as Flower's virtual clients do, count
  once; in-process it is the sum): the goal's ratio (<= 1.15 in-process, <= 1.3 under
  Flower);
- the peak memory of each engine's whole process tree, sampled from ``/proc``
  (``proc_memory.py``: RSS every 0.2 s, PSS every 2 s, at nice 19; the sampler's own
  CPU seconds are printed, since it shares the machine with what it times): PSS, each
  shared page counted once (what the machine holds), and RSS summed over processes (a
  shared page once per process), and under Flower that of its virtual clients (Ray's
  ClientApp actors: processes named ``ray::ClientAppActor``) and of the rest by process
  name, against the in-process engine's (goal: <= 1.5x).

Rounds after the first are the steady state (the first loads the clients' models under
Flower); the summary line gives their medians.

Usage::

    python benchmarks/round_time.py                              # the README's job
    python benchmarks/round_time.py --max-train 300 --max-test 100 --local-steps 5
    python benchmarks/round_time.py --model smollm2-135m --task gsm8k --max-length 160 \\
        --batch-size 4 --max-test 10 --max-new-tokens 40 --local-steps 4
    python benchmarks/round_time.py --engines local --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from proc_memory import run_sampled  # noqa: E402

PARTS = (
    "train",
    "train_max",
    "train_wall",
    "setup",
    "evaluate",
    "aggregate",
    "apply",
    "checkpoint",
)
SUMMED = ("train", "setup", "evaluate", "aggregate", "apply", "checkpoint")
CLIENT_ACTOR = "ray::ClientAppActor"


def run_measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Runs ``cmd``; its wall seconds and peak memory (RSS and PSS: tree, virtual clients)."""
    with open(log, "w") as out:
        done, peaks, wall = run_sampled(cmd, env, stdout=out, group=CLIENT_ACTOR)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}); see {log}")
    return {
        "wall": wall,
        "peak_rss": peaks.rss,
        "peak_pss": peaks.pss,
        "peak_rss_clients": peaks.group_rss,
        "peak_pss_clients": peaks.group_pss,
        "peak_rss_by_name": peaks.by_name_rss,
        "peak_pss_by_name": peaks.by_name_pss,
        "sampler_cpu": peaks.sampler_cpu,
    }


def run_args(args) -> list[str]:
    """The job's ``fedexlora run`` options (the README's defaults where not given)."""
    out = ["--model", args.model, "--task", args.task, "--method", args.method]
    out += ["--clients", str(args.clients), "--rounds", str(args.rounds)]
    for flag in ("max_train", "max_test", "local_steps", "max_length", "batch_size",
                 "max_new_tokens"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out + list(args.extra)


def one_engine(engine: str, args, work: Path) -> dict:
    """One run of the job on ``engine``; its rows' splits and its memory."""
    out = work / engine
    cmd = [sys.executable, "-m", "fedexlora", "run", *run_args(args), "--engine", engine]
    cmd += ["--out", str(out), "--no-progress"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    res = run_measured(cmd, env, work / f"{engine}.log")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    res["rows"] = [
        {"round": r["round"], "metric": next(iter(r["metrics"].values()), None),
         **r["split_seconds"]}
        for r in rows
    ]  # fmt: skip
    res["engine"], res["cmd"] = engine, " ".join(cmd[1:])
    return res


def ratios(row: dict) -> dict:
    """``other`` and the goal's ratios of one round's split."""
    total = row["total"]
    known = sum(row[p] or 0.0 for p in SUMMED)
    out = {"other": total - known}
    if row["train"] is not None:
        out["ratio"] = total / (row["train"] + row["evaluate"])
        wall = row.get("train_wall", row["train"])  # rows from before it: the sum
        out["ratio_wall"] = total / (wall + row["evaluate"])
    return out


def table(results: list[dict]) -> str:
    """A markdown table: one line per engine and round, then each engine's summary."""
    head = "| engine | round | metric | " + " | ".join(PARTS) + " | other | total | "
    head += "round / (train + eval) | round / (train_wall + eval) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results:
        for row in res["rows"]:
            r = ratios(row)
            cells = [res["engine"], str(row["round"]), f"{row['metric']:.4f}"]
            cells += ["n/a" if row.get(p) is None else f"{row[p]:.2f}" for p in PARTS]
            cells += [f"{r['other']:.2f}", f"{row['total']:.2f}"]
            cells += [f"{r['ratio']:.3f}" if "ratio" in r else "n/a"]
            cells += [f"{r['ratio_wall']:.3f}" if "ratio_wall" in r else "n/a"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Per engine: the steady rounds' median ratios, and peak memory against in-process."""
    local = next((r for r in results if r["engine"] == "local"), None)
    out = []
    for res in results:
        steady = res["rows"][1:] or res["rows"]
        rs = [ratios(r) for r in steady]
        line = f"{res['engine']}: median over rounds {[r['round'] for r in steady]}: "
        if all("ratio" in r for r in rs):
            line += f"round / (train + eval) {statistics.median(r['ratio'] for r in rs):.3f}, "
            line += "round / (train_wall + eval) "
            line += f"{statistics.median(r['ratio_wall'] for r in rs):.3f}; "
        line += f"wall {res['wall']:.0f} s; " + _memory(res, local)
        if "sampler_cpu" in res:  # what the memory sampling took from the run it measured
            line += (
                f"; the memory sampler's CPU {res['sampler_cpu']:.1f} s "
                f"({100 * res['sampler_cpu'] / res['wall']:.1f}% of one core)"
            )
        out.append(line)
        for kind in ("pss", "rss"):
            big = sorted(res.get(f"peak_{kind}_by_name", {}).items(), key=lambda kv: -kv[1])[:8]
            if big and any(v for _, v in big):
                out.append(
                    f"  peak {kind.upper()} by process: "
                    + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in big)
                )
    return "\n".join(out)


def _memory(res: dict, local: dict | None) -> str:
    """Peak memory, PSS (each shared page once: what the machine holds) then RSS summed."""
    parts = []
    for kind in ("pss", "rss"):
        total = res.get(f"peak_{kind}", 0)
        if not total:
            continue
        text = f"peak {kind.upper()} {total / 1e6:.0f} MB"
        ref = local.get(f"peak_{kind}") if local is not None and res is not local else None
        if ref:
            text += f" ({total / ref:.2f}x in-process)"
            clients = res.get(f"peak_{kind}_clients", 0)
            if clients:
                text += f", its virtual clients {clients / 1e6:.0f} MB"
                text += f" ({clients / ref:.2f}x in-process)"
        parts.append(text)
    return "; ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--task", default="bbc-news")
    ap.add_argument("--method", default="fedex")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-train", type=int, default=None)
    ap.add_argument("--max-test", type=int, default=None)
    ap.add_argument("--local-steps", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--engines", default="local,flower")
    ap.add_argument("--json", default=None, help="Write every figure here")
    ap.add_argument("--work", default=None, help="The runs' directory (default: a new temp)")
    ap.add_argument("extra", nargs="*", help="More `fedexlora run` options, after --")
    args = ap.parse_args(argv)
    results = []
    work = Path(args.work or tempfile.mkdtemp(prefix="round-time-"))
    work.mkdir(parents=True, exist_ok=True)
    for engine in args.engines.split(","):
        print(f"running {engine} in {work / engine} ...", flush=True)
        results.append(one_engine(engine, args, work))
    print(table(results))
    print()
    print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
