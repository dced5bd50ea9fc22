"""Why secure aggregation sends each number as two limbs: one limb is far from exact.

SecAgg+ sums integers modulo 2**32, so Flower's quantizer gives one number about 30 bits
over ``[-C, C]`` (``C = 256`` here). FedEx-LoRA's products ``B_i A_i`` are 1e-4 to 1e-8 of
the factors' size and its residual is a small difference of two sums, so one limb cannot
carry them; fedex-lora sends two (``fedexlora.secagg.encoding.Quantization``, 52 bits in
all). This script runs the same short FedEx-LoRA job with ``--secure-aggregation`` twice
on the in-process engine, with the limbs fedex-lora uses and with one limb (Flower's
quantizer as it is: ``Quantization.for_clients`` asked for 30 bits), and prints each
round's ``effective_deviation`` (the model against the ideal average of the clients'
own uploads, relative to the round's update, measured by the engine). Deterministic for
the configuration (the quantizer's stochastic rounding is seeded): no timing.

Usage::

    python benchmarks/secagg_limbs.py                 # MiniLM, 3 clients, 1 round
    python benchmarks/secagg_limbs.py --rounds 2 --local-steps 4
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def run(cfg, bits: int | None) -> list[dict]:
    """The rows of ``cfg`` with ``bits`` bits per number (``None``: fedex-lora's own)."""
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.secagg.encoding import Quantization

    original = Quantization.__dict__["for_clients"]
    if bits is not None:
        inner, forced = original.__func__, bits

        def fewer_bits(cls, clients, *, clip=256.0, bits=52):
            return inner(cls, clients, clip=clip, bits=forced)

        Quantization.for_clients = classmethod(fewer_bits)
    try:
        with tempfile.TemporaryDirectory(prefix="fedexlora-limbs-") as tmp:
            return run_experiment(cfg, Path(tmp), progress=False)
    finally:
        Quantization.for_clients = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    from fedexlora.config import RunConfig
    from fedexlora.secagg.encoding import Quantization

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = RunConfig(
        model=args.model,
        methods=["fedex"],
        num_clients=args.clients,
        rounds=args.rounds,
        local_steps=args.local_steps,
        lr=args.lr,
        max_length=32,
        max_test=20,
        secure_aggregation=True,
        fp32_side_branch=False,  # folded, as measured in docs/PRIVACY.md (its floor: fp32's)
    ).validate()
    print(
        f"{args.model}, fedex, {args.clients} clients, {args.rounds} round(s) of "
        f"{args.local_steps} local steps, lr {args.lr:g}, --secure-aggregation\n"
    )
    print("| limbs per number | bits in all | effective deviation per round (max over layers) |")
    print("|---|---|---|")
    for bits in (None, 30):
        q = Quantization.for_clients(args.clients, bits=52 if bits is None else bits)
        rows = run(cfg, bits)
        devs = ", ".join(f"{r['effective_deviation']['max']:.2e}" for r in rows)
        label = "fedex-lora's" if bits is None else "Flower's quantizer as it is"
        total = q.limbs * (q.target_range.bit_length() - 1)
        print(f"| {q.limbs} ({label}) | {total} | {devs} |")


if __name__ == "__main__":
    main()
