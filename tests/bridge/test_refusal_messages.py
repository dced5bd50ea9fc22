"""Refusals say what is refused and the way out, in one line, before anything runs."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

from fedexlora import get_state, layer_info


def test_mixtral_experts_through_target_parameters_are_not_refused_as_quantized():
    """The old refusal called an fp32 expert stack "a quantized base layer". Today it is
    read as one layer of block-diagonal ``B`` (exact: ``tests/bridge/test_peft_matrix.py``);
    on a half-precision stack the refusal names the option and the way out, in one line."""
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                        num_experts_per_tok=1)  # fmt: skip
    lora = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    model = get_peft_model(MixtralForCausalLM(cfg), lora)
    info = layer_info(model)  # what a server is built from
    assert any("experts" in name for name in info) and get_state(model) is not None
    half = get_peft_model(MixtralForCausalLM(cfg).to(torch.bfloat16), lora)
    with pytest.raises(ValueError, match=r"target_parameters") as err:
        layer_info(half)
    assert "quantiz" not in str(err.value) and "\n" not in str(err.value)
