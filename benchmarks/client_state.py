"""What a Flower client keeps between rounds: bytes of its ``context.state``.

A client keeps :func:`fedexlora.bridge.steps.client_state`: what payloads folded into each
adapted layer (factored while that is smaller, at most one fp32 ``(d, n)``) and its
adapter; never a base weight. With every client sampled every round, each client holds
what the server's global model holds, so one in-process run measures it: after rounds 1,
3 and 10, the bytes of ``client_state`` as the ClientApp stores it (an ``ArrayRecord``),
next to the fp32 copy of the adapted weights a client used to keep.

For a Llama-7B shape (32 blocks; q, k, v, o 4096x4096; gate, up 11008x4096; down
4096x11008; all adapted, r=32, 3 clients) the figure is computed, not run: each round
adds a residual of rank (k-1) r = 64 to every layer, kept factored while
``rank (d + n) < d n``, then dense, in fp32.

Usage::

    python benchmarks/client_state.py                 # minilm and smollm2-135m, fp32
    python benchmarks/client_state.py --models minilm --rounds 3
"""

from __future__ import annotations

import argparse
import os

CHECK_ROUNDS = (1, 3, 10)


def measure(model: str, rounds: int) -> list[tuple[int, int, int, int]]:
    """``(round, side bytes, adapter bytes, fp32 adapted-weight bytes)`` per check round."""
    from fedexlora.bridge.fold import folded_weights
    from fedexlora.bridge.steps import client_state
    from fedexlora.config import RunConfig
    from fedexlora.flower.records import to_array_record
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    smol = model.startswith("smollm2")
    cfg = RunConfig(
        model=model,
        task="gsm8k" if smol else "bbc-news",
        methods=["fedex"],
        num_clients=3,
        rounds=rounds,
        local_steps=1,
        batch_size=2,
        max_length=64,
        max_train=30 if smol else 150,
        max_test=2 if smol else 20,
        max_new_tokens=4,
        min_partition_size=5,
        lora_r=8,
        target_modules=(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            if smol
            else None
        ),
    )
    task = load_task_for(cfg)
    mdl, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    weights = sum(w.numel() * 4 for w in folded_weights(mdl).values())
    out = []

    def after(row, _server, m):
        if row["round"] in CHECK_ROUNDS:
            record = to_array_record(client_state(m))
            side = sum(a.numpy().nbytes for k, a in record.items() if k.startswith("side."))
            adapter = sum(a.numpy().nbytes for k, a in record.items() if k.startswith("adapter."))
            out.append((row["round"], side, adapter, weights))

    run_method(cfg, "fedex", prep, model=mdl, progress=False, after_round=after)
    return out


def llama7b(rounds=CHECK_ROUNDS, r=32, clients=3) -> list[tuple[int, int, int, int]]:
    """The same figures computed for a Llama-7B shape (fp32 accumulators)."""
    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    out = []
    for t in rounds:
        rank = (clients - 1) * r * t
        side = 32 * sum(min(rank * (d + n), d * n) * 4 for d, n in shapes)
        adapter = 32 * sum(r * (d + n) * 4 for d, n in shapes)
        weights = 32 * sum(d * n * 4 for d, n in shapes)
        out.append((t, side, adapter, weights))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm,smollm2-135m")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from fedexlora.core.units import format_bytes

    print("| model | after round | residual held | adapter | total | old: fp32 weight copy |")
    print("|---|---|---|---|---|---|")
    rows = [(m, measure(m, args.rounds)) for m in args.models.split(",") if m]
    rows.append(("Llama-7B shape (computed)", llama7b()))
    for name, figures in rows:
        for rnd, side, adapter, weights in figures:
            print(
                f"| {name} | {rnd} | {format_bytes(side)} | {format_bytes(adapter)} | "
                f"{format_bytes(side + adapter)} | {format_bytes(weights)} |"
            )


if __name__ == "__main__":
    main()
