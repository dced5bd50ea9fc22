"""A FedEx server step in every round, not only the first, against that round's fold.

Twenty rounds (by default) of one 4096x4096 fp32 layer, k=10 clients, r=16: each round's
residual has rank (k-1) r = 144, and the record of everything folded since W0 reaches
one dense ``d x n`` at round 15. Each round, in one process, on fresh client factors:

* ``server``: ``Server.aggregate(uploads, effective=False)`` of the k uploads, as both
  engines call it (validation, the exact factored residual, the new global state,
  FedIT's deviation for the row, and the record of the base delta that reset payloads
  are built from; the effective deviation is measured on the model by the engines),
  twice:

  - ``own``: a server that keeps its record itself (a user's loop with no model):
    concatenated factors while smaller than dense, then one dense ``d x n`` (formed once
    from all the factors, then added to every round);
  - ``model``: a server whose ``delta_source`` is the global model
    (``fedexlora.bridge.fold.folded_delta``, what both engines set): where the record
    would turn dense it is dropped, and read from the model when a reset payload or a
    checkpoint needs it;

* ``fold``: ``fedexlora.bridge.fold.fold_residuals`` of the round's residual into a
  one-layer peft model (one ``W.addmm_(U, V)``), the ``model`` server's source;
* ``floor``: one ``W.addmm_(U, V)`` of random rank-144 factors (that round's fold at its
  least);
* ``checkpoint``: ``state_dict()`` of the ``model`` server after the fold, as the engines
  checkpoint every round (it reads the model's delta; the first read after the server
  dropped its copy checks the model against the rounds that reached it). Not in ``step``.

It prints, per round, each part in ms and ``step / floor`` with ``step = server + fold``
for each kind of server; at the end the cost of one reset payload from each. With
``--profile``, it first runs one ``Server.aggregate`` of the same shape under cProfile on
a fresh server, after one warm-up call, and prints where that call spends its time (the
package's own functions, by cumulative time, and each one's share of the call).

Usage::

    python benchmarks/accumulator.py --threads 2
    python benchmarks/accumulator.py --threads 2 --rounds 0 --profile   # the profile only
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch


def profile_aggregate(server, ups) -> None:
    """Prints where one ``server.aggregate(ups, effective=False)`` spends its time.

    The package's own functions by cumulative time under cProfile, each with its share of
    the whole call (cProfile's overhead included, so read the shares, not the ms).
    """
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    server.aggregate(ups, effective=False)
    total = time.perf_counter() - t0
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [
        (cum, f"{Path(file).name}:{line} {func}")
        for (file, line, func), (_, _, _, cum, _) in stats.items()
        if "fedexlora" in file
    ]
    print(f"cProfile of one Server.aggregate: {1e3 * total:.1f} ms under the profiler")
    print("| function (fedexlora) | cumulative ms | share of the call |\n|---|---|---|")
    for cum, name in sorted(rows, reverse=True)[:12]:
        print(f"| {name} | {1e3 * cum:.1f} | {cum / total:.0%} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads [torch default]")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="cProfile one Server.aggregate first")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model

    from fedexlora import Server
    from fedexlora.bridge.adapters import get_state, layer_info
    from fedexlora.bridge.fold import fold_residuals, folded_delta
    from fedexlora.core.state import AdapterState
    from fedexlora.server import ClientUpload

    dev = torch.device(args.device)
    d = n = args.size
    k, r = args.clients, args.rank
    q = (k - 1) * r
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn, *a, **kw):
        sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        return time.perf_counter() - t0, out

    base = torch.nn.Sequential(torch.nn.Linear(n, d, bias=False))
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"]))
    model.to(dev)
    layer = "base_model.model.0"
    state, layers = get_state(model), layer_info(model)
    own = Server(state, layers, num_clients=k)
    held = Server(state, layers, num_clients=k)
    held.delta_source = functools.partial(folded_delta, model)
    W = torch.randn(d, n, device=dev) * 0.02
    g = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {dev}, {torch.get_num_threads()} threads, {d}x{n}, "
        f"k={k}, r={r}: each round's residual has rank {q}"
    )

    def uploads(gen: torch.Generator) -> list[ClientUpload]:
        A0 = torch.randn(r, n, generator=gen) / n**0.5
        B0 = torch.randn(d, r, generator=gen) / d**0.5
        return [
            ClientUpload(
                c,
                AdapterState(
                    {
                        layer: (
                            (A0 + 0.1 * torch.randn(r, n, generator=gen) / n**0.5).to(dev),
                            (B0 + 0.1 * torch.randn(d, r, generator=gen) / d**0.5).to(dev),
                        )
                    }
                ),
                10,
            )
            for c in range(k)
        ]

    if args.profile:  # a warm-up call first: a cold one also times torch's first calls
        prof_gen = torch.Generator().manual_seed(1)
        Server(state, layers, num_clients=k).aggregate(uploads(prof_gen), effective=False)
        profile_aggregate(Server(state, layers, num_clients=k), uploads(prof_gen))
    if args.rounds:
        print("| round | server own ms | server model ms | fold ms | floor ms "
              "| step/floor own | step/floor model | own record | model server holds "
              "| checkpoint ms (model) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"own": [], "model": []}
    for rnd in range(1, args.rounds + 1):
        ups = uploads(g)
        Uf = torch.randn(d, q, generator=g).to(dev)
        Vf = torch.randn(q, n, generator=g).to(dev)
        # as both engines call it: the effective deviation is measured on the model
        t_own, _ = timed(own.aggregate, ups, effective=False)
        t_held, outcome = timed(held.aggregate, ups, effective=False)
        t_fold, _ = timed(fold_residuals, model, outcome.residuals)
        # both engines checkpoint after every round: that read checks the model's delta
        # against the rounds since the server dropped its copy (not part of the step)
        t_ckpt, _ = timed(held.state_dict)
        t_floor, _ = timed(W.addmm_, Uf, Vf, alpha=2.0)
        step_own, step_held = t_own + t_fold, t_held + t_fold
        ratios["own"].append(step_own / t_floor)
        ratios["model"].append(step_held / t_floor)
        rec = own.base_delta[layer]
        own_held = "dense" if not rec.is_factored else f"rank {rec.rank}"
        model_held = (
            "nothing (the model holds it)"
            if layer in held.outgrown
            else f"rank {held.base_delta[layer].rank}"
        )
        print(
            f"| {rnd} | {1e3 * t_own:.1f} | {1e3 * t_held:.1f} | {1e3 * t_fold:.1f} "
            f"| {1e3 * t_floor:.1f} | {step_own / t_floor:.2f} | {step_held / t_floor:.2f} "
            f"| {own_held} | {model_held} | {1e3 * t_ckpt:.1f} |"
        )
    if not args.rounds:
        return
    for kind, rs in ratios.items():
        worst = max(rs)
        print(
            f"\nstep/floor, {kind} record: median {statistics.median(rs):.2f}, "
            f"max {worst:.2f} (round {rs.index(worst) + 1})"
        )
    for s, kind in ((own, "own"), (held, "model")):
        s.forget_client(0)
        t_reset, p = timed(s.payload_for, 0)
        print(f"a reset payload, {kind} record: {1e3 * t_reset:.1f} ms, {p.nbytes / 1e6:.1f} MB")
    gap = (own.delta(layer).to_dense() - held.delta(layer).to_dense()).abs().max()
    scale_ = float(own.delta(layer).to_dense().abs().max())
    print(f"max |own - model| / max |own| of the base delta: {float(gap) / scale_:.1e}")


if __name__ == "__main__":
    main()
