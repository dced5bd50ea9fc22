"""One client on N processes at Llama-3-8B block shapes: what each rank holds, and a step's time.

The block is ``llama_block.py``'s (one or more Llama-3-8B decoder blocks, random weights,
bf16 base, LoRA on all seven projections, fp32 adapters, the fp32 side branch), loaded
by every rank from one saved copy. The round's state (rank 0's: the adapter, and in
every layer a side branch, dense by default: the worst case, 4 bytes per base weight)
goes to the ranks with :func:`fedexlora.training.distributed.load_round_state`, then the
ranks train ``--steps`` steps of a global batch of ``--batch`` sequences of ``--tokens``
tokens (bf16 autocast) through ``train_local``. For ``N = 1`` the row ``one`` is the
plain single process (no torch.distributed).

Per rank, from the tensors held after the state is loaded
(:func:`fedexlora.training.distributed.rank_nbytes`): the frozen base, the side branch,
the trained tensors; and the ratio of base + side branch to one process's. Then the peak
memory while training (CPU: the process's peak RSS, ``VmHWM``, reset after loading;
after ``malloc_trim``; GPU: ``torch.cuda.max_memory_allocated``), beside the RSS of the
process before it loaded the model (the libraries), and the mean seconds of a step
(after one warm-up step).

Usage::

    python benchmarks/distributed_client.py                      # CPU, gloo: N = 1, 2
    python benchmarks/distributed_client.py --device cuda --nprocs 1,2,4,8 --blocks 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama_block import LLAMA3_8B, load_block, machine  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_blocks(path: Path, blocks: int) -> Path:
    """``blocks`` Llama-3-8B decoder blocks with random weights, saved in bf16."""
    from transformers import LlamaForCausalLM

    cfg = LLAMA3_8B.config()
    cfg.num_hidden_layers = blocks
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def round_state(model, side: str) -> dict[str, torch.Tensor]:
    """A client state for ``model``: its adapter (B non-zero) and a side branch per layer."""
    from fedexlora.bridge.adapters import get_state
    from fedexlora.bridge.layers import lora_layers

    g = torch.Generator().manual_seed(1)
    flat = {f"adapter.{k}": v for k, v in get_state(model).to_flat().items()}
    for k, v in flat.items():
        if k.endswith(".B"):
            flat[k] = 1e-3 * torch.randn(v.shape, generator=g)
    for name, layer in lora_layers(model).items():
        d, n = layer.lora_B["default"].weight.shape[0], layer.lora_A["default"].weight.shape[1]
        if side == "dense":
            flat[f"side.{name}.dense"] = 1e-4 * torch.randn(d, n, generator=g)
        else:
            q = int(side)
            flat[f"side.{name}.U"] = 1e-2 * torch.randn(d, q, generator=g)
            flat[f"side.{name}.V"] = 1e-2 * torch.randn(q, n, generator=g)
    return flat


def _trim() -> None:
    """Frees what Python and the allocator hold unused (``malloc_trim``: back to the OS)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: torch.device) -> None:
    _trim()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(rank: int, world: int, args, mode: str, port: int, out: str) -> None:
    """One rank (or the single process, ``mode == "one"``): load, train, measure."""
    import torch.distributed as dist

    from fedexlora.bridge.steps import load_client_state
    from fedexlora.training import distributed as D
    from fedexlora.training.local import Encoded, train_local

    torch.set_num_threads(max(1, args.threads // world))
    _trim()
    libs = _rss()  # torch, transformers, peft imported: before any tensor of the model
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if mode != "one":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    model = load_block(Path(args.path), "bf16", args.rank, 2 * args.rank).to(device)
    flat = round_state(model, args.side) if rank == 0 else None
    if mode == "one":
        load_client_state(model, flat)
    else:
        D.set_context(D.DistContext(mode=mode))
        D.prepare_model(model)
        D.load_round_state(model, flat)
    del flat
    held = D.rank_nbytes(model)
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 128, (args.tokens,), generator=g).tolist() for _ in range(64)]
    data = Encoded(ids, [list(x) for x in ids], "causal_lm", 0)
    kw = dict(batch_size=args.batch, lr=1e-4, device=device, autocast=torch.bfloat16,
              progress=False, seed=0)  # fmt: skip
    train_local(model, data, steps=1, **kw)  # warm-up
    _reset_peak(device)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    train_local(model, data, steps=args.steps, **kw)
    if cuda:
        torch.cuda.synchronize()
    row = dict(mode=mode, N=world, rank=rank, **held, peak=_peak(device), libs=libs,
               step_s=(time.perf_counter() - t) / args.steps)  # fmt: skip
    if mode == "one":
        rows = [row]
    else:
        rows = [None] * world
        dist.all_gather_object(rows, row)
        D.set_context(None)
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def run(args, mode: str, world: int) -> list[dict]:
    """Spawns ``world`` ranks of ``mode`` and returns their rows."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(rank_main, args=(world, args, mode, _free_port(), out),
                           nprocs=world, start_method="spawn")  # fmt: skip
        return json.loads(Path(out).read_text())


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table (GB = 1e9 bytes), ratios to the ``one`` row."""
    one = next(r for r in rows if r["mode"] == "one")
    whole = one["frozen"] + one["side"]
    lines = [
        "| mode | N | rank | base GB | side branch GB | trained MB | (base + side) / one "
        "process | x N | peak memory GB | of which before loading | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (r["frozen"] + r["side"]) / whole
        lines.append(
            f"| {r['mode']} | {r['N']} | {r['rank']} | {r['frozen'] / 1e9:.3f} | "
            f"{r['side'] / 1e9:.3f} | {r['trained'] / 1e6:.1f} | {ratio:.4f} | "
            f"{ratio * r['N']:.4f} | {r['peak'] / 1e9:.2f} | {r.get('libs', 0) / 1e9:.2f} | "
            f"{r['step_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nprocs", default="1,2", help="N values (comma-separated)")
    ap.add_argument("--modes", default="ddp,fsdp", help="ddp, fsdp (comma-separated)")
    ap.add_argument("--blocks", type=int, default=1, help="Llama-3-8B decoder blocks")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--side", default="dense", help="side branch: dense, or a rank q (U V)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=2, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="CPU threads in all (split over the ranks)")  # fmt: skip
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.path = str(save_blocks(Path(tmp) / "block", args.blocks))
        for world in [int(x) for x in args.nprocs.split(",")]:
            modes = ["one"] if world == 1 else args.modes.split(",")
            for mode in modes:
                rows += run(args, mode, world)
                print(f"done: {mode} N={world}", file=sys.stderr, flush=True)
    print(f"{args.blocks} Llama-3-8B block(s) ({LLAMA3_8B.describe()}), bf16 base, LoRA r "
          f"{args.rank} on all seven projections, side branch {args.side}, global batch "
          f"{args.batch} x {args.tokens} tokens, {args.device}; {machine()}")  # fmt: skip
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
