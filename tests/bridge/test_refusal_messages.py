"""Refusals say what is refused and the way out, in one line, before anything runs."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

from fedexlora import get_state, layer_info


def test_mixtral_experts_through_target_parameters_are_refused_for_what_they_are():
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                        num_experts_per_tok=1)  # fmt: skip
    lora = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    model = get_peft_model(MixtralForCausalLM(cfg), lora)
    match = (
        r"^module 'base_model\.model\.model\.layers\.0\.mlp\.experts': LoRA on its parameter "
        r"'gate_up_proj' \(target_parameters, e\.g\. MoE experts\) is not supported; fix: leave "
        r"it out of target_parameters and target the model's Linear layers with target_modules$"
    )
    for call in (get_state, layer_info):  # what a server is built from
        with pytest.raises(ValueError, match=match) as err:
            call(model)
        assert "quantiz" not in str(err.value) and "\n" not in str(err.value)
