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
  (summed: clients one after another) plus its evaluation (goal: <= 1.15 in-process,
  <= 1.3 under Flower); under Flower also over the longest client's steps
  (``round / (train_max + eval)``, what bounds clients that train in parallel);
- the peak resident memory of each engine's whole process tree, sampled every 0.2 s
  from ``/proc``, and under Flower that of its virtual clients (Ray's ClientApp actors:
  processes named ``ray::ClientAppActor``) and of the rest by process name, against the
  in-process engine's (goal: <= 1.5x).

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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PARTS = ("train", "train_max", "setup", "evaluate", "aggregate", "apply", "checkpoint")
SUMMED = ("train", "setup", "evaluate", "aggregate", "apply", "checkpoint")
CLIENT_ACTOR = "ray::ClientAppActor"


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, resident bytes, name: the first word of its command line)."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        name = argv[0].decode(errors="replace") if argv and argv[0] else "?"
        if not name.startswith("ray::"):
            name = Path(name.split()[0]).name if name.strip() else "?"
            if name.startswith("python") and len(argv) > 2:  # python -m X / python X
                name = (argv[2] if argv[1] == b"-m" else argv[1]).decode(errors="replace")
                name = Path(name).name
        out[int(entry)] = (int(fields[1]), int(fields[21]) * page, name)
    return out


def _tree(pid: int) -> dict[str, int]:
    """Resident bytes of ``pid`` and its descendants, summed by process name."""
    procs = _procs()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    by_name: dict[str, int] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in procs:
            _, rss, name = procs[p]
            by_name[name] = by_name.get(name, 0) + rss
        stack.extend(children.get(p, []))
    return by_name


def run_measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Runs ``cmd``; its wall seconds, peak tree RSS, and peak RSS by process name."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        peak, by_name, done = [0, 0], {}, threading.Event()

        def sample():
            while not done.is_set():
                tree = _tree(proc.pid)
                total = sum(tree.values())
                clients = sum(v for k, v in tree.items() if k.startswith(CLIENT_ACTOR))
                peak[0], peak[1] = max(peak[0], total), max(peak[1], clients)
                for k, v in tree.items():
                    by_name[k] = max(by_name.get(k, 0), v)
                time.sleep(0.2)

        t = threading.Thread(target=sample, daemon=True)
        t0 = time.perf_counter()
        t.start()
        proc.wait()
        done.set()
        t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return {
        "wall": time.perf_counter() - t0,
        "peak_rss": peak[0],
        "peak_rss_clients": peak[1],
        "peak_rss_by_name": by_name,
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
        out["ratio_max"] = total / (row["train_max"] + row["evaluate"])
    return out


def table(results: list[dict]) -> str:
    """A markdown table: one line per engine and round, then each engine's summary."""
    head = "| engine | round | metric | " + " | ".join(PARTS) + " | other | total | "
    head += "round / (train + eval) | round / (train_max + eval) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results:
        for row in res["rows"]:
            r = ratios(row)
            cells = [res["engine"], str(row["round"]), f"{row['metric']:.4f}"]
            cells += ["n/a" if row[p] is None else f"{row[p]:.2f}" for p in PARTS]
            cells += [f"{r['other']:.2f}", f"{row['total']:.2f}"]
            cells += [f"{r['ratio']:.3f}" if "ratio" in r else "n/a"]
            cells += [f"{r['ratio_max']:.3f}" if "ratio_max" in r else "n/a"]
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
            line += "round / (train_max + eval) "
            line += f"{statistics.median(r['ratio_max'] for r in rs):.3f}; "
        line += f"wall {res['wall']:.0f} s; peak RSS {res['peak_rss'] / 1e6:.0f} MB"
        if local is not None and res is not local:
            line += f" ({res['peak_rss'] / local['peak_rss']:.2f}x in-process)"
            if res["peak_rss_clients"]:
                line += (
                    f", its virtual clients {res['peak_rss_clients'] / 1e6:.0f} MB "
                    f"({res['peak_rss_clients'] / local['peak_rss']:.2f}x in-process)"
                )
        out.append(line)
        big = sorted(res["peak_rss_by_name"].items(), key=lambda kv: -kv[1])[:8]
        out.append("  peak RSS by process: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in big))
    return "\n".join(out)


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
