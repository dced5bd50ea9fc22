"""A FedEx server step in every round, not only the first, against that round's fold.

Twenty rounds of one 4096x4096 fp32 layer (k=10 clients, r=16, so each round's residual
has rank (k-1) r = 144). Each round the same process times, on fresh client factors:

* ``aggregate``: ``fedexlora.aggregate(method="fedex")``, the exact factored residual;
* ``record``: the server's record of everything folded since W0
  (``Residual.concat([base_delta, residual], reduce=False)``, as ``Server.aggregate``
  keeps it for new clients: concatenated, dense once that is smaller);
* ``fold``: ``fedexlora.bridge.adapters.fold_residuals`` into a one-layer peft model: one
  ``W.addmm_(U, V)``, the residual recorded for the model's saved state while the record
  is smaller than the weight;
* ``floor``: one ``W.addmm_(U, V)`` of random rank-144 factors (that round's fold at its
  least).

It prints, per round, each part in ms and ``step / floor`` with ``step = aggregate +
record + fold``. No round changes the form of anything the fold touches.

Usage::

    python benchmarks/accumulator.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads [torch default]")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model

    from fedexlora.bridge.adapters import fold_residuals
    from fedexlora.core.aggregation import Residual, aggregate

    dev = torch.device(args.device)
    d = n = args.size
    k, r = args.clients, args.rank
    q = (k - 1) * r
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        return time.perf_counter() - t0, out

    base = torch.nn.Sequential(torch.nn.Linear(n, d, bias=False))
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"]))
    model.to(dev)
    layer = "base_model.model.0"
    W = torch.randn(d, n, device=dev) * 0.02
    g = torch.Generator().manual_seed(0)
    record = None
    print(
        f"torch {torch.__version__}, {dev}, {torch.get_num_threads()} threads, {d}x{n}, "
        f"k={k}, r={r}: each round's residual has rank {q}"
    )
    print("| round | aggregate ms | record ms | fold ms | step ms | floor ms | step/floor "
          "| record held |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for rnd in range(1, args.rounds + 1):
        A0 = torch.randn(r, n, generator=g) / n**0.5
        B0 = torch.randn(d, r, generator=g) / d**0.5
        As = [(A0 + 0.1 * torch.randn(r, n, generator=g) / n**0.5).to(dev) for _ in range(k)]
        Bs = [(B0 + 0.1 * torch.randn(d, r, generator=g) / d**0.5).to(dev) for _ in range(k)]
        Uf = torch.randn(d, q, generator=g).to(dev)
        Vf = torch.randn(q, n, generator=g).to(dev)
        t_agg, res = timed(aggregate, As, Bs)
        R = res.residual
        if record is None:
            t_rec, record = 0.0, R
        else:
            t_rec, record = timed(Residual.concat, [record, R], reduce=False)
        t_fold, _ = timed(fold_residuals, model, {layer: R})
        t_floor, _ = timed(W.addmm_, Uf, Vf, alpha=2.0)
        step = t_agg + t_rec + t_fold
        ratios.append(step / t_floor)
        held = "dense" if not record.is_factored else f"rank {record.rank}"
        print(
            f"| {rnd} | {1e3 * t_agg:.1f} | {1e3 * t_rec:.1f} | {1e3 * t_fold:.1f} "
            f"| {1e3 * step:.1f} | {1e3 * t_floor:.1f} | {step / t_floor:.2f} | {held} |"
        )
    print(
        f"\nstep/floor: median {statistics.median(ratios):.2f}, "
        f"max {max(ratios):.2f} (round {ratios.index(max(ratios)) + 1})"
    )


if __name__ == "__main__":
    main()
