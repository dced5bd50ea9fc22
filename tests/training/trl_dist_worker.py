"""The ranks of test_trl_distributed: one client trained by TRL's SFTTrainer on 2 gloo processes.

Each rank is started as ``torchrun`` starts one (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the master's address in its environment, which accelerate reads), joins the group,
sets the client's DDP context and loads the round state from rank 0, as a worker group's
rank does (:mod:`fedexlora.run.worker_main`). Then it trains the tiny Llama of
``dist_worker`` twice (two rounds) with :func:`fedexlora.training.sft.train_encoded`.
Rank 0 writes what it trained to ``out/result.pt``; the single process's reference is
trained by the test itself (accelerate's state is one per process).

Then every rank runs the HF Trainer example (``examples/hf_trainer/train.py``'s
``federate``: 3 clients, 1 round) as ``torchrun --nproc-per-node 2`` runs the script;
rank 0 writes its global model, its uploads and each client Trainer's process count, and
every rank's global model.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

# 11 examples in batches of 5: 5, 5, 1 per epoch; split 3 + 2, 3 + 2, and 1 + nothing
N_EXAMPLES, ROUNDS = 11, 2
TRAIN = dict(steps=4, batch_size=5, lr=5e-2, warmup_ratio=0.25, max_grad_norm=0.05,
             weight_decay=0.01, seed=11)  # fmt: skip


def tokenizer():
    from transformers import AutoTokenizer

    from fedexlora.bridge.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("minilm").path)  # pad id 0


def examples():
    """``dist_worker``'s causal-LM examples, the first ``N_EXAMPLES``."""
    from dist_worker import data

    return data("llama").subset(list(range(N_EXAMPLES)))


def train_rounds(model, tok) -> list[dict]:
    """Trains ``ROUNDS`` times in a row; what was trained after each, and its loss."""
    from fedexlora.bridge.adapters import get_state
    from fedexlora.training.sft import train_encoded

    out = []
    for rnd in range(ROUNDS):
        res = train_encoded(model, tok, examples(), **{**TRAIN, "seed": TRAIN["seed"] + rnd})
        out.append(dict(trained=get_state(model).to_flat(), loss=res.loss, steps=res.steps))
    return out


def hf_example(out: str, bert_dir: str, csv: str) -> dict:
    """``examples/hf_trainer``'s ``federate`` on this rank; what the test compares."""
    import pandas as pd
    from datasets import Dataset

    from test_examples import _load, _weights

    ex = _load("examples/hf_trainer/train.py")
    trained_on = []  # each client Trainer's processes, and what wrapped its model

    class Recorded(ex.Trainer):
        def train(self, *args, **kwargs):
            res = super().train(*args, **kwargs)
            trained_on.append((self.accelerator.num_processes, type(self.model_wrapped).__name__))
            return res

    ex.Trainer = Recorded
    df = pd.read_csv(csv)
    df["label"] = df["label"].astype("category").cat.codes
    shards = [Dataset.from_pandas(df).shard(3, i) for i in range(3)]
    w0 = _weights(ex.lora_model(bert_dir, 3))
    glob, _, _, history = ex.federate(bert_dir, shards, 3, rounds=1, steps=2,
                                      out=os.path.join(out, "hf_trainer"))  # fmt: skip
    return dict(w0=w0, glob=_weights(glob), history=history, trained_on=trained_on)


def run(rank: int, world: int, port: int, out: str, bert_dir: str, csv: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from dist_worker import round_state, tiny
    from fedexlora.training import distributed as D

    try:
        flat = round_state("llama")
        model = tiny("llama")
        D.set_context(D.DistContext(mode="ddp"))
        D.prepare_model(model)
        D.load_round_state(model, flat if rank == 0 else None)
        rounds = train_rounds(model, tokenizer())
        try:  # TRL's packing: a batch flattened into one row cannot be split by example
            from fedexlora.training.sft import train_encoded

            train_encoded(model, tokenizer(), examples(), **TRAIN, packing=True)
            refused = None
        except ValueError as e:
            refused = str(e)
        D.set_context(None)
        example = hf_example(out, bert_dir, csv)
        every = [None] * world
        dist.all_gather_object(every, example.pop("glob"))
        if rank == 0:
            torch.save(dict(flat=flat, rounds=rounds, example=example, example_globs=every,
                            packing=refused),
                       os.path.join(out, "result.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    _, out, port, bert_dir, csv = sys.argv
    mp.start_processes(run, args=(2, int(port), out, bert_dir, csv), nprocs=2,
                       start_method="spawn")  # fmt: skip
