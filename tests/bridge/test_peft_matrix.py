"""The architectures x LoRA options matrix (tests/bridge/peft_matrix.py): every case is
exact against the hand fp64 ideal (every weight and the logits, three clients, two rounds
through the public API) or refused before training, never silently off.

The fast part runs a few architectures under every option; the rest is marked slow.
"""

import re

import pytest
import torch

import peft_matrix as pm

FAST = {"llama", "gpt2", "vit", "mixtral"}

# Cases that fail today for reasons outside this matrix's fixes: a LoRA layer whose base
# tensor another module holds (a tied lm_head, peft's layer_replication), which
# bridge.sharing detects (issue 56, items 1-2). Anything else that fails fails the test.

# The only refusals the matrix may meet, each one line naming the module and the way out.
REFUSALS = (
    r"^module '[^']+' uses DoRA \(use_dora=True\).*set use_dora=False$",
    r"^module '[^']+': LoRA on an embedding whose weight is tied to '[^']+' .*exclude_modules",
)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: one thread each (faster than two, and no oversubscription)."""


def _check(arch, option):
    verdict = pm.run_case(arch, option)
    if verdict.startswith("PEFT"):
        pytest.skip(f"peft itself rejects it: {verdict}")
    if verdict.startswith("REFUSED: "):
        message = verdict.removeprefix("REFUSED: ")
        assert any(re.search(p, message) for p in REFUSALS), verdict
        assert "\n" not in message
        return
    assert verdict == "PASS", verdict


@pytest.mark.parametrize("arch,option", [c for c in pm.CASES if c[0] in FAST])
def test_matrix_fast(arch, option):
    _check(arch, option)


@pytest.mark.slow(seconds=300)
@pytest.mark.parametrize("arch,option", [c for c in pm.CASES if c[0] not in FAST])
def test_matrix_slow(arch, option):
    _check(arch, option)


@pytest.mark.parametrize("arch", ["llama", "vit"])
def test_adapter_export_of_embedding_and_conv_lora_is_the_global_model(arch, tmp_path):
    """save_adapter writes an embedding's and a convolution's widened factors in peft's
    own layout: the adapter on the untouched base gives the global model's logits."""
    from peft import PeftModel

    from fedexlora.run.export import save_adapter

    keep = {}
    assert pm.run_case(arch, "embeddings", keep=keep) == "PASS"
    model = keep["model"]
    save_adapter(model, tmp_path / "adapter")
    fresh = pm.base(arch)  # the pretrained weights
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    x = pm.inputs(arch, 7)
    with torch.no_grad():
        want, got = model(**x).logits, loaded(**x).logits
        start = pm.build(arch, "embeddings")(**x).logits
    assert pm._rel(got.double(), want.double(), start.double()) < 1e-4


def test_target_parameters_on_a_bf16_expert_stack_is_refused_in_one_line():
    """Stacked experts have no forward to hook a side branch into: fp32 only, said so."""
    model = pm.build("mixtral", "target_parameters").to(torch.bfloat16)
    from fedexlora.bridge.layers import lora_layers

    with pytest.raises(
        ValueError,
        match=r"experts.*target_parameters on a torch.bfloat16 "
        r"parameter is not supported.*load the model in fp32",
    ) as err:
        lora_layers(model)
    assert "\n" not in str(err.value)
