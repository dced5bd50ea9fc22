"""Three clients, each training with a plain transformers ``Trainer``, federated exactly.

Every party keeps its own model; the server keeps the global one. Per round a client
applies the server's payload, trains with its own ``Trainer`` and uploads its factors;
the server aggregates them (FedEx-LoRA) and applies the outcome to its model.

    python examples/hf_trainer/train.py        # embedded MiniLM on BBC News, 3 clients
    torchrun --nproc-per-node 2 examples/hf_trainer/train.py   # each client on 2 processes

Under ``torchrun`` (or ``accelerate launch``) every process runs this whole script, and
each client's ``Trainer`` trains with DDP across them, as transformers does: accelerate
wraps the model, each process draws its own batches of ``per_device_train_batch_size``
(the global batch is N times that) and the gradients are averaged, so every process
holds the same client models, the same server and the same global model. Rank 0 alone
prints (and would save); nothing else changes.
"""

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
)

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info, make_upload


def lora_model(path, num_labels):
    torch.manual_seed(0)  # every party starts from the same weights, head and adapters
    base = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=num_labels, ignore_mismatched_sizes=True
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(base, lora)


def federate(path, shards, num_labels, rounds=2, steps=10, out="runs/hf_trainer"):
    """``shards``: one ``datasets.Dataset`` with ``text`` and ``label`` per client."""
    tok = AutoTokenizer.from_pretrained(path)
    data = [s.map(lambda b: tok(b["text"], truncation=True, max_length=32), batched=True)
            for s in shards]  # fmt: skip
    glob = lora_model(path, num_labels)  # the server's copy of the global model
    server = Server(get_state(glob), layer_info(glob), num_clients=len(shards))
    clients = [lora_model(path, num_labels) for _ in shards]  # each party's own model
    history = []
    for rnd in range(1, rounds + 1):
        uploads = []
        for c in server.sample(rnd):
            apply_payload(clients[c], server.payload_for(c))
            args = TrainingArguments(
                output_dir=f"{out}/client-{c}", max_steps=steps, per_device_train_batch_size=8,
                learning_rate=1e-2, seed=1000 * rnd + c, report_to=[], save_strategy="no",
                logging_strategy="no", use_cpu=True, disable_tqdm=True,
            )  # fmt: skip
            Trainer(
                model=clients[c], args=args, train_dataset=data[c], processing_class=tok
            ).train()
            uploads.append(make_upload(clients[c], len(data[c]), client_id=c))
        outcome = server.aggregate(uploads)
        deviation = apply_outcome(glob, server, outcome, uploads)
        history.append((outcome, uploads))
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one process speaks
            print(f"round {rnd}: model vs ideal, max deviation {max(deviation.values()):.1e}")
    return glob, server, clients, history


def main():
    from fedexlora.bridge.models import resolve_model
    from fedexlora.tasks.data import load_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    task = load_task("bbc-news", seed=0, test_fraction=0.2, max_train=300)
    shards = [task.train.shard(3, i) for i in range(3)]
    federate(resolve_model("minilm").path, shards, task.num_labels, args.rounds, args.steps)


if __name__ == "__main__":
    main()
