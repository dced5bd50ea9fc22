"""The FlowerTune-style app (``examples/flowertune_llm``), #34.

Its own pyproject's config keys, a 4-bit (nf4) base, TRL's ``SFTTrainer`` on every client,
fedex-lora's strategy on the server; over the in-process grid of ``test_flower.py`` (one
Flower Context per node, every message through Flower's protobuf). A tiny Llama with
SmolLM2's chat template stands in for SmolLM2 (``test_smollm2_integration.py`` runs the
real one). The global model is checked against the ideal computed by hand from the
clients' uploads; the saved adapter is loaded with plain peft onto the base loaded as the
run loaded it, and must give the same logits, generations and score.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from flwr.common.config import flatten_dict, get_project_config

from test_examples import hand_ideal

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=8)

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flowertune_llm"

# SmolLM2-135M-Instruct's chat template (ChatML), given to the tiny model's tokenizer
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_llama(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat-llama")
    shutil.copytree(tiny_llama_dir, d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHATML
    tok.save_pretrained(d)
    return str(d)


def app_settings(**overrides) -> dict:
    """The app's pyproject config, flat (as ``flwr run`` passes it), then ``overrides``."""
    conf = get_project_config(APP)["tool"]["flwr"]["app"]["config"]
    return {**flatten_dict(conf), **overrides}


@pytest.fixture()
def flowertune(monkeypatch, chat_llama, tiny_qa_jsonl, tmp_path):
    settings = app_settings(**{
        "model.name": chat_llama, "static.dataset.name": tiny_qa_jsonl,
        "num-server-rounds": 2, "train.training-arguments.max-steps": 2,
        "train.learning-rate-max": 2e-2, "train.learning-rate-min": 1e-3,
        "train.seq-length": 64, "eval.items": 3, "eval.max-new-tokens": 6,
        "results-dir": str(tmp_path / "results"),
    })  # fmt: skip
    monkeypatch.setenv("FLOWERTUNE_CONFIG", json.dumps(settings))
    monkeypatch.syspath_prepend(str(APP))
    for name in [m for m in sys.modules if m.startswith("flowertune_fedex")]:
        monkeypatch.delitem(sys.modules, name)
    from flowertune_fedex import client_app, dataset, models, server_app

    monkeypatch.setattr(client_app, "_MODEL", {})
    return client_app, server_app, models, dataset.app_config({})


def _weights(model) -> dict[str, torch.Tensor]:
    """Each layer's dequantized base + side branch + ``s B A``, fp64: the forward's weight."""
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.bridge.layers import lora_layers

    return {n: effective_weight(layer) for n, layer in lora_layers(model).items()}


def test_flowertune_app_is_exact_on_a_4bit_base_and_its_adapter_reloads(flowertune, task_identity):
    from flwr.app import Context, RecordDict
    from peft import PeftModel

    from fedexlora.bridge.layers import lora_layers
    from test_flower import InProcessGrid

    client_app, server_app, models, cfg = flowertune
    assert int(cfg.model.quantization) == 4 and cfg.strategy.method == "fedex"
    w0 = _weights(models.get_model(cfg.model)[0])
    grid = InProcessGrid(client_app.app, 3)
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config={})
    server_app.app(grid, ctx)
    assert sorted(grid.trained) == [(r, c) for r in (1, 2) for c in (0, 1, 2)]
    run = server_app.LAST_RUN
    assert [sorted(o.accepted) for o, _ in run["rounds"]] == [[0, 1, 2]] * 2
    model = run["model"]
    layer = next(iter(lora_layers(model).values()))
    assert type(layer.get_base_layer()).__name__ == "Linear4bit"  # the base is 4-bit
    # the global model against the ideal, by hand from the clients' uploads
    got = _weights(model)
    scale = float(cfg.model.lora.peft_lora_alpha) / int(cfg.model.lora.peft_lora_r)
    want = hand_ideal(w0, run["rounds"], scale=scale)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    print(f"max relative error {err:.2e} of the total update")
    assert err < 1e-5, err
    assert min(float(torch.linalg.norm(want[n] - w0[n])) for n in want) > 0  # it trained
    # every client, given its next payload, holds that global model: its own state on the
    # process's model (the one TRL trained), fp32 factors and all
    from fedexlora import apply_payload
    from fedexlora.bridge.steps import load_client_state
    from fedexlora.flower.records import from_array_record

    shared = client_app._MODEL["model"][0]
    for node, ctx in grid.contexts.items():
        load_client_state(shared, from_array_record(ctx.state["fedexlora"]))
        apply_payload(shared, run["server"].payload_for(node - 1000))
        assert all(p.dtype == torch.float32 for p in shared.parameters() if p.requires_grad)
        mine = _weights(shared)
        gap = max(float(torch.linalg.norm(mine[n] - got[n]) / torch.linalg.norm(want[n] - w0[n]))
                  for n in got)  # fmt: skip
        assert gap < 1e-6, (node, gap)
    # the global PEFT adapter of every round, as FlowerTune saves it
    save = run["save_path"]
    assert (save / "peft_1" / "adapter_config.json").exists()
    assert (save / "peft_2" / "adapter_model.safetensors").exists()
    # ... which loads with plain peft onto the 4-bit base, loaded as the run loaded it
    base, tok = models.get_base(cfg.model)
    reloaded = PeftModel.from_pretrained(base, str(save / "peft_2")).eval()
    ids = tok("Natalia sold clips to 48 of her friends.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max())), (a - b).abs().max()
    # ... and scores what the run reported: the same generations, the same exact match
    config = json.loads((save / "peft_2" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == cfg.model.name  # a path peft can open
    scores = json.loads((save / "eval.json").read_text())
    assert scores == {"round": 2, **run["scores"]}
    again = server_app.evaluate(reloaded, tok, cfg)
    assert again["generations"] == scores["generations"]
    assert again["exact_match"] == scores["exact_match"]


def test_flowertune_app_refuses_an_unknown_method(flowertune, task_identity, monkeypatch):
    from flwr.app import Context, RecordDict

    from test_flower import InProcessGrid

    client_app, server_app, _, _ = flowertune
    settings = json.loads(__import__("os").environ["FLOWERTUNE_CONFIG"])
    monkeypatch.setenv("FLOWERTUNE_CONFIG", json.dumps({**settings, "strategy.method": "avg"}))
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="strategy.method must be one of"):
        server_app.app(InProcessGrid(client_app.app, 3), ctx)
