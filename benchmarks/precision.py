"""Exactness, memory and speed per base precision (fp32, bf16, nf4) on SmolLM2-135M.

For each precision this runs a federated FedEx-LoRA job in a fresh subprocess (the
embedded SmolLM2-135M on the embedded GSM8K items, LoRA r=8 on all attention and MLP
projections, 3 clients, one local step each per round, so that the residual grows as it
would with longer training) and reports:

- the exactness measured on the model every round (``effective_deviation``, max over
  layers: the model's effective weights against the ideal average of the clients'
  models, relative to the round's update);
- the side branch's bytes (SI units) after rounds 1, 3 and 10 (``–`` for a round the run
  did not reach; an fp32 base has none), against the adapted layers' own bytes
  in the base's precision (what the goal compares it with);
- the child's peak RSS (``ru_maxrss``) and the model's resident bytes (its parameters
  and buffers: an fp32 base's ``W0`` included, its record of folded residuals not);
- local training speed (steps per second) after the last round, with the side branch
  full, as a ratio to the fp32 run (where residuals are folded into the weights).

Usage::

    python benchmarks/precision.py                         # fp32, bf16, nf4; 10 rounds
    python benchmarks/precision.py --precisions nf4 --side-rank 32 --rounds 10
    python benchmarks/precision.py --json precision.json
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

CHECK_ROUNDS = (1, 3, 10)


def child(args) -> dict:
    """One precision, in this process: the federated run, then the timed steps."""
    import torch

    from fedexlora.bridge.fold import side_nbytes
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.config import RunConfig
    from fedexlora.run.build import autocast_dtype, new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.local import train_local

    torch.set_num_threads(args.threads)
    prec = args.child
    kw = {"quantization": prec} if prec in ("nf4", "fp4", "int8") else {"dtype": prec}
    cfg = RunConfig(
        model="smollm2-135m",
        task="gsm8k",
        methods=["fedex"],
        num_clients=3,
        rounds=args.rounds,
        local_steps=1,
        batch_size=2,
        max_length=64,
        max_test=1,
        max_new_tokens=1,
        lr=2e-3,
        side_rank=args.side_rank if prec != "fp32" else None,
        fp32_side_branch=False,  # fp32: the fold into the weights (the side branch: bf16)
        **kw,
    ).validate()
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    layers = lora_layers(model)

    def layer_bytes(layer) -> int:
        base = layer.get_base_layer()
        n = base.weight.numel() * base.weight.element_size()
        qs = getattr(base.weight, "quant_state", None)
        if qs is not None:  # 4-bit block scales
            n += qs.absmax.numel() * qs.absmax.element_size()
        if getattr(base.weight, "SCB", None) is not None:  # int8 row scales
            n += base.weight.SCB.numel() * base.weight.SCB.element_size()
        return n

    adapted = sum(layer_bytes(layer) for layer in layers.values())
    side, rounds_s = {}, []

    def after(row, server, mdl):
        rounds_s.append(row["seconds"])
        if row["round"] in CHECK_ROUNDS:
            side[row["round"]] = side_nbytes(mdl)

    rows, model, _ = run_method(cfg, "fedex", prep, model=model, progress=False, after_round=after)
    data = prep.train.subset(prep.parts[0])
    t0 = time.perf_counter()
    train_local(
        model,
        data,
        steps=args.steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        progress=False,
        autocast=autocast_dtype(cfg),
    )
    steps_per_s = args.steps / (time.perf_counter() - t0)
    resident = sum(t.numel() * t.element_size() for t in model.parameters())
    resident += sum(t.numel() * t.element_size() for t in model.buffers())
    return {
        "precision": prec,
        "side_rank": cfg.side_rank,
        "effective_deviation_max": [r["effective_deviation"]["max"] for r in rows],
        "approximation_gap_max": [r.get("approximation_gap", {}).get("max") for r in rows],
        "side_bytes": side if cfg.side_branch else None,  # fp32: folded into the weights
        "adapted_layer_bytes": adapted,
        "model_bytes": resident,
        "steps_per_s": steps_per_s,
        "round_seconds": rounds_s,
    }


def run_child(prec: str, args, tmp: Path) -> dict:
    out = tmp / f"{prec}.json"
    cmd = [sys.executable, __file__, "--child", prec, "--out-json", str(out)]
    cmd += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    cmd += ["--threads", str(args.threads)]
    if args.side_rank is not None:
        cmd += ["--side-rank", str(args.side_rank)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log = tmp / f"{prec}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{prec} failed; see {log}:\n{log.read_text()[-3000:]}")
    res = json.loads(out.read_text())
    res["peak_rss"] = usage.ru_maxrss * 1024
    return res


def side_cells(side_bytes: dict | None, rounds: int) -> str:
    """The side branch's bytes after each of :data:`CHECK_ROUNDS` that the run reached.

    A round the run did not reach is ``–``, not ``0 B``: zero is a measurement (round 1
    of one local step, whose residual is exactly zero since every client's ``A`` is
    still the shared initial one), a missing round is not. ``None``: the base has no side
    branch (fp32: the residuals are folded into the weights).
    """
    from fedexlora.core.units import format_bytes

    if side_bytes is None:
        return "none (folded into the weights)"
    return " / ".join(
        format_bytes(side_bytes[str(k)]) if str(k) in side_bytes else "–"
        for k in CHECK_ROUNDS
        if k <= max(rounds, CHECK_ROUNDS[0])
    )


def main() -> None:
    from fedexlora.core.units import format_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="fp32,bf16,nf4")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="timed local steps after the run")
    ap.add_argument("--side-rank", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.out_json.write_text(json.dumps(child(args)))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="fedexlora-precision-") as tmp:
        for prec in [p.strip() for p in args.precisions.split(",") if p.strip()]:
            print(f"running {prec} ...", flush=True)
            results.append(run_child(prec, args, Path(tmp)))
    ref = next((r for r in results if r["precision"] == "fp32"), None)
    print(
        f"\nSmolLM2-135M, 3 clients, r=8 on all projections, {args.rounds} rounds x 1 step, "
        f"side_rank={args.side_rank}, {args.threads} threads\n"
    )
    shown = " / ".join(str(k) for k in CHECK_ROUNDS if k <= max(args.rounds, CHECK_ROUNDS[0]))
    head = "| base | max effective deviation (all rounds) | effective deviation per round "
    head += f"| side branch after rounds {shown} | adapted layers in base precision "
    head += "| model bytes | peak RSS | "
    head += "train steps/s (vs fp32) |"
    print(head)
    print("|" + "---|" * 9)
    for r in results:
        dev = max(r["effective_deviation_max"])
        side = side_cells(r["side_bytes"], args.rounds)
        per_round = ", ".join(f"{d:.1e}" for d in r["effective_deviation_max"])
        rel = f" ({r['steps_per_s'] / ref['steps_per_s']:.2f}x)" if ref else ""
        name = r["precision"] + (f", side-rank {r['side_rank']}" if r["side_rank"] else "")
        print(
            f"| {name} | {dev:.2e} | {per_round} | {side} | "
            f"{format_bytes(r['adapted_layer_bytes'])} | {format_bytes(r['model_bytes'])} | "
            f"{format_bytes(r['peak_rss'])} | {r['steps_per_s']:.2f}{rel} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
