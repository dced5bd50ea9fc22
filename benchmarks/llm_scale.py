"""Exactness priced at Llama-3-8B shapes: one real decoder block, FedEx against FedIT, per round.

One decoder block of Llama-3-8B (q/o 4096x4096, k/v 4096 -> 1024, gate/up 4096 -> 14336,
down 14336 -> 4096; random weights, saved once and loaded through transformers as bf16, or
as nf4 through bitsandbytes exactly as ``fedexlora.bridge.models`` loads a quantized base),
LoRA on all seven projections through peft. Two copies of the block: FedEx-LoRA's global
model (its residuals in the fp32 side branch, ``fedexlora.bridge.fold``) and FedIT's,
each driven by its own :class:`fedexlora.server.Server` (built as
``fedexlora.run.build.new_server`` builds it, ``delta_source`` included). Synthetic clients
at FlowerTune's settings (20 clients, ``fraction`` 0.1 or 0.2: k = 2 or 4 a round): each
sampled client uploads the global factors plus a seeded random perturbation of relative
size ``--sigma``, the same uploads to both servers; each server's outcome goes into its
model with ``fedexlora.bridge.steps.apply_outcome``, the engines' own step.

The first of ``--precisions`` drives the rounds. The servers, the payloads and the fp32
side branch do not depend on the base's precision, so the other precisions' two models
share them, and are brought to the driving models' state (LoRA factors and side-branch
tensors, :func:`sync`) at the rounds where they are timed or measured; a measured round's
outcome each model applies and is measured on itself, against its own base. Their rows
say ``driven_by``.

Measured per round, from the tensors actually held:

- client memory beside the base: the side branch's buffers plus the LoRA parameters (the
  global model, which every client holds once it has applied its payload);
- bytes down to each sampled client (``Server.payload_for``'s payload; ``m``: the rounds
  since that client last trained, ``new`` for a first visit) and up (its upload);
- the server's memory (``Server.nbytes()``) and its own seconds (``last_round_seconds``);
- the seconds FedEx's model takes to load the round's factors and fold its residual into
  the side branch (not in a ``--deviation`` round, whose fold is timed with the
  measurement); the table gives their mean over the rounds so far and the largest, since
  the side branch re-factors only on its ladder's rungs (``fedexlora.core.side``);
- at ``--timed`` rounds only, one training step (forward and backward, ``--tokens`` tokens,
  bf16 autocast) of each model, interleaved, the minimum of ``--reps`` pairs;
- at ``--deviation`` rounds, each model's deviation from the ideal model, relative to the
  round's update (``apply_outcome``'s measure).

The table scales bytes to all ``--blocks`` (32) blocks: every block of Llama-3-8B has the
same seven shapes and synthetic clients grow each block's side branch alike, so bytes are
multiplied by 32. Embeddings and ``lm_head`` (not adapted) are left out of the base.

Usage::

    python benchmarks/llm_scale.py                  # default grid: a few minutes
    python benchmarks/llm_scale.py --ranks 16,8,32 --rounds 200 --report 10,20,50,200 \\
        --timed 1,10,20,50,200 --deviation 10,20,50,200 --json full.json   # the full grid
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fedexlora.bridge.adapters import get_state, set_state
from fedexlora.bridge.fold import (
    adapter_nbytes,
    base_nbytes,
    load_side_state,
    side_nbytes,
    side_state,
)
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.steps import apply_outcome
from fedexlora.core.messages import ClientUpload, Payload
from fedexlora.core.state import AdapterState
from fedexlora.server.server import Server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_block import (  # noqa: E402  (beside this file)
    LLAMA3_8B,
    BlockShape,
    load_block,
    machine,
    save_block,
)

NUM_CLIENTS = 20
EXAMPLES = 100  # every synthetic client: equal weights p_i = 1/k


# -- bytes, from the tensors held ---------------------------------------------------------
def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' elements (``numel * element_size``)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def base_bytes(model: torch.nn.Module) -> int:
    """Bytes of the adapted projections' base weights, as stored
    (:func:`fedexlora.bridge.fold.base_nbytes`: a 4-bit weight's packed bytes and its
    block scales)."""
    return sum(base_nbytes(layer) for layer in lora_layers(model).values())


def payload_bytes(payload: Payload) -> int:
    """Bytes of every tensor in a payload, from its flat transport form."""
    return tensor_bytes(payload.to_flat().values())


def side_ranks(model: torch.nn.Module) -> dict[str, int]:
    """Per projection (``q_proj``, ...), the side branch's rank (0: none)."""
    out = {}
    for name, layer in lora_layers(model).items():
        side = getattr(layer, "fedex_side", None)
        out[name.rsplit(".", 1)[-1]] = 0 if side is None else side.rank
    return out


# -- synthetic clients and a training step -------------------------------------------------
def client_uploads(
    state: AdapterState, clients: list[int], rnd: int, *, seed: int, sigma: float
) -> list[ClientUpload]:
    """Each client's upload: the global factors plus a seeded Gaussian perturbation.

    The perturbation of each factor has standard deviation ``sigma`` times the RMS of the
    layer's global ``A`` (B starts at zero): small-norm, full rank.
    """
    out = []
    for c in clients:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 1_009 + c)
        factors = {}
        for name, (A, B) in state.factors.items():
            step = sigma * float(A.pow(2).mean().sqrt())
            factors[name] = (
                A + step * torch.randn(A.shape, generator=g),
                B + step * torch.randn(B.shape, generator=g),
            )
        out.append(ClientUpload(c, AdapterState(factors=factors), EXAMPLES))
    return out


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """One forward and backward pass (bf16 autocast, as fedex-lora trains).

    Returns its wall seconds and its process CPU seconds (all threads): on a machine
    shared with other jobs the CPU seconds are what the step itself cost.
    """
    model.train()
    t, c = time.perf_counter(), time.process_time()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    model.zero_grad(set_to_none=True)
    return seconds, cpu


def step_flops(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """FLOPs of one training step, by torch's counter (blind to bitsandbytes' 4-bit kernel)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        train_step(model, ids)
    return int(counter.get_total_flops())


def time_steps(fedex, fedit, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """Minimum step seconds (wall and CPU) of each model, interleaved (FedIT, FedEx, FedEx,
    FedIT), after one step of each to warm up."""
    train_step(fedit, ids), train_step(fedex, ids)
    got: dict[str, list[tuple[float, float]]] = {"fedex": [], "fedit": []}
    for _ in range(reps):
        for m in ("fedit", "fedex", "fedex", "fedit"):
            got[m].append(train_step(fedex if m == "fedex" else fedit, ids))
    out = {}
    for m, times in got.items():
        out[f"step_{m}"] = min(t for t, _ in times)
        out[f"cpu_{m}"] = min(c for _, c in times)
    return out


# -- one run -------------------------------------------------------------------------------
@dataclass
class RoundRow:
    """One round of one setting, per block (bytes of one block; ``None``: not measured)."""

    precision: str
    fraction: float
    k: int
    r: int
    round: int
    side_rank: dict[str, int]
    side_bytes: int  # FedEx's side branch
    adapter_bytes: int  # both methods'
    base_bytes: int  # the adapted projections' base weights
    down_fedex: list[tuple[int, str]]  # per sampled client: (bytes, m or "new")
    down_fedit: list[tuple[int, str]]
    up_bytes: list[int]
    server_fedex: int
    server_fedit: int
    server_s_fedex: float
    server_s_fedit: float
    fold_s: float | None  # FedEx's model: the round's residual in (None: a measured round)
    step_fedex: float | None = None  # wall seconds, min over the interleaved repeats
    step_fedit: float | None = None
    cpu_fedex: float | None = None  # process CPU seconds, the same way
    cpu_fedit: float | None = None
    flops_fedex: int | None = None  # one step, torch's counter (bf16 and fp32 bases)
    flops_fedit: int | None = None
    deviation_fedex: float | None = None  # max over layers, relative to the round's update
    deviation_fedit: float | None = None
    resets: int = 0  # FedEx payloads that were reset (the whole delta since W0)
    # the precision whose models took every round (server, payloads, fold, side bytes
    # shared); this one's were synced to them to be timed and measured. None: itself
    driven_by: str | None = None


@dataclass
class RoundEvent:
    """What a round handed :func:`simulate`'s ``on_round`` (for tests and checks)."""

    round: int
    uploads: list[ClientUpload]
    previous: AdapterState  # the global factors the clients started from
    fedex: torch.nn.Module
    fedit: torch.nn.Module
    fedex_server: Server
    fedit_server: Server
    payloads: dict[str, list[Payload]] = field(default_factory=dict)
    # the other precisions' models ({"fedex": ..., "fedit": ...}), as of their last sync
    shadows: dict[str, dict[str, torch.nn.Module]] = field(default_factory=dict)


def new_server(model, method: str, fraction: float, seed: int) -> Server:
    """The server of ``method`` for ``model``: :func:`fedexlora.run.build.new_server` itself,
    at FlowerTune's 20 clients and ``fraction``."""
    from fedexlora.config import RunConfig
    from fedexlora.run.build import new_server as build_server

    cfg = RunConfig(num_clients=NUM_CLIENTS, fraction=fraction, seed=seed)
    return build_server(cfg, method, model)


def sync(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Brings ``dst`` (another base precision of the same block) to ``src``'s state: its
    LoRA factors, and what its layers folded (the side branches' tensors, shared, since a
    fold replaces them instead of writing into them)."""
    set_state(dst, get_state(src))
    load_side_state(dst, side_state(src))


def simulate(
    path: Path,
    precision: str | Sequence[str],
    fraction: float,
    r: int,
    rounds: int,
    *,
    alpha: float | None = None,
    timed: Iterable[int] = (),
    deviation: Iterable[int] = (),
    tokens: int = 128,
    reps: int = 2,
    seed: int = 0,
    sigma: float = 0.05,
    on_round: Callable[[RoundEvent], None] | None = None,
    log: Callable[[str], None] | None = None,
    on_rows: Callable[[list[RoundRow]], None] | None = None,
) -> list[RoundRow]:
    """``rounds`` rounds of FedEx and FedIT on the block saved at ``path``; one row a round
    and precision (``on_rows`` gets every row so far after each round, to save them).

    The first precision drives: its two models take every round's outcome. Neither the
    servers nor a side branch depend on the base's precision (the side branch is fp32
    beside any base), so the other precisions' models share the round's server, payloads
    and fold, and are brought to the driving models' state (:func:`sync`) where they are
    measured: before a ``deviation`` round (whose outcome each model then applies and is
    measured on, against its own base) and after a ``timed`` one. Their rows say so
    (``driven_by``).
    """
    precisions = [precision] if isinstance(precision, str) else list(precision)
    alpha = 2.0 * r if alpha is None else alpha
    timed, deviation = set(timed), set(deviation)
    models = {
        p: {m: load_block(path, p, r, alpha, seed=seed) for m in ("fedex", "fedit")}
        for p in precisions
    }
    drive = models[precisions[0]]
    servers = {m: new_server(drive[m], m, fraction, seed) for m in ("fedex", "fedit")}
    base = {p: base_bytes(models[p]["fedex"]) for p in precisions}
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))
    last: dict[int, int] = {}
    rows: dict[str, list[RoundRow]] = {p: [] for p in precisions}
    for rnd in range(1, rounds + 1):
        sampled = servers["fedex"].sample(rnd)
        if sampled != servers["fedit"].sample(rnd):
            raise RuntimeError("the two servers sampled different clients")
        seen = {c: ("new" if c not in last else str(rnd - last[c])) for c in sampled}
        payloads = {m: [s.payload_for(c) for c in sampled] for m, s in servers.items()}
        previous = servers["fedex"].state
        uploads = client_uploads(previous, sampled, rnd, seed=seed, sigma=sigma)
        measure = rnd in deviation
        if measure:  # every model from the round's start, to apply the outcome itself
            for p in precisions[1:]:
                for m in ("fedex", "fedit"):
                    sync(models[p][m], drive[m])
        devs: dict[str, dict[str, float | None]] = {p: {} for p in precisions}
        fold_s = None
        for m, server in servers.items():
            outcome = server.aggregate(uploads, effective=False)
            for p in precisions if measure else precisions[:1]:
                t = time.perf_counter()
                dev = apply_outcome(models[p][m], server, outcome, uploads if measure else None)
                if p == precisions[0] and m == "fedex" and not measure:
                    fold_s = time.perf_counter() - t  # a measured round's is mostly the measure
                devs[p][m] = max(dev.values()) if dev else None
        for c in sampled:
            last[c] = rnd
        common = dict(
            fraction=fraction,
            k=len(sampled),
            r=r,
            round=rnd,
            side_rank=side_ranks(drive["fedex"]),
            side_bytes=side_nbytes(drive["fedex"]),
            adapter_bytes=adapter_nbytes(drive["fedex"]),
            down_fedex=[(payload_bytes(p), seen[c]) for p, c in zip(payloads["fedex"], sampled)],
            down_fedit=[(payload_bytes(p), seen[c]) for p, c in zip(payloads["fedit"], sampled)],
            up_bytes=[tensor_bytes(u.to_flat().values()) for u in uploads],
            server_fedex=servers["fedex"].nbytes()["total"],
            server_fedit=servers["fedit"].nbytes()["total"],
            server_s_fedex=servers["fedex"].last_round_seconds,
            server_s_fedit=servers["fedit"].last_round_seconds,
            fold_s=fold_s,
            resets=sum(p.reset for p in payloads["fedex"]),
        )
        for p in precisions:
            row = RoundRow(
                precision=p,
                base_bytes=base[p],
                deviation_fedex=devs[p].get("fedex"),
                deviation_fedit=devs[p].get("fedit"),
                driven_by=None if p == precisions[0] else precisions[0],
                **common,
            )
            if rnd in timed:
                if p != precisions[0] and not measure:
                    for m in ("fedex", "fedit"):
                        sync(models[p][m], drive[m])
                fedex, fedit = models[p]["fedex"], models[p]["fedit"]
                for key, value in time_steps(fedex, fedit, ids, reps).items():
                    setattr(row, key, value)
                if p != "nf4":  # the counter does not see the 4-bit matmuls
                    row.flops_fedex, row.flops_fedit = (
                        step_flops(fedex, ids),
                        step_flops(fedit, ids),
                    )
            rows[p].append(row)
            if log is not None:
                log(_progress(row))
        if on_round is not None:
            on_round(
                RoundEvent(rnd, uploads, previous, drive["fedex"], drive["fedit"],
                           servers["fedex"], servers["fedit"], payloads,
                           {p: models[p] for p in precisions[1:]})
            )  # fmt: skip
        if on_rows is not None:
            on_rows([row for p in precisions for row in rows[p]])
    return [row for p in precisions for row in rows[p]]


def _progress(row: RoundRow) -> str:
    step = ""
    if row.step_fedex is not None:
        step = (
            f", step CPU {row.cpu_fedex:.2f} s vs {row.cpu_fedit:.2f} s, wall "
            f"{row.step_fedex:.2f} s vs {row.step_fedit:.2f} s"
        )
    fold = "measured with the deviation" if row.fold_s is None else f"{row.fold_s:.2f} s"
    return (
        f"{row.precision} k={row.k} r={row.r} round {row.round}: side rank "
        f"{max(row.side_rank.values())}, side {row.side_bytes / 1e6:.1f} MB, fold "
        f"{fold}, server {row.server_s_fedex:.2f} s{step}"
    )


# -- the table -----------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x >= 1e8 else f"{x / 1e9:.3f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:.0f}" if x >= 1e7 else f"{x / 1e6:.1f}"


def _down(cells: list[tuple[int, str]], blocks: int) -> str:
    """Mean over the round's sampled clients, and the largest with its ``m``."""
    mean = sum(b for b, _ in cells) / len(cells)
    big, m = max(cells, key=lambda x: x[0])
    return f"{_mb(blocks * mean)} / {_mb(blocks * big)} (m={m})"


def memory_table(rows: list[RoundRow], report: Iterable[int], blocks: int) -> str:
    """Client memory and step time, scaled to ``blocks`` blocks."""
    want = set(report)
    out = [
        "| base | k | r | round | side rank (q / down) | side branch GB | adapters GB | "
        "beside base FedEx / FedIT | client memory FedEx / FedIT (base + beside) | "
        "step FedEx / FedIT: CPU time (FedIT's) / wall | step FLOPs FedEx / FedIT | "
        "fold s/round: mean (max) so far | "
        "deviation FedEx / FedIT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.round not in want:
            continue
        side, ad, base = (blocks * x for x in (row.side_bytes, row.adapter_bytes, row.base_bytes))
        step = "–"
        if row.step_fedex is not None:
            step = (
                f"{row.cpu_fedex / row.cpu_fedit:.2f}x ({row.cpu_fedit:.2f} s) / "
                f"{row.step_fedex / row.step_fedit:.2f}x ({row.step_fedit:.2f} s)"
            )
        flops = "–"
        if row.flops_fedex is not None:
            flops = f"{row.flops_fedex / row.flops_fedit:.3f}x"
        dev = "–"
        if row.deviation_fedex is not None:
            dev = f"{row.deviation_fedex:.1e} / {row.deviation_fedit:.1e}"
        out.append(
            f"| {row.precision} | {row.k} | {row.r} | {row.round} | "
            f"{row.side_rank['q_proj']} / {row.side_rank['down_proj']} | {_gb(side)} | "
            f"{_gb(ad)} | {(side + ad) / ad:.1f}x | {memory_ratio(row):.2f}x | "
            f"{step} | {flops} | {fold_so_far(rows, row)} | {dev} |"
        )
    return "\n".join(out)


def fold_so_far(rows: list[RoundRow], row: RoundRow) -> str:
    """The mean and the largest of FedEx's fold seconds in ``row``'s setting up to its round.

    Rounds whose deviation was measured are left out (their fold is timed with the
    measurement); so is a row saved before that rule, whose fold is its deviation's.
    """
    key = (row.precision, row.k, row.r)
    got = [
        x.fold_s
        for x in rows
        if (x.precision, x.k, x.r) == key and x.round <= row.round
        and x.fold_s is not None and x.deviation_fedex is None
    ]  # fmt: skip
    if not got:
        return "–"
    return f"{sum(got) / len(got):.2f} ({max(got):.2f})"


def traffic_table(rows: list[RoundRow], report: Iterable[int], blocks: int) -> str:
    """Bytes down and up per client, and the server's memory, scaled to ``blocks`` blocks."""
    want = set(report)
    out = [
        "| base | k | r | round | down FedEx MB: mean / max (m) | down FedIT MB | "
        "FedEx resets | up MB | server FedEx / FedIT MB | server s/round FedEx / FedIT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.round not in want:
            continue
        up = blocks * sum(row.up_bytes) / len(row.up_bytes)
        out.append(
            f"| {row.precision} | {row.k} | {row.r} | {row.round} | "
            f"{_down(row.down_fedex, blocks)} | {_down(row.down_fedit, blocks)} | "
            f"{row.resets} of {row.k} | {_mb(up)} | "
            f"{_mb(blocks * row.server_fedex)} / {_mb(blocks * row.server_fedit)} | "
            f"{row.server_s_fedex:.2f} / {row.server_s_fedit:.3f} |"
        )
    return "\n".join(out)


def memory_ratio(row: RoundRow) -> float:
    """FedEx's client memory over FedIT's: base, side branch and adapters over base and adapters."""
    return (row.base_bytes + row.side_bytes + row.adapter_bytes) / (
        row.base_bytes + row.adapter_bytes
    )


def over_budget(rows: list[RoundRow], memory: float = 1.5) -> str:
    """Per setting, the first round whose FedEx client memory exceeds ``memory`` x FedIT's."""
    out, first = [], {}
    for row in rows:
        key = (row.precision, row.k, row.r)
        if key not in first:
            first[key] = None
        if first[key] is None and memory_ratio(row) > memory:
            first[key] = row
    for (precision, k, r), row in first.items():
        last = max(x.round for x in rows if (x.precision, x.k, x.r) == (precision, k, r))
        if row is None:
            out.append(
                f"- {precision}, k={k}, r={r}: within {memory}x FedIT's in all {last} rounds"
            )
        else:
            out.append(
                f"- {precision}, k={k}, r={r}: client memory over {memory}x FedIT's from round "
                f"{row.round} ({memory_ratio(row):.2f}x)"
            )
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", default="bf16,nf4", help="bf16, nf4, fp32 (comma-separated)")
    ap.add_argument("--fractions", default="0.1,0.2", help="of 20 clients, sampled a round")
    ap.add_argument("--ranks", default="16", help="LoRA ranks, run in this order")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--report", default="1,10,20", help="rounds shown in the table")
    ap.add_argument("--timed", default=None, help="rounds whose step is timed (default: --report)")
    ap.add_argument("--deviation", default="", help="rounds whose deviation is measured")
    ap.add_argument("--tokens", type=int, default=128, help="batch 1 x this many tokens")
    ap.add_argument("--reps", type=int, default=3, help="interleaved pairs per timed step")
    ap.add_argument("--sigma", type=float, default=0.05, help="client perturbation, relative")
    ap.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 r)")
    ap.add_argument("--blocks", type=int, default=LLAMA3_8B.blocks, help="to scale bytes to")
    ap.add_argument("--hidden", type=int, default=None, help="a smaller block, for a try")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every round's row here, as it goes")
    ap.add_argument("--from-json", default=None, help="only print the tables of a saved run")
    args = ap.parse_args(argv)
    report = _ints(args.report)
    if args.from_json:
        rows = [RoundRow(**x) for x in json.loads(Path(args.from_json).read_text())]
        print(memory_table(rows, report, args.blocks))
        print()
        print(traffic_table(rows, report, args.blocks))
        print()
        print(over_budget(rows))
        return
    shape = LLAMA3_8B
    if args.hidden:  # a proportionally smaller block (a quick try, not Llama-3-8B)
        f = args.hidden / LLAMA3_8B.hidden
        shape = BlockShape(
            args.hidden, int(LLAMA3_8B.intermediate * f) // 8 * 8, 4, 1, args.hidden // 4
        )
    timed = report if args.timed is None else _ints(args.timed)
    rows: list[RoundRow] = []
    t0 = time.perf_counter()
    print(f"block: {shape.describe()}; {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedex-llm-scale-") as tmp:
        path = save_block(shape, Path(tmp) / "block", seed=args.seed)
        for r in _ints(args.ranks):
            for fraction in _floats(args.fractions):
                done = list(rows)

                def save(now: list[RoundRow], done: list[RoundRow] = done) -> None:
                    if args.json:  # every round, so that a stopped run keeps its rounds
                        Path(args.json).write_text(json.dumps([asdict(x) for x in done + now]))

                rows += simulate(
                    path, args.precisions.split(","), fraction, r, args.rounds,
                    alpha=args.alpha, timed=timed, deviation=_ints(args.deviation),
                    tokens=args.tokens, reps=args.reps, seed=args.seed, sigma=args.sigma,
                    log=lambda s: print(s, flush=True), on_rows=save,
                )  # fmt: skip
    print(
        f"\n{NUM_CLIENTS} clients; bytes scaled to {args.blocks} blocks (x{args.blocks}); "
        f"step: batch 1 x {args.tokens} tokens, bf16 autocast, min of {args.reps} interleaved "
        f"pair(s); {time.perf_counter() - t0:.0f} s in all\n"
    )
    print(memory_table(rows, report, args.blocks))
    print()
    print(traffic_table(rows, report, args.blocks))
    print()
    print(over_budget(rows))
    used = sys.argv[1:] if argv is None else argv
    print(f"\ncommand: python benchmarks/llm_scale.py {' '.join(used)}".rstrip())


if __name__ == "__main__":
    main()
