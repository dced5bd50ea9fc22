"""#34 on the real model: SmolLM2-135M-Instruct (GGUF from PyPI), GSM8K items, 3 clients.

- The FlowerTune-style app with a 4-bit (nf4) base, TRL's ``SFTTrainer`` on each client,
  over the in-process grid; the global model against the ideal computed by hand from the
  clients' uploads, and the saved adapter reloaded with plain peft onto the 4-bit base.
- ``examples/trl_sft``'s loop on the fp32 base (residuals beside the weights), against
  the same hand-computed ideal, read off the model's forward pass in fp64.

SmolLM2's own chat template, tokenizer and weights; one local step per round, to keep it
to about a minute or two of CPU.
"""

import json

import pytest
import torch

from test_examples import _load, hand_ideal

pytestmark = [pytest.mark.integration, pytest.mark.slow(seconds=146)]


def _rel(got, want, w0) -> float:
    return max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )


SEQ = 96  # tokens per example: a short question in SmolLM2's chat template, and answer


def _short_gsm8k(n: int | None = None):
    """GSM8K's training items whose question is short (at most 200 characters; with the
    chat template, at most 85 tokens), the first ``n`` of them (or all): at ``SEQ``
    tokens, every example still trains on part of its answer (none is a batch of
    prompt tokens only, whose loss would be empty), and no step pays for 192."""
    from fedexlora.tasks.data import load_task

    train = load_task("gsm8k", seed=0, test_fraction=0.2).train
    keep = [i for i, p in enumerate(train["prompt"]) if len(p) <= 200]
    assert len(keep) >= (n or 15), len(keep)
    return train.select(keep[:n])


@pytest.fixture(scope="module")
def short_gsm8k_jsonl(tmp_path_factory):
    """Those GSM8K items as a task file (prompt, response, answer), for the app."""
    path = tmp_path_factory.mktemp("gsm8k") / "gsm8k-short.jsonl"
    with open(path, "w") as f:
        for row in _short_gsm8k():
            f.write(json.dumps({k: row[k] for k in ("prompt", "response", "answer")}) + "\n")
    return str(path)


def test_flowertune_app_on_smollm2_4bit(monkeypatch, tmp_path, task_identity, short_gsm8k_jsonl):
    from flwr.app import Context, RecordDict
    from peft import PeftModel

    from test_flower import InProcessGrid
    from test_flowertune_app import APP, _weights, app_settings

    settings = app_settings(**{
        "static.dataset.name": short_gsm8k_jsonl,
        "num-server-rounds": 2, "train.training-arguments.max-steps": 1,
        "train.seq-length": SEQ, "eval.items": 1, "eval.max-new-tokens": 12,
        "results-dir": str(tmp_path / "results"),
    })  # fmt: skip
    assert settings["model.name"] == "smollm2-135m" and settings["model.quantization"] == 4
    monkeypatch.setenv("FLOWERTUNE_CONFIG", json.dumps(settings))
    monkeypatch.syspath_prepend(str(APP))
    from flowertune_fedex import client_app, dataset, models, server_app

    monkeypatch.setattr(client_app, "_MODEL", {})
    cfg = dataset.app_config({})
    w0 = _weights(models.get_model(cfg.model)[0])
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config={})
    server_app.app(InProcessGrid(client_app.app, 3), ctx)
    run = server_app.LAST_RUN
    assert [sorted(o.accepted) for o, _ in run["rounds"]] == [[0, 1, 2]] * 2
    want = hand_ideal(w0, run["rounds"], scale=16 / 8)
    err = _rel(_weights(run["model"]), want, w0)
    print(f"SmolLM2 4-bit, FlowerTune-style app: {err:.2e} of the total update")
    assert err < 1e-5, err
    base, tok = models.get_base(cfg.model)
    reloaded = PeftModel.from_pretrained(base, str(run["save_path"] / "peft_2")).eval()
    ids = tok("Natalia sold clips to 48 of her friends.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = run["model"].eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-4 * float(a.abs().max())), (a - b).abs().max()
    again = server_app.evaluate(reloaded, tok, cfg)
    assert again["generations"] == run["scores"]["generations"]


def test_trl_sft_example_on_smollm2_fp32(tmp_path):
    from test_fp32_side_branch import _forward_weights

    ex = _load("examples/trl_sft/train.py")
    base, tok = ex.load_base("smollm2-135m")
    data = ex.conversations(_short_gsm8k(12))
    shards = [data.shard(3, i) for i in range(3)]
    w0 = _forward_weights(ex.lora_model(base))
    glob, _, _, history = ex.federate(
        base, tok, shards, rounds=2, steps=1, out=str(tmp_path / "out"), max_length=SEQ
    )
    want = hand_ideal(w0, [(o, u) for o, u, _ in history], scale=ex.LORA["lora_alpha"] / 8)
    err = _rel(_forward_weights(glob), want, w0)
    print(f"SmolLM2 fp32, TRL SFTTrainer loop: {err:.2e} of the total update")
    assert err < 1e-5, err


def test_gguf_cache_holds_the_gguf_values(monkeypatch, tmp_path):
    """The dequantized copy that loads in seconds has the GGUF file's very values."""
    from transformers import AutoModelForCausalLM

    from fedexlora.bridge.models import gguf_cache_dir, load_base, resolve_model

    monkeypatch.setenv("FEDEXLORA_CACHE", str(tmp_path / "cache"))
    first, _ = load_base("smollm2-135m")  # writes the cache
    assert len(list(gguf_cache_dir().iterdir())) == 1
    again, tok = load_base("smollm2-135m")  # reads it
    spec = resolve_model("smollm2-135m")
    ref = AutoModelForCausalLM.from_pretrained(
        spec.path, gguf_file=spec.gguf_file, dtype=torch.float32
    )
    want = ref.state_dict()
    for model in (first, again):
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert again.name_or_path == spec.path and tok.chat_template  # as asked; SmolLM2's template


def test_gguf_without_a_writable_cache_still_loads_quantized(monkeypatch, tmp_path):
    """No cache (its root is a file): the GGUF file is read, then quantized, as before."""
    from fedexlora.bridge.models import load_base, resolve_model

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("FEDEXLORA_CACHE", str(blocker))
    model, _ = load_base("smollm2-135m", quantization="nf4")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds and not (tmp_path / "not-a-dir").is_dir()
    assert model.name_or_path == resolve_model("smollm2-135m").path
