import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (`-n auto`, optional): one thread per worker (and in the processes
    # a test starts), instead of every worker's torch taking every core. Before torch loads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

# Under pytest-xdist, scripts/test.sh runs with --dist loadfile: a file's tests share a
# worker, so a module-scoped fixture (a whole Flower deployment, a killed and resumed run)
# runs once, not once per worker. The slow files go first, longest first, so that the two
# workers do not end with one of them alone on a long file. A file says it is slow
# itself, with its measured seconds: `pytestmark = pytest.mark.slow(seconds=N)` (and
# `pytest -m "not slow"` leaves those files out). (Measured: running the multi-process
# tests one at a time on one worker, the other running the rest, was slower: 1182 s
# against 1041 s, 2026-12-05.)


def _seconds(item) -> float:
    """The measured seconds of ``item``'s file when it is marked slow, else 0."""
    mark = item.get_closest_marker("slow")
    return float(mark.kwargs.get("seconds", 1)) if mark is not None else 0.0


def pytest_collection_modifyitems(config, items):
    """Slow files first, longest first (stable: each file's tests keep their order)."""
    items.sort(key=lambda item: -_seconds(item))


ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str):
    """Imports the repository's script at ``rel`` (a benchmark, an example, a tool under
    scripts/: files outside the package) as a module of its own, registered in
    ``sys.modules`` under a name made from its path (its dataclasses look it up there)."""
    name = "script_" + rel.removesuffix(".py").replace("/", "_").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ONE_ACTOR = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}}
"""A Flower simulation backend of one ClientApp actor (Ray given one CPU): every client of
the run trains in turn in one process, whose spare model is reused from client to client.
Each actor imports torch, transformers and peft (about 15 CPU-seconds here), so tests
that do not test concurrency use this one."""

WORDS = {
    0: ["goal", "match", "league", "coach", "striker", "season"],
    1: ["shares", "market", "profit", "bank", "investor", "economy"],
    2: ["vote", "minister", "election", "party", "policy", "senate"],
}


def save_tiny_bert(d, *, hidden_size: int = 32, intermediate_size: int = 48) -> str:
    """Saves a randomly initialised 2-layer BERT classifier (seed 0) with MiniLM's real
    tokenizer in ``d``; returns its path."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from fedexlora.bridge.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=128,
    )
    BertForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture()
def one_torch_thread():
    """torch on one thread for the test, then as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A tiny randomly initialised BERT classifier with MiniLM's real tokenizer."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_csv(tmp_path_factory):
    """A small 3-class text classification CSV whose classes are separable by words."""
    import csv
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "topics.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(150):
            label = i % 3
            words = rng.sample(WORDS[label], 3) + rng.sample(sum(WORDS.values(), []), 2)
            w.writerow([" ".join(words), ["sport", "business", "politics"][label]])
    return str(path)


@pytest.fixture()
def model_never_loads(monkeypatch):
    """Fails the test at once if anything loads a model's weights.

    A bad input must be refused before the model loads: under a bug that lets it
    through, a test of it fails here, in seconds, instead of after a whole run.
    """
    import fedexlora.bridge.models as models

    def loaded(name, *args, **kwargs):
        raise AssertionError(f"model {name!r} was loaded: the input was not refused first")

    monkeypatch.setattr(models, "load_model", loaded)
    monkeypatch.setattr(models, "load_base", loaded)


@pytest.fixture()
def tiny_cfg(tiny_bert_dir, tiny_csv):
    from fedexlora.config import RunConfig

    return RunConfig(
        model=tiny_bert_dir,
        task=tiny_csv,
        methods=["fedex", "fedit"],
        num_clients=3,
        partition="dirichlet",
        alpha=1.0,
        min_partition_size=5,
        rounds=2,
        local_steps=3,
        batch_size=8,
        lr=5e-3,
        max_length=16,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["query", "value", "intermediate.dense"],
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny randomly initialised Llama causal LM (with MiniLM's tokenizer, offline)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fedexlora.bridge.models import resolve_model

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    """A tiny randomly initialised GPT-2 (Conv1D layers, as the E2E recipe targets)."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from fedexlora.bridge.models import resolve_model

    d = tmp_path_factory.mktemp("tiny-gpt2")
    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id,
                     bos_token_id=tok.cls_token_id)  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_qa_jsonl(tmp_path_factory):
    """Prompt/response/answer lines with a final number, like GSM8K."""
    import json

    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a, b = i % 7, i % 5
            f.write(
                json.dumps(
                    {
                        "prompt": f"what is {a} plus {b}?",
                        "response": f"{a} plus {b} is {a + b}. #### {a + b}",
                        "answer": str(a + b),
                    }
                )
                + "\n"
            )
    return str(path)


@pytest.fixture()
def task_identity(monkeypatch):
    """What a Flower runtime sets before apps create messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


@pytest.fixture()
def seen_updates():
    """``(seen, spy)``: ``spy`` is the in-process engine's client step (pass it as
    ``local_update=``), recording in ``seen`` every client's round as ``(round, client) ->
    (state before training, state after, upload)``."""
    from fedexlora.bridge.adapters import get_state
    from fedexlora.run.client_step import local_update as real

    seen = {}

    def spy(cfg_, method, model, data, rnd, client, **kw):
        before = get_state(model)
        up = real(cfg_, method, model, data, rnd, client, **kw)
        seen[(rnd, client)] = (before, get_state(model), up)
        return up

    return seen, spy


def without_timings(row):
    """A metrics row (or anything in it) without its seconds: what two runs share."""
    if isinstance(row, dict):
        return {k: without_timings(v) for k, v in row.items() if "seconds" not in k}
    return row


def crash_then_resume(cfg, out, *, crash_round: int) -> list[dict]:
    """An in-process run in ``out`` that goes down in ``crash_round``, then resumed: its rows."""
    from fedexlora.run.client_step import local_update
    from fedexlora.run.inprocess import run_experiment

    def crash(cfg_, method, model, data, rnd, client, **kw):
        if rnd == crash_round:
            raise RuntimeError("the machine went down")
        return local_update(cfg_, method, model, data, rnd, client, **kw)

    with pytest.raises(RuntimeError, match="went down"):
        run_experiment(cfg, out, progress=False, local_update=crash)
    return run_experiment(cfg, out, progress=False, resume=True)
