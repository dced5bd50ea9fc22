"""Many clients, few sampled: memory, download, time per round, and exactness.

Each configuration runs in its own process (``fedexlora run``'s engines on the generated
``synthetic`` task, IID, fedex), so its peak RSS is its own. For each one it reports:

- peak RSS of the whole process tree (sampled every 0.2 s; Ray's workers included for
  ``--engine flower``);
- the server's state in bytes (:meth:`fedexlora.server.Server.nbytes`), at its largest,
  against the bound: one dense ``(d, n)`` per adapted layer plus the latest round's
  residual;
- download per sampled client, mean and max (catch-up and reset payloads included);
- seconds per round (median over the rounds after the first);
- exactness (in-process engine): before it trains, every sampled client's model is
  rebuilt from what that client held (the global model at the version it last received,
  kept on disk for this check) plus its payload, through
  :func:`fedexlora.bridge.steps.apply_payload`, on a separate copy of the model; the worst
  ``||W_client - W_global|| / ||W_global||`` over its adapted layers' effective weights
  is reported, and the same relative to the accumulated update ``||W_global - W0||``.
  The check's model copy is in every in-process run's RSS alike.

Usage::

    python benchmarks/scale.py --model tiny                    # 10/100/1000 clients, 1%
    python benchmarks/scale.py --model minilm --rounds 50
    python benchmarks/scale.py --model tiny --engine flower --clients 1000
    python benchmarks/scale.py --model tiny --clients 10,100,1000 --sampled 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from proc_memory import run_sampled  # noqa: E402


def tiny_model(dest: Path) -> str:
    """A tiny random BERT (hidden 32, 2 layers) with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from fedexlora.bridge.models import resolve_model

    if (dest / "config.json").exists():
        return str(dest)
    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    BertForSequenceClassification(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    return str(dest)


def config(args, clients: int, fraction: float):
    from fedexlora.config import RunConfig

    per_client = args.per_client
    # 80% train split; at least max_test test examples, so every run evaluates alike
    size = max(int(clients * per_client / 0.8), int(args.max_test / 0.2)) + 10
    return RunConfig(
        model=args.model_path,
        task=f"synthetic:{size}",
        methods=["fedex"],
        num_clients=clients,
        partition="iid",
        min_partition_size=max(1, per_client // 2),
        rounds=args.rounds,
        local_steps=args.local_steps,
        batch_size=8,
        max_length=24,
        lr=5e-3,
        lora_r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        fraction=fraction,
        max_test=args.max_test,
        keep_checkpoints=1,
    )


def child(args) -> dict:
    """One configuration, in this process (in-process engine)."""
    import torch
    from safetensors.torch import load_file, save_file

    from fedexlora.bridge.fold import effective_weight, load_side_state, side_state
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.bridge.steps import apply_payload
    from fedexlora.run.build import new_model, new_server, prepare
    from fedexlora.run.client_step import local_update
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    torch.set_num_threads(args.threads)
    cfg = config(args, args.clients, args.fraction)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    server = new_server(cfg, "fedex", model)
    probe = new_model(cfg, task, "fedex")[0] if args.verify else None
    w0 = (
        {n: effective_weight(x, lora=False) for n, x in lora_layers(probe).items()}
        if probe is not None
        else {}
    )
    snaps = Path(tempfile.mkdtemp(prefix="scale-snap-"))
    save_file({}, str(snaps / "v0.safetensors"))
    held: dict[int, int] = {}
    downloads: list[int] = []
    worst = {"model": 0.0, "update": 0.0}
    state_bytes: list[dict] = []
    seconds: list[float] = []

    def on_payload(c, payload, glob):
        downloads.append(payload.nbytes)
        if probe is not None:
            snap = load_file(str(snaps / f"v{held.get(c, 0)}.safetensors"))
            load_side_state(probe, snap)  # what client c folded: its last version
            apply_payload(probe, payload)
            num = den = upd = 0.0
            for (name, a), (_, g) in zip(lora_layers(probe).items(), lora_layers(glob).items()):
                wa, wg = effective_weight(a), effective_weight(g)
                num += float((wa - wg).pow(2).sum())
                den += float(wg.pow(2).sum())
                upd += float((effective_weight(g, lora=False) - w0[name]).pow(2).sum())
            worst["model"] = max(worst["model"], (num / den) ** 0.5)
            if upd > 0:
                worst["update"] = max(worst["update"], (num / upd) ** 0.5)
        held[c] = payload.version

    def after_round(row, server, mdl):
        seconds.append(row["seconds"])
        parts = server.nbytes()
        newest = server.history.get(max(server.history)) if server.history else {}
        limit = sum(4 * i.shape[0] * i.shape[1] for i in server.layers.values()) + sum(
            r.nbytes for r in newest.values()
        )
        parts["bound"] = limit
        state_bytes.append(parts)
        if probe is not None and not (snaps / f"v{server.version}.safetensors").exists():
            save_file(
                {k: v.contiguous() for k, v in side_state(mdl).items()},
                str(snaps / f"v{server.version}.safetensors"),
            )

    # Each client's payload is checked as it starts training, while the shared model holds
    # the global model: the engine's payload_for and local_update are wrapped (this child
    # process runs one configuration and exits).
    sent = {}
    real_payload_for = server.payload_for

    def payload_for(c):
        sent[c] = real_payload_for(c)
        return sent[c]

    def watched_update(run_cfg, method, mdl, data, rnd, c, **kwargs):
        on_payload(c, sent.pop(c), mdl)
        return local_update(run_cfg, method, mdl, data, rnd, c, **kwargs)

    server.payload_for = payload_for
    try:
        rows, _, server = run_method(
            cfg, "fedex", prep, progress=False, model=model, server=server,
            after_round=after_round, local_update=watched_update,
        )  # fmt: skip
    finally:
        del server.payload_for
    import resource

    return {
        "engine": "local",
        "clients": args.clients,
        "fraction": args.fraction,
        "sampled_per_round": len(rows[-1]["sampled"]),
        "rounds": len(rows),
        "server_bytes_max": max(s["total"] for s in state_bytes),
        "server_history_base_max": max(s["history"] + s["base_delta"] for s in state_bytes),
        "state_over_bound_max": max(
            (s["history"] + s["base_delta"]) / s["bound"] for s in state_bytes
        ),
        "download_mean": sum(downloads) / len(downloads),
        "download_max": max(downloads),
        "seconds_per_round": _median(seconds[1:] or seconds),
        "worst_model_rel": worst["model"] if probe is not None else None,
        "worst_update_rel": worst["update"] if probe is not None else None,
        "payloads_checked": len(downloads) if probe is not None else 0,
        "accuracy": rows[-1]["metrics"].get("accuracy"),
        "self_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    }


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run_measured(cmd: list[str], env: dict) -> tuple[int, str, float]:
    """Runs ``cmd``; returns (peak tree RSS bytes, stdout, wall seconds)."""
    done, peaks, wall = run_sampled(cmd, env, stdout=subprocess.PIPE)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {done.returncode}")
    return peaks.rss, done.stdout, wall


def flower_run(args, clients: int, fraction: float, env: dict) -> dict:
    """``fedexlora run --engine flower`` on the same configuration."""
    cfg = config(args, clients, fraction)
    cfg.engine = "flower"
    work = Path(tempfile.mkdtemp(prefix="scale-flower-"))
    (work / "config.toml").write_text(cfg.to_toml())
    cmd = [
        sys.executable, "-m", "fedexlora", "run", "--config", str(work / "config.toml"),
        "--out", str(work / "run"), "--no-progress",
    ]  # fmt: skip
    peak, _, wall = run_measured(cmd, env)
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    secs = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
    downs = [r["bytes_down"] / max(1, len(r["sampled"])) for r in rows]
    return {
        "engine": "flower",
        "clients": clients,
        "fraction": fraction,
        "sampled_per_round": len(rows[-1]["sampled"]),
        "rounds": len(rows),
        "download_mean": sum(downs) / len(downs),
        "download_max": max(r["bytes_down_max"] for r in rows),
        "server_bytes_max": max(r["server_bytes"]["total"] for r in rows),
        "seconds_per_round": _median(secs),
        "wall_seconds": wall,
        "accuracy": rows[-1]["metrics"].get("accuracy"),
        "peak_rss_mb": peak / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, minilm, or a model path")
    ap.add_argument("--engine", default="local", choices=["local", "flower"])
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--sampled", type=int, default=None, help="sample this many per round instead")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--local-steps", type=int, default=1)
    ap.add_argument("--per-client", type=int, default=16, help="training examples per client")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--max-test", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model == "tiny":
        args.model_path = tiny_model(Path(tempfile.gettempdir()) / "fedexlora-scale-tiny")
    else:
        args.model_path = args.model
    if args.child:
        args.clients = int(args.clients)
        print("RESULT " + json.dumps(child(args)))
        return

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for n in [int(x) for x in args.clients.split(",")]:
        fraction = args.fraction if args.sampled is None else min(1.0, args.sampled / n)
        if args.engine == "flower":
            res = flower_run(args, n, fraction, env)
        else:
            cmd = [
                sys.executable, str(HERE), "--child", "--model", args.model,
                "--clients", str(n), "--fraction", str(fraction), "--rounds", str(args.rounds),
                "--local-steps", str(args.local_steps), "--per-client", str(args.per_client),
                "--rank", str(args.rank), "--max-test", str(args.max_test),
                "--threads", str(args.threads),
            ] + ([] if args.verify else ["--no-verify"])  # fmt: skip
            peak, out, wall = run_measured(cmd, env)
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            res = json.loads(line[7:])
            res["peak_rss_mb"] = peak / 1e6
            res["wall_seconds"] = wall
        results.append(res)
        print(json.dumps(res), flush=True)
    print()
    print(f"model {args.model}, engine {args.engine}, {args.rounds} rounds, "
          f"{args.local_steps} local step(s), r={args.rank}")  # fmt: skip
    head = "| clients | sampled/round | peak RSS MB | server state kB (worst ratio to bound) | "
    head += "download/client kB mean / max | s/round | worst rel. error (model / update) |"
    print(head)
    print("|" + "---|" * 7)
    for r in results:
        state = (
            f"{r['server_history_base_max'] / 1e3:.0f} ({r['state_over_bound_max']:.2f})"
            if "server_history_base_max" in r
            else "-"
        )
        down = f"{r['download_mean'] / 1e3:.1f}" + (
            f" / {r['download_max'] / 1e3:.1f}" if "download_max" in r else ""
        )
        exact = (
            f"{r['worst_model_rel']:.1e} / {r['worst_update_rel']:.1e}"
            if r.get("worst_model_rel") is not None
            else "-"
        )
        print(
            f"| {r['clients']} | {r['sampled_per_round']} | {r['peak_rss_mb']:.0f} | {state} | "
            f"{down} | {r['seconds_per_round']:.3f} | {exact} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
