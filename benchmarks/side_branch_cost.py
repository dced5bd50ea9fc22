"""What `--fp32-side-branch` costs a MiniLM training step, as the side branch's rank grows.

The main job's model (MiniLM-L6, LoRA on query and value, batch 16, 64 tokens): one
training step (forward and backward) with the residuals folded into the fp32 weights,
against the same residuals held beside them in the side branch. FLOPs are counted by
torch's ``FlopCounterMode`` (exact, independent of the machine's load); times are the
minimum of interleaved repeats on one thread.

The side rank grows by (k-1)·r = 16 a round on the main job (3 clients, r = 8).

    python benchmarks/side_branch_cost.py [REPEATS]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from fedexlora.bridge.fold import fold_residuals
from fedexlora.bridge.layers import lora_layers
from fedexlora.config import RunConfig
from fedexlora.core.factors import Residual
from fedexlora.run.build import new_model
from fedexlora.run.restore import load_task_for


def _step(m: torch.nn.Module, ids: torch.Tensor, y: torch.Tensor) -> None:
    m.train()
    m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=y).loss.backward()
    m.zero_grad(set_to_none=True)


def models(cfg: RunConfig, task) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The two models compared: residuals folded into the fp32 weights, then beside them.

    Both are asked for explicitly: ``RunConfig()`` leaves ``fp32_side_branch`` unset, which
    an exact method on an fp32 base resolves to the side branch, so a model built from the
    defaults would compare the side branch with itself.
    """
    folded, _ = new_model(cfg.replace(fp32_side_branch=False), task, "fedex")
    side, _ = new_model(cfg.replace(fp32_side_branch=True), task, "fedex")
    return folded, side


def main(reps: int = 3) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = RunConfig()
    task = load_task_for(base)
    plain, side = models(base, task)
    layers = lora_layers(plain)
    print(f"{len(layers)} LoRA layers; batch 16 x 64 tokens; {reps} interleaved repeats")
    ids = torch.randint(1000, 20000, (16, 64))
    y = torch.randint(0, 5, (16,))
    folded = 0
    for rank in (16, 32, 48, 96, 384):
        res = {}
        for name, layer in layers.items():
            d = layer.lora_B["default"].weight.shape[0]
            n = layer.lora_A["default"].weight.shape[1]
            g = torch.Generator().manual_seed(rank)
            U = 1e-3 * torch.randn(d, rank - folded, generator=g)
            res[name] = Residual((d, n), U=U, V=torch.randn(rank - folded, n, generator=g))
        for m in (plain, side):
            fold_residuals(m, res)
        folded = rank
        counts = []
        for m in (plain, side):
            with FlopCounterMode(display=False) as fc:
                _step(m, ids, y)
            counts.append(fc.get_total_flops())
        a, b = [], []
        for _ in range(reps):
            for m, acc in ((plain, a), (side, b), (side, b), (plain, a)):
                t = time.perf_counter()
                _step(m, ids, y)
                acc.append(time.perf_counter() - t)
        print(
            f"side rank {rank:4d}: step FLOPs x{counts[1] / counts[0]:.4f} "
            f"(+{100 * (counts[1] / counts[0] - 1):.1f}%); min time folded {min(a):.3f} s, "
            f"side branch {min(b):.3f} s (x{min(b) / min(a):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
