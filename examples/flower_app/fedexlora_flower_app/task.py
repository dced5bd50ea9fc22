"""Your model, data and training loop: nothing federated here."""

import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fedexlora.bridge.models import resolve_model
from fedexlora.tasks.data import load_task

DEFAULTS = {"model": "minilm", "task": "bbc-news", "num-rounds": 2, "local-steps": 10,
            "lr": 0.01, "num-partitions": 3}  # fmt: skip


def settings(run_config) -> dict:
    """The defaults above, then ``FLOWER_APP_CONFIG`` (JSON), then the run config.

    ``flwr run`` passes the run config; ``run_simulation`` passes none, so a quick try or
    a test sets the environment variable instead.
    """
    env = json.loads(os.environ.get("FLOWER_APP_CONFIG", "{}"))
    return {**DEFAULTS, **env, **dict(run_config)}


def model_path(name: str) -> str:
    return resolve_model(name).path  # the embedded aliases, or a path / hub name as is


def new_model(cfg):
    """The pretrained model with LoRA, identical on every party (same seed)."""
    task = load_task(cfg["task"], seed=0, test_fraction=0.2)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(
        model_path(cfg["model"]), num_labels=task.num_labels, ignore_mismatched_sizes=True
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(base, lora)


def load_shard(cfg, partition: int, num_partitions: int):
    """This party's examples, tokenized: ``(input_ids, attention_mask, labels)``."""
    task = load_task(cfg["task"], seed=0, test_fraction=0.2)
    shard = task.train.shard(num_partitions, partition)
    tok = AutoTokenizer.from_pretrained(model_path(cfg["model"]))
    texts = list(shard["text"])
    enc = tok(texts, truncation=True, max_length=32, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], torch.tensor(list(shard["label"]))


def train(model, data, steps: int, lr: float, seed: int) -> float:
    """Your own loop: AdamW on random batches of 8. Returns the mean loss."""
    ids, mask, labels = data
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (8,), generator=g)
        loss = model(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    model.eval()
    return sum(losses) / len(losses)
