"""Local training speed: ``fedexlora.training.local.train_local`` vs a plain transformers+peft loop.

Both train the same MiniLM-L6 LoRA model (q,v, r=8, alpha 16, dropout 0.05, 5-class head;
what ``fedexlora run`` trains) on the same bbc-news batches for the same number of steps,
in one process, alternating, each run from the same initial weights:

* ``ours``: ``train_local(model, data, steps=S, batch_size=16, lr=1e-3, seed=s)``.
* ``plain``: the loop one writes from the transformers and peft docs: batches padded by
  ``transformers.DataCollatorWithPadding``, ``torch.optim.AdamW``,
  ``transformers.get_linear_schedule_with_warmup`` (no warm-up), gradient clipping at 1,
  in the same example order (the same seeded ``randperm`` cycle ``train_local`` uses).

Dropout is seeded identically, so the two loops see identical batches and compute the
same losses; the script checks that the mean losses agree. It reports the median
seconds per step of each and the ratio ours/plain.

Usage::

    python benchmarks/training_speed.py [--steps 20] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

BATCH, LR, MAX_GRAD_NORM = 16, 1e-3, 1.0


def batch_order(n: int, steps: int, seed: int) -> list[list[int]]:
    """The example indices of each step, as ``train_local`` draws them."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    out = []
    for _ in range(steps):
        if len(order) < BATCH:
            order += torch.randperm(n, generator=gen).tolist()
        out.append(order[:BATCH])
        order = order[BATCH:]
    return out


def plain_loop(model, data, tokenizer, steps: int, seed: int) -> float:
    """A textbook transformers + peft training loop; returns the mean loss."""
    from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup

    collator = DataCollatorWithPadding(tokenizer)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    torch.manual_seed(seed)  # dropout, as train_local seeds it
    model.train()
    losses = []
    for idx in batch_order(len(data), steps, seed):
        batch = collator([{"input_ids": data.input_ids[i], "labels": data.labels[i]} for i in idx])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return sum(losses) / len(losses)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=64)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from fedexlora.bridge.models import load_model
    from fedexlora.tasks.data import load_task
    from fedexlora.training.local import encode, train_local

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model("minilm", causal=False, num_labels=5, r=8, alpha=16.0)
    task = load_task("bbc-news", seed=0)
    data = encode(task.train, tokenizer, kind=task.kind, max_length=args.max_length)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def reset() -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in init:
                    p.copy_(init[n])

    def ours(seed: int) -> float:
        res = train_local(
            model, data, steps=args.steps, batch_size=BATCH, lr=LR, seed=seed, progress=False
        )
        return res.loss

    def plain(seed: int) -> float:
        return plain_loop(model, data, tokenizer, args.steps, seed)

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    losses: dict[str, list[float]] = {"ours": [], "plain": []}
    for rep in range(args.repeats + 1):  # the first round is warm-up
        for name, fn in (
            (("ours", ours), ("plain", plain)) if rep % 2 else (("plain", plain), ("ours", ours))
        ):
            reset()
            t0 = time.perf_counter()
            loss = fn(seed=rep)
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt / args.steps)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    same = max(abs(a - b) for a, b in zip(losses["ours"], losses["plain"]))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x "
        f"{args.repeats} repeats, batch {BATCH}, max_length {args.max_length}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("| loop | median s/step | all s/step |")
    print("|---|---|---|")
    for k in ("ours", "plain"):
        print(f"| {k} | {med[k]:.4f} | {', '.join(f'{t:.4f}' for t in times[k])} |")
    print(f"\nours/plain time ratio: {med['ours'] / med['plain']:.3f}")
    print(f"max |mean loss ours - plain| over runs: {same:.2e} (identical batches and dropout)")


if __name__ == "__main__":
    main()
