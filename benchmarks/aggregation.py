"""FedEx-LoRA server step: ours (factored residual, one addmm_) vs the released code's loop.

For every layer shape (d, n), client count k and rank r, the same process times four ways
of doing one layer's server step, that is aggregating k clients' (A_i, B_i) and folding
the residual into the base weight W (fp32 throughout, uniform weights, scale 2):

* ``naive``: what the released FedEx-LoRA code does (orientation fixed for nn.Linear):
  ``M = sum(B_i @ A_i for i) / k`` one client at a time, ``R = M - B̄ Ā`` dense,
  ``W += scale * R``.
* ``stacked``: the dense residual as one matmul of the stacked, centred factors,
  ``R = U @ V / k`` with ``U = [B_i - B̄]`` and ``V = [A_i - Ā]``, then ``W += scale * R``
  (the variant behind the "about 19x" figure in PAPER.md).
* ``ours``: ``fedexlora.aggregate(method="fedex")`` (the residual's exact factors
  ``U = [p_i (B_i - B̄)]``, ``V = [A_i - A_j]`` over the clients but the heaviest, ``j``:
  rank (k-1) r, no QR or SVD) and ``fedexlora.bridge.fold.fold_residuals`` on a
  one-layer peft model: one ``W.addmm_(U, V)``, and the residual recorded (factored)
  for the model's saved state. Where ``(k-1) r (d + n) >= d n`` the residual is smaller
  dense, so ``aggregate`` returns it dense (one matmul) and the fold is one ``add_``.
* ``floor``: one ``W.addmm_(U, V)`` of random rank-(k-1) r factors: the least any exact
  fold of a rank-(k-1) r update into W can cost.

Timing: ``time.perf_counter`` around each call; the variants are interleaved so that
load from other processes hits them alike. The first call of each variant runs on a zero
base weight, which gives the accuracy check, and serves as warm-up; the median of the
following repeats is reported. Where the first calls of a cell already take longer than
``--budget`` seconds, that single call is the timing (``reps`` = 1).

Peak memory: the growth of the process's resident set during one call, read from
``VmHWM`` in ``/proc/self/status`` after resetting it (``echo 5 > /proc/self/clear_refs``)
and subtracting ``VmRSS`` just before the call. The script re-executes itself with
``MALLOC_MMAP_THRESHOLD_=131072`` so that every tensor above 131,072 B (131 kB) is its own mmap,
returned to the system when freed: otherwise glibc would recycle freed heap memory
between calls and the high-water mark would under-count. Pages allocated but never
written do not count, which is right for ``torch.empty``. The figure is for the call's
temporaries and results, not for the inputs, which exist before the call.

Accuracy: ``max|ΔW_ours - ΔW_naive| / max|ΔW_naive|`` on a zero base, and where the cell
is small enough (``2 d n k r <= 1e10``), the relative Frobenius error of each variant
against an fp64 reference.

Usage::

    python benchmarks/aggregation.py            # full grid, 5-10 min on 2 cores
    python benchmarks/aggregation.py --quick    # 3 cells, about a minute
    python benchmarks/aggregation.py --json out.json --threads 1
    python benchmarks/aggregation.py --quick --no-peak  # timings without the mmap threshold
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time

_MMAP = "131072"
_NO_PEAK = "--no-peak" in sys.argv  # time with glibc's own allocator: no peak memory
if not _NO_PEAK and os.environ.get("MALLOC_MMAP_THRESHOLD_") != _MMAP and __name__ == "__main__":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

from fedexlora.bridge.fold import fold_residuals  # noqa: E402
from fedexlora.core.aggregation import aggregate  # noqa: E402

SHAPES = [(768, 768), (4096, 4096), (4096, 11008)]
CLIENTS = [3, 10, 50]
RANKS = [4, 16, 64]
QUICK = [(768, 768, 3, 4), (4096, 4096, 8, 16), (4096, 4096, 10, 16)]
PAPER_CELL = (4096, 4096, 8, 16)  # PAPER.md: stacked ~19x faster than the loop
SCALE = 2.0  # lora_alpha = 2 r
LAYER = "base_model.model.0"


# -- memory ---------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


DEVICE = torch.device("cpu")


def measured(fn):
    """Runs ``fn()``; returns (seconds, peak memory growth in bytes or None, result).

    On the CPU the peak is the resident-set high-water mark; on CUDA it is
    ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
    """
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return dt, torch.cuda.max_memory_allocated() - before, out
    can = _reset_peak() and not _NO_PEAK
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return dt, ((peak - before) * 1024 if can else None), out


# -- the variants ---------------------------------------------------------------------
def naive(As, Bs, W):
    """The released code's server step for one layer (without its transpose bug)."""
    A = torch.stack([a.detach() for a in As])  # (k, r, n)
    B = torch.stack([b.detach() for b in Bs])  # (k, d, r)
    k = len(As)
    M = sum(B[i] @ A[i] for i in range(k)) / k  # (d, n), one client at a time
    A_avg, B_avg = A.mean(0), B.mean(0)
    residue = M - B_avg @ A_avg  # (d, n)
    W += residue * SCALE
    return A_avg, B_avg


def stacked(As, Bs, W):
    """Dense residual as one matmul of stacked, centred factors, then one add."""
    A = torch.stack(As)  # (k, r, n)
    B = torch.stack(Bs)  # (k, d, r)
    k, r, n = A.shape
    d = B.shape[1]
    A_avg, B_avg = A.mean(0), B.mean(0)
    U = (B - B_avg).permute(1, 0, 2).reshape(d, k * r)  # (d, k r)
    V = (A - A_avg).reshape(k * r, n)  # (k r, n)
    R = U @ V  # (d, n)
    W.add_(R, alpha=SCALE / k)
    return A_avg, B_avg


def make_ours(model):
    def ours(As, Bs, W=None):
        # one round's server step (every round costs the same: one addmm_ into W)
        res = aggregate(As, Bs, method="fedex")
        fold_residuals(model, {LAYER: res.residual})
        return res

    return ours


def floor(UV, W):
    W.addmm_(UV[0], UV[1], alpha=SCALE)


def one_layer_model(d: int, n: int, r: int):
    """A peft model around a single ``nn.Linear(n, d)``, its base weight zeroed."""
    from peft import LoraConfig, get_peft_model

    base = torch.nn.Sequential(torch.nn.Linear(n, d, bias=False))
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=SCALE * r, lora_dropout=0.0, target_modules=["0"])
    )
    model.to(DEVICE)
    W = model.base_model.model[0].base_layer.weight
    with torch.no_grad():
        W.zero_()
    return model, W.data


def client_factors(d, n, k, r, seed=0):
    """Clients near a shared adapter: A_i = A0 + noise, B_i = B0 + noise (10%)."""
    g = torch.Generator().manual_seed(seed)
    A0 = torch.randn(r, n, generator=g) / n**0.5
    B0 = torch.randn(d, r, generator=g) / d**0.5
    As = [A0 + 0.1 * torch.randn(r, n, generator=g) / n**0.5 for _ in range(k)]
    Bs = [B0 + 0.1 * torch.randn(d, r, generator=g) / d**0.5 for _ in range(k)]
    return [a.to(DEVICE) for a in As], [b.to(DEVICE) for b in Bs]


def fp64_reference(As, Bs):
    A = torch.stack(As).double()
    B = torch.stack(Bs).double()
    k, r, n = A.shape
    d = B.shape[1]
    U = (B - B.mean(0)).permute(1, 0, 2).reshape(d, k * r)
    V = (A - A.mean(0)).reshape(k * r, n)
    return (U @ V) * (SCALE / k)


def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


# -- one cell -------------------------------------------------------------------------
def run_cell(d, n, k, r, *, budget: float, max_reps: int) -> dict:
    As, Bs = client_factors(d, n, k, r)
    model, W_ours = one_layer_model(d, n, r)
    ours = make_ours(model)
    W_ref = torch.zeros(d, n, device=DEVICE)
    q_floor = (k - 1) * r
    X = (torch.randn(d, q_floor, device=DEVICE), torch.randn(q_floor, n, device=DEVICE))

    # first calls on a zero base: accuracy and warm-up
    first, mem = {}, {}
    first["ours"], mem["ours"], res = measured(lambda: ours(As, Bs))
    first["naive"], mem["naive"], _ = measured(lambda: naive(As, Bs, W_ref))
    diff = float((W_ours - W_ref).abs().max() / W_ref.abs().max())
    q = res.residual.rank
    factored = res.residual.is_factored
    del res
    errs = {}
    if 2 * d * n * k * r <= 1e10:
        ref = fp64_reference(As, Bs)
        errs["ours"], errs["naive"] = rel_fro(W_ours, ref), rel_fro(W_ref, ref)
        W_ref.zero_()
        first["stacked"], mem["stacked"], _ = measured(lambda: stacked(As, Bs, W_ref))
        errs["stacked"] = rel_fro(W_ref, ref)
        del ref
    else:
        W_ref.zero_()
        first["stacked"], mem["stacked"], _ = measured(lambda: stacked(As, Bs, W_ref))
    first["floor"], mem["floor"], _ = measured(lambda: floor(X, W_ref))

    calls = {
        "floor": lambda: floor(X, W_ref),
        "naive": lambda: naive(As, Bs, W_ref),
        "stacked": lambda: stacked(As, Bs, W_ref),
        "ours": lambda: ours(As, Bs),
    }
    total_first = sum(first.values())
    if total_first > budget:
        times = {v: [t] for v, t in first.items()}
    else:
        reps = max(3, min(max_reps, int(budget / total_first)))
        times = {v: [] for v in calls}
        for _ in range(reps):
            for v, fn in calls.items():
                t, m, _ = measured(fn)
                times[v].append(t)
                mem[v] = m  # steady state: the last repeat's peak
    med = {v: statistics.median(ts) for v, ts in times.items()}
    return {
        "d": d,
        "n": n,
        "k": k,
        "r": r,
        "residual_rank": q,
        "residual_factored": factored,
        "reps": len(times["ours"]),
        "seconds": med,
        "peak_bytes": mem,
        "naive_over_ours": med["naive"] / med["ours"],
        "naive_over_stacked": med["naive"] / med["stacked"],
        "ours_over_floor": med["ours"] / med["floor"],
        "max_rel_diff_ours_vs_naive": diff,
        "rel_err_vs_fp64": errs,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:.0f}"


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 1e6:.3g}" if b >= 1e5 else "<0.1"


def markdown(rows: list[dict]) -> str:
    head = (
        "| d x n | k | r | residual | reps | naive ms | stacked ms | ours ms | floor ms "
        "| naive/ours | ours/floor | naive/stacked | peak MB naive | peak MB ours "
        "| max rel diff | err naive | err ours |"
    )
    lines = [head, "|" + "---|" * 17]
    for c in rows:
        s, m, e = c["seconds"], c["peak_bytes"], c["rel_err_vs_fp64"]
        storage = f"{'U,V' if c['residual_factored'] else 'dense'} q={c['residual_rank']}"
        errs = f"{e['naive']:.1e} | {e['ours']:.1e}" if e else "- | -"
        lines.append(
            f"| {c['d']}x{c['n']} | {c['k']} | {c['r']} | {storage} | {c['reps']} "
            f"| {_ms(s['naive'])} | {_ms(s['stacked'])} | {_ms(s['ours'])} | {_ms(s['floor'])} "
            f"| {c['naive_over_ours']:.2f} | {c['ours_over_floor']:.2f} "
            f"| {c['naive_over_stacked']:.2f} | {_mb(m['naive'])} | {_mb(m['ours'])} "
            f"| {c['max_rel_diff_ours_vs_naive']:.1e} | {errs} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 cells only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [torch default]")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of repeats per cell")
    ap.add_argument("--max-reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    ap.add_argument(
        "--no-peak",
        action="store_true",
        help="no peak-memory figures: time with glibc's own allocator (the mmap threshold "
        "that the memory figures need makes every large temporary a fresh mapping, and "
        "BLAS's packing buffers with it: the floor's addmm_ took 2.3x longer here)",
    )
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    cells = list(QUICK)
    if not args.quick:
        cells = [(d, n, k, r) for d, n in SHAPES for k in CLIENTS for r in RANKS]
        cells.insert(cells.index((4096, 4096, 10, 16)), PAPER_CELL)
    print(
        f"torch {torch.__version__}, device {DEVICE}, {torch.get_num_threads()} threads, "
        f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    rows = []
    t_all = time.perf_counter()
    for d, n, k, r in cells:
        t0 = time.perf_counter()
        row = run_cell(d, n, k, r, budget=args.budget, max_reps=args.max_reps)
        row["cell_seconds"] = time.perf_counter() - t0
        row["load_average"] = os.getloadavg()[0]
        rows.append(row)
        print(
            f"{d}x{n} k={k} r={r}: naive/ours {row['naive_over_ours']:.2f}, "
            f"ours/floor {row['ours_over_floor']:.2f}, naive/stacked "
            f"{row['naive_over_stacked']:.2f} ({row['reps']} reps, {row['cell_seconds']:.0f}s, "
            f"load {row['load_average']:.1f})",
            file=sys.stderr,
            flush=True,
        )
        gc.collect()
    print(markdown(rows))
    print(f"\ntotal {time.perf_counter() - t_all:.0f}s, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
