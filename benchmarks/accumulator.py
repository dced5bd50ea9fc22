"""What one round's fold costs an fp32 layer, as its accumulated residual grows.

An fp32 layer keeps what was folded into it (``fedexlora.core.side.SideBranch`` without
re-factoring) and is rebuilt as ``W0 + U V`` with one ``addmm`` each round
(``fedexlora.bridge.adapters``). So a round's fold costs one concatenation and one ``addmm``
whose inner size is the accumulated rank, until dense is smaller; then one dense
product (once) and a dense add each round. This times both parts for a 4096x4096 layer
whose accumulator already holds ``t`` rounds of rank-144 residuals (k=10 clients, r=16),
next to the released code's per-round server step for the same layer
(``benchmarks/aggregation.py``'s ``naive``).

Usage::

    python benchmarks/accumulator.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.side import SideBranch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--q", type=int, default=144, help="rank of one round's residual")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = n = args.size
    q = args.q
    g = torch.Generator().manual_seed(0)
    base0 = torch.randn(d, n, generator=g) * 0.02
    w = torch.empty(d, n)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {d}x{n}, residual rank {q}")
    print("| rounds held | accumulated | add ms | rebuild ms | held after |")
    print("|---|---|---|---|---|")
    for t in (1, 4, 9, 14, 20):
        acc = SideBranch(d, n, refactor=False)
        U = torch.randn(d, q * t, generator=g, dtype=torch.float64) * 1e-3
        V = torch.randn(q * t, n, generator=g, dtype=torch.float64)
        acc.set(
            Residual((d, n), U=U, V=V) if q * t * (d + n) < d * n else Residual((d, n), dense=U @ V)
        )
        new = Residual(
            (d, n),
            U=torch.randn(d, q, generator=g, dtype=torch.float64) * 1e-3,
            V=torch.randn(q, n, generator=g, dtype=torch.float64),
        )
        held = "dense" if acc.dense is not None else f"rank {acc.rank}"
        t0 = time.perf_counter()
        acc.add(new)
        t1 = time.perf_counter()
        if acc.dense is not None:
            torch.add(base0, acc.dense, out=w)
        else:
            torch.addmm(base0, acc.U, acc.V, out=w)
        t2 = time.perf_counter()
        after = "dense" if acc.dense is not None else f"rank {acc.rank}"
        print(f"| {t} | {held} | {1000 * (t1 - t0):.0f} | {1000 * (t2 - t1):.0f} | {after} |")


if __name__ == "__main__":
    main()
