"""How much of an update is lost when it is rounded into a bf16 (or fp16) weight.

Why fedex-lora keeps the residual of a half-precision base in an fp32 side branch
(docs/LARGE_MODELS.md): bf16 keeps 8 bits of mantissa, so adding an update that is small
next to the weight and rounding the sum back to bf16 drops most of it. This script takes
the embedded MiniLM's pretrained ``query`` and ``value`` weights (the layers LoRA adapts
by default), rounds them to bf16, adds a seeded Gaussian update whose Frobenius norm is a
given fraction of the weight's, rounds the sum to bf16 again, and prints the fraction of
the update lost, ``||round(W + U) - W - U|| / ||U||`` (all in fp64 once rounded).
Deterministic: no timing.

Usage::

    python benchmarks/bf16_rounding.py                  # updates 1e-2, 1e-3, 1e-4
    python benchmarks/bf16_rounding.py --sizes 1e-3 --dtype fp16
"""

from __future__ import annotations

import argparse

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lost_fraction(weight: torch.Tensor, size: float, dtype: torch.dtype, seed: int = 0) -> float:
    """The fraction of an update of relative norm ``size`` lost by rounding into ``weight``.

    Args:
        weight: The pretrained weight (any float dtype); it is rounded to ``dtype`` first,
            as a half-precision base holds it.
        size: ``||U|| / ||W||``.
        dtype: The weight's storage dtype.
        seed: Seed of the update's draw.

    Returns:
        ``||round(W + U) - (W + U)|| / ||U||``, computed in fp64.
    """
    W = weight.to(dtype).double()
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(W.shape, generator=g, dtype=torch.float64)
    U *= size * torch.linalg.norm(W) / torch.linalg.norm(U)
    stored = (W + U).to(dtype).double()
    return float(torch.linalg.norm(stored - (W + U)) / torch.linalg.norm(U))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e-2,1e-3,1e-4", help="||U|| / ||W||, comma-separated")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args()
    from transformers import AutoModel

    from fedexlora.bridge.models import resolve_model

    model = AutoModel.from_pretrained(resolve_model("minilm").path)
    weights = {
        n: m.weight.detach()
        for n, m in model.named_modules()
        if n.endswith(("attention.self.query", "attention.self.value"))
    }
    dtype = DTYPES[args.dtype]
    print(f"MiniLM-L6, {len(weights)} query/value weights, {args.dtype} storage\n")
    print("| update / weight (Frobenius) | update lost: mean over layers | min | max |")
    print("|---|---|---|---|")
    for size in (float(s) for s in args.sizes.split(",")):
        lost = [lost_fraction(w, size, dtype, seed=i) for i, w in enumerate(weights.values())]
        print(f"| {size:g} | {sum(lost) / len(lost):.3f} | {min(lost):.3f} | {max(lost):.3f} |")


if __name__ == "__main__":
    main()
