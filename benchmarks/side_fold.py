"""The client's fold: one side branch taking a residual a round, re-factored on the ladder
or every round, timed and checked against the hand sum.

A :class:`fedexlora.core.side.SideBranch` of ``--shape d n`` receives ``--rounds`` rounds'
residuals ``Σ p_i B_i A_i − B̄ Ā`` of ``--k`` clients of rank ``--r`` in general position
(seeded Gaussian factors, :func:`fedexlora.core.factors.centred_residual`: ``(k − 1) r``
columns a round), the same residuals to both variants:

- ``ladder``: the library's fold, which appends the factors and re-factors the sum to
  numerical rank only when its column count passes a power of
  :data:`fedexlora.core.side.REFACTOR_GROWTH`;
- ``every round``: the same fold with every round made a rung (``passes_rung`` patched to
  say yes), which is how the side branch folded before 2026-12-06.

Printed per variant: the seconds of all folds (``time.perf_counter`` around ``add``), the
slowest fold, the columns held at the end, and the held correction's distance from the
hand sum of the residuals in fp64, relative to that sum.

Usage::

    python benchmarks/side_fold.py --shape 14336 4096 --k 2 --r 16 --rounds 60
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from fedexlora.core import side as side_module
from fedexlora.core.factors import Residual, centred_residual
from fedexlora.core.side import SideBranch


def residuals(d: int, n: int, k: int, r: int, rounds: int, seed: int = 0) -> list[Residual]:
    """``rounds`` residuals of ``k`` equally weighted clients' seeded rank-``r`` factors."""
    g = torch.Generator().manual_seed(seed)
    p = torch.full((k,), 1.0 / k, dtype=torch.float64)
    out = []
    for _ in range(rounds):
        A = torch.randn(k, r, n, generator=g, dtype=torch.float64) * 0.01
        B = torch.randn(k, d, r, generator=g, dtype=torch.float64) * 0.01
        out.append(centred_residual(A, B, p))
    return out


def fold_all(d: int, n: int, parts: list[Residual], *, every_round: bool) -> dict:
    """Folds ``parts`` into a fresh side branch; seconds, columns and the branch."""
    side = SideBranch(d, n)
    times = []
    patch = (
        mock.patch.object(side_module, "passes_rung", lambda before, after: after > before)
        if every_round
        else mock.patch.object(side_module, "passes_rung", side_module.passes_rung)
    )
    with patch:
        for R in parts:
            t = time.perf_counter()
            side.add(R)
            times.append(time.perf_counter() - t)
    return {"seconds": sum(times), "slowest": max(times), "columns": side.rank, "side": side}


def relative_error(side: SideBranch, parts: list[Residual]) -> float:
    """``||held − Σ parts|| / ||Σ parts||``, in fp64."""
    ideal = torch.zeros(side.shape, dtype=torch.float64)
    for R in parts:
        ideal += R.to_dense()
    return float(torch.linalg.norm(side.to_dense() - ideal) / torch.linalg.norm(ideal))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[14336, 4096], metavar=("D", "N"))
    ap.add_argument("--k", type=int, default=2, help="clients a round")
    ap.add_argument("--r", type=int, default=16, help="their LoRA rank")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    d, n = args.shape
    parts = residuals(d, n, args.k, args.r, args.rounds, args.seed)
    print(
        f"side branch {d} x {n}, k={args.k}, r={args.r}, {args.rounds} rounds "
        f"({(args.k - 1) * args.r} new columns a round); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| fold | seconds, all rounds | slowest fold s | columns held | error vs hand sum |")
    print("|---|---|---|---|---|")
    got = {}
    for name, every in (("every round", True), ("ladder", False)):
        res = fold_all(d, n, parts, every_round=every)
        got[name] = res
        err = relative_error(res["side"], parts)
        print(
            f"| {name} | {res['seconds']:.2f} | {res['slowest']:.2f} | {res['columns']} | "
            f"{err:.1e} |"
        )
    ratio = got["every round"]["seconds"] / max(got["ladder"]["seconds"], 1e-9)
    print(f"\nthe ladder's folds take 1/{ratio:.1f} of the every-round folds' seconds")


if __name__ == "__main__":
    main()
