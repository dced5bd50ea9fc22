"""Trained extras of a half-precision model through the public API keep fp32 masters.

A bf16 BERT with its classification head (peft ``modules_to_save``) and ``bias="all"``,
federated with the public calls and checked on the whole model against the ideal
computed by hand in fp64 (``ideal_whole_model``). Without the masters (the average
written into the bf16 parameters, as before) the same check fails on the head.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

import fedexlora.bridge.adapters as adapters
from fedexlora.bridge.masters import master, read_extra, write_extra
from ideal_whole_model import federate


def bf16_bert(bias: str = "all"):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=48, num_labels=3)  # fmt: skip
    model = BertForSequenceClassification(config).to(torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS",
                      bias=bias)  # fmt: skip
    return get_peft_model(model, lora)


@pytest.fixture
def no_masters(monkeypatch):
    """Before the masters: extras read as they are, the average written into bf16."""

    def read(p):
        return p.detach().to("cpu", copy=True).float()

    def write(p, t):
        p.copy_(t.to(p.dtype))

    monkeypatch.setattr(adapters, "read_extra", read)
    monkeypatch.setattr(adapters, "write_extra", write)


@pytest.mark.parametrize("bias", ["none", "all"])
def test_bf16_head_and_biases_are_exact_through_the_api(bias):
    global_model, clients, ideal, reports = federate(lambda: bf16_bert(bias))
    # the run's own figure covers the extras too (apply_outcome), all within 1e-5
    assert set(ideal.extra) <= set(reports[-1]) and max(max(r.values()) for r in reports) <= 1e-5
    assert any("classifier" in k for k in ideal.extra)
    assert any("attention.self.key.bias" in k for k in ideal.extra) == (bias == "all")
    for m in [global_model, *clients]:
        ideal.check(m)
    # the user's model is untouched in kind: bf16 parameters, a bf16 forward pass
    head = global_model.base_model.model.classifier.modules_to_save["default"].weight
    assert head.dtype == torch.bfloat16 and master(head) is not None
    assert torch.equal(head, master(head).to(torch.bfloat16))
    x = torch.randint(0, 64, (2, 6))
    assert global_model(input_ids=x).logits.dtype == torch.bfloat16


def test_without_masters_the_bf16_head_is_rounded_off_its_ideal(no_masters):
    global_model, _, ideal, reports = federate(bf16_bert)
    with pytest.raises(AssertionError, match=r"off its ideal"):
        ideal.check(global_model)
    dev = ideal.deviations(global_model)
    assert max(v for k, v in dev.items() if "classifier" in k) > 1e-4
    # and so does the model's own report
    assert max(v for r in reports for k, v in r.items() if "classifier" in k) > 1e-4


def test_a_master_reads_back_bit_for_bit_and_adds_what_training_changed():
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    value = torch.tensor([1.0, 1e-3, 1 / 3, -2.5, 1234.567])
    write_extra(p, value)
    assert torch.equal(read_extra(p), value)  # not rounded to bf16
    with torch.no_grad():
        p.add_(torch.full((5,), 0.25, dtype=torch.bfloat16))
    moved = p.detach().float() - value.to(torch.bfloat16).float()
    assert torch.equal(read_extra(p), value + moved)
    q = torch.nn.Parameter(torch.zeros(2))  # fp32: read and written as is, no master
    write_extra(q, torch.tensor([1 / 3, 2.0]))
    assert master(q) is None and torch.equal(read_extra(q), torch.tensor([1 / 3, 2.0]))


def test_the_adapter_export_writes_the_heads_fp32_master(tmp_path):
    from safetensors.torch import load_file

    from fedexlora.run.export import save_adapter

    global_model, _, ideal, _ = federate(bf16_bert)
    save_adapter(global_model, tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    name = "base_model.model.classifier.modules_to_save.default.weight"
    key = "base_model.model.classifier.weight"  # peft's key for it
    want = ideal.extra[name]
    assert saved[key].dtype == torch.float32
    den = float(torch.linalg.norm(want - ideal.extra0[name]))
    assert float(torch.linalg.norm(saved[key].double() - want)) / den <= 1e-5
