"""peft's options beyond the matrix's rows, through the same independent ideal
(tests/bridge/peft_matrix.py: every weight and the logits against an fp64 ideal kept by
hand from the clients' models, peft's own ``merge`` defining each layer's weight):
exact, or refused before training in one line, never silently off.

- LoRA variants (``LoraLayer.lora_variant``): VeLoRA and MiCA still add
  ``scaling * B @ A`` and are exact; KaSA (``B diag(s) A``), aLoRA (the update on the
  tokens from the invocation on) and BD-LoRA (block-diagonal factors) change the
  update's form and are refused, naming their option.
- Two adapters active at once (each would train, one be federated): refused.
- One adapter under another name than ``default``: exact.
- LoRA factors in bf16 (cast after ``get_peft_model``): refused (they cannot hold the
  averaged factors).
- DoRA on a base another module holds (a tied ``lm_head``; ``layer_replication``):
  refused before training, not half-way through a fold.
- Clients built with another LoRA scaling than the server's (``lora_alpha`` 16 against
  8): refused at the first payload (their folds would be off by the ratio).
"""

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_matrix as pm

T = ["q_proj", "v_proj"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: one thread each (faster than two, and no oversubscription)."""


def _peft(arch="llama", tie=False, **kw):
    model = pm.base(arch)
    if tie:  # tied input and output embeddings (one storage)
        model.config.tie_word_embeddings = True
        model.tie_weights()
    adapter = kw.pop("_adapter", "default")
    alpha = kw.pop("lora_alpha_override", 8)
    torch.manual_seed(0)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=alpha, lora_dropout=0.0, **kw), adapter_name=adapter
    ).eval()


def _variant(**options):
    import peft.tuners.lora.config as lc

    made = {}
    for k, v in options.items():  # (config class name, its kwargs): peft's own config
        made[k] = getattr(lc, v[0])(**v[1]) if isinstance(v, tuple) else v
    return lambda: _peft(target_modules=T, **made)


def _two_active():
    m = _peft(target_modules=T)
    torch.manual_seed(1)
    m.add_adapter("second", LoraConfig(r=4, lora_alpha=16, target_modules=T))
    m.base_model.set_adapter(["default", "second"])
    return m


def _bf16_factors():
    m = _peft(target_modules=T)
    m.model.to(torch.bfloat16)  # the whole model, factors included
    return m


def _dora_tied():
    return _peft(tie=True, target_modules=["lm_head", "q_proj"], use_dora=True)


def _server_alpha_8_clients_16():
    """The first model built (run_case's global one) with lora_alpha 8, the clients' 16."""
    built = []

    def make():
        built.append(1)
        return _peft(target_modules=T, lora_alpha_override=8 if len(built) == 1 else 16)

    return make


CASES = {
    "velora": ("PASS", _variant(velora_config=("VeloraConfig", {"num_groups": 4}))),
    "mica": ("PASS", _variant(init_lora_weights="mica")),
    "adapter named 'mine'": ("PASS", lambda: _peft(target_modules=T, _adapter="mine")),
    "kasa": ("kasa_config", _variant(kasa_config=("KasaConfig", {}))),
    "alora": ("alora_invocation_tokens", _variant(alora_invocation_tokens=[7, 8])),
    "bdlora": (
        "use_bdlora",
        _variant(use_bdlora=("BdLoraConfig", {"target_modules_bd_a": T, "nblocks": 2})),
    ),
    "two active adapters": ("are active at once", _two_active),
    "bf16 factors": ("keep the adapter in fp32", _bf16_factors),
    "dora, tied lm_head": ("holds too (tied or replicated)", _dora_tied),
    "server and clients of other scales": (
        "the client's LoRA scaling is 4, the server's 2",
        _server_alpha_8_clients_16(),
    ),
    "dora, layer_replication": (
        "holds too (tied or replicated)",
        lambda: _peft(target_modules=T, use_dora=True, layer_replication=[[0, 2], [1, 2]]),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_variant_is_exact_or_refused_before_training(case):
    want, builder = CASES[case]
    verdict = pm.run_case("llama", case, builder=builder)
    if verdict.startswith("PEFT"):
        pytest.skip(f"this peft cannot build it: {verdict}")
    if want == "PASS":
        assert verdict == "PASS", verdict
        return
    assert verdict.startswith("REFUSED: "), verdict
    message = verdict.removeprefix("REFUSED: ")
    assert want in message and "\n" not in message, message
    assert re.match(r"^module '[^']+'", message), message
