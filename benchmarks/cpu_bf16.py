"""Where a bf16 training step spends its time on a CPU: torch's kernels or ours.

On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX: this machine has AVX2
only), torch computes bf16 matrix products in a generic fallback. This script times, in
one process:

1. one matrix product of MiniLM's shape (batch x 384 @ 384 x 1536), fp32 vs bf16;
2. one LoRA training step (forward and backward, batch 8 x 128 tokens) of the embedded
   MiniLM with LoRA on query and value, fp32 vs bf16, and in bf16 with and without a
   folded residual in the fp32 side branch (the part of the step that is ours);
3. torch.profiler's top operators of the bf16 step (self CPU time).

Usage::

    python benchmarks/cpu_bf16.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from fedexlora.bridge.fold import fold_residuals
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.bridge.models import resolve_model
    from fedexlora.core.factors import Residual

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 384, generator=g)
    w = torch.randn(1536, 384, generator=g)
    t32 = _median_time(lambda: x @ w.T, args.reps * 3)
    xb, wb = x.bfloat16(), w.bfloat16()
    t16 = _median_time(lambda: xb @ wb.T, args.reps * 3)
    print("\n| 1024x384 @ 384x1536 | fp32 ms | bf16 ms | bf16/fp32 |\n|---|---|---|---|")
    print(f"| matmul | {1e3 * t32:.2f} | {1e3 * t16:.2f} | {t16 / t32:.1f} |")

    path = resolve_model("minilm").path
    batch = {
        "input_ids": torch.randint(1000, 20000, (8, 128), generator=g),
        "attention_mask": torch.ones(8, 128, dtype=torch.long),
        "labels": torch.randint(0, 5, (8,), generator=g),
    }

    def model_of(dtype):
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=5)
        base.to(dtype)
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"])
        return get_peft_model(base, cfg)

    def step_of(model):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-4)

        def step():
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()

        return step

    rows = {}
    m32 = model_of(torch.float32)
    rows["fp32"] = _median_time(step_of(m32), args.reps)
    m16 = model_of(torch.bfloat16)
    rows["bf16, no side branch"] = _median_time(step_of(m16), args.reps)
    residuals = {
        name: Residual(
            (layer.out_features, layer.in_features),
            U=torch.randn(layer.out_features, 16, generator=g) * 1e-3,
            V=torch.randn(16, layer.in_features, generator=g) * 1e-3,
        )
        for name, layer in lora_layers(m16).items()
    }
    fold_residuals(m16, residuals)  # rank-16 fp32 side branch on every adapted layer
    step16 = step_of(m16)
    rows["bf16, rank-16 side branch"] = _median_time(step16, args.reps)
    print("\n| MiniLM LoRA step (8 x 128 tokens) | ms | / fp32 |\n|---|---|---|")
    for name, t in rows.items():
        print(f"| {name} | {1e3 * t:.0f} | {t / rows['fp32']:.1f} |")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step16()
    print("\nbf16 step with the side branch, top operators by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
