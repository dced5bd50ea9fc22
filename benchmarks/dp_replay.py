"""Replays one client's DP-SGD update with the run's seed (issue 55, item 1).

The server knows the run's seed. If a client's Poisson sampling and Gaussian noise came
from it, the server could replay the client's training with the project's own
``local_update`` and compare with the upload: bit for bit with the true data, and
different with one record swapped, which decides membership at any ε. This script
calls ``local_update`` twice from the same global model, round, client and seed and
prints the largest difference between the two uploads, and the loss each would send.

    python benchmarks/dp_replay.py                  # default: OS entropy on the client
    python benchmarks/dp_replay.py --reproducible   # the opt-in: seeded, not private

A tiny random BERT (MiniLM's tokenizer, from the local cache) on a 150-row, 3-topic CSV;
3 IID clients, the first one replayed: ε = 1, δ = 1e-3, 4 local steps of batch 8.
"""

from __future__ import annotations

import argparse
import copy
import csv
import random
import tempfile
from pathlib import Path

WORDS = {
    0: ["goal", "match", "league", "coach", "striker", "season"],
    1: ["shares", "market", "profit", "bank", "investor", "economy"],
    2: ["vote", "minister", "election", "party", "policy", "senate"],
}


def _tiny_bert(d: Path) -> str:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from fedexlora.bridge.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=48,
                     max_position_embeddings=128)  # fmt: skip
    BertForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _topics(path: Path) -> str:
    rng = random.Random(0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(150):
            label = i % 3
            words = rng.sample(WORDS[label], 3) + rng.sample(sum(WORDS.values(), []), 2)
            w.writerow([" ".join(words), ["sport", "business", "politics"][label]])
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reproducible", action="store_true", help="--dp-reproducible")
    args = ap.parse_args()

    from fedexlora.config import RunConfig
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.client_step import local_update
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.privacy import budget_for

    d = Path(tempfile.mkdtemp())
    cfg = RunConfig(
        model=_tiny_bert(d / "bert"), task=_topics(d / "topics.csv"), methods=["fedex"],
        num_clients=3, partition="iid", rounds=2, local_steps=4, batch_size=8, lr=5e-3,
        max_length=16, lora_r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["query", "value"], dp_epsilon=1.0, dp_delta=1e-3,
        dp_reproducible=args.reproducible,
    ).validate()  # fmt: skip
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    data = prepare(cfg, tok, task)
    part = data.train.subset(data.parts[0])
    b = budget_for(cfg, 0, len(part))
    ups = [local_update(cfg, "fedex", copy.deepcopy(model), part, 1, 0, dp=b) for _ in range(2)]
    one, two = ups[0].state.to_flat(), ups[1].state.to_flat()
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(
        f"epsilon 1, delta 1e-3, {len(part)} examples, sigma {b.noise_multiplier:.3f}, "
        f"reproducible={args.reproducible}: max |upload - replay| = {diff:.3e}; "
        f"loss sent: {ups[0].train_loss}"
    )


if __name__ == "__main__":
    main()
