"""Base weights held by more than one module: a tied ``lm_head``, peft's layer_replication.

Each run goes through the public API and is checked on the whole model against an ideal
computed by hand in fp64 (``ideal_whole_model``): every LoRA layer's effective weight,
every trained extra, and every frozen parameter's bits, the tied input embedding among
them. With the sharing detection switched off (``route_shared`` a no-op, as before it
existed), the same checks fail: the embedding moves, replicated layers get each other's
updates.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import fedexlora.bridge.fold as fold
import fedexlora.bridge.steps as steps
from conftest import load_script
from fedexlora.bridge.fold import load_side_state
from fedexlora.bridge.sharing import base_holders, route_shared
from fedexlora.run.export import save_adapter
from ideal_whole_model import WholeModelIdeal, federate

verify = load_script("benchmarks/verify_export.py")


def _llama(tie: bool = True, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(dtype)


def tied_llama(dtype=torch.float32):
    model = _llama(dtype=dtype)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    return get_peft_model(model, lora)


def tied_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "lm_head"], fan_in_fan_out=True)
    return get_peft_model(GPT2LMHeadModel(cfg), lora)


def replicated_llama():
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      layer_replication=[[0, 2], [0, 2]])  # fmt: skip
    return get_peft_model(_llama(tie=False), lora)


@pytest.fixture
def no_detection(monkeypatch):
    """Today's code before the detection: every fold assumes each base is its own."""
    for mod in (fold, steps):
        monkeypatch.setattr(mod, "route_shared", lambda model, adapter=None: {})


def _embed(model):
    return model.get_base_model().get_input_embeddings().weight


@pytest.mark.parametrize("new_model", [tied_llama, tied_gpt2], ids=["llama", "gpt2"])
def test_lora_on_a_tied_lm_head_leaves_the_embedding_and_is_exact(new_model):
    model = new_model()
    assert list(base_holders(model)) == ["base_model.model.lm_head"]
    emb0 = _embed(model).detach().clone()
    global_model, clients, ideal, reports = federate(new_model)
    for m in [global_model, *clients]:
        ideal.check(m)  # the embedding's bits included
    assert torch.equal(_embed(global_model), emb0)
    assert max(max(r.values()) for r in reports) <= 1e-5


@pytest.mark.parametrize("new_model", [tied_llama, tied_gpt2], ids=["llama", "gpt2"])
def test_without_the_detection_the_tied_embedding_is_corrupted(new_model, no_detection):
    global_model, _, ideal, reports = federate(new_model)
    with pytest.raises(AssertionError, match=r"(embed_tokens|wte)\.weight: inf off its ideal"):
        ideal.check(global_model)
    # the model's own report (apply_outcome) sees it too: the frozen embedding moved
    changed = {k for r in reports for k, v in r.items() if v == float("inf")}
    assert changed and all(k.endswith(("embed_tokens.weight", "wte.weight")) for k in changed)
    assert max(v for r in reports for k, v in r.items() if k not in changed) <= 1e-5


def test_layer_replication_gives_each_copy_its_own_residual():
    model = replicated_llama()
    holders = base_holders(model)
    assert sorted(holders) == sorted(
        f"base_model.model.model.layers.{i}.self_attn.{p}"
        for i in range(4)
        for p in ("q_proj", "v_proj")
    )
    global_model, clients, ideal, _ = federate(replicated_llama)
    for m in [global_model, *clients]:
        ideal.check(m)


def test_without_the_detection_replicated_layers_receive_every_copys_update(no_detection):
    global_model, _, ideal, _ = federate(replicated_llama)
    with pytest.raises(AssertionError, match=r"layers\.\d\.self_attn\.[qv]_proj: "):
        ideal.check(global_model)


def test_a_trained_parameter_sharing_a_base_is_refused_before_any_fold():
    model = tied_llama()
    _embed(model).requires_grad_(True)
    with pytest.raises(
        ValueError,
        match=r"module 'base_model.model.lm_head': its frozen base .*"
        r"trained parameter 'base_model.model.model.embed_tokens.weight'.*fix: ",
    ):
        load_side_state(model, {})  # fmt: skip


def test_the_adapter_export_of_a_tied_lm_head_is_exact_on_the_pristine_base(tmp_path):
    global_model, _, ideal, _ = federate(tied_llama)
    save_adapter(global_model, tmp_path / "adapter")
    base = _llama()
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    fresh = WholeModelIdeal(loaded)  # only to name the loaded model's frozen tensors
    assert set(fresh.frozen) == set(ideal.frozen)
    ideal.check(loaded)


def test_route_shared_is_idempotent_and_leaves_unshared_layers_alone():
    model = tied_llama()
    assert route_shared(model) == route_shared(model)
    assert list(route_shared(model)) == ["base_model.model.lm_head"]
    untied = get_peft_model(_llama(tie=False), LoraConfig(target_modules=["lm_head"]))
    assert base_holders(untied) == {}


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tiny Llama with tied word embeddings (MiniLM's tokenizer, offline)."""
    from transformers import AutoTokenizer

    from fedexlora.bridge.models import resolve_model

    d = tmp_path_factory.mktemp("tied-llama")
    tok = AutoTokenizer.from_pretrained(resolve_model("minilm").path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("beside", [True, False], ids=["side-branch", "no-fp32-side-branch"])
def test_cli_run_and_both_exports_of_a_tied_lm_head_are_exact(
    tied_llama_dir, tiny_qa_jsonl, tmp_path, beside
):
    from transformers import AutoModelForCausalLM

    from fedexlora.config import RunConfig
    from fedexlora.run.export import export_model
    from fedexlora.run.inprocess import run_experiment

    cfg = RunConfig(
        model=tied_llama_dir, task=tiny_qa_jsonl, methods=["fedex"], num_clients=2,
        min_partition_size=4, rounds=2, local_steps=2, batch_size=4, max_length=24,
        lora_r=2, lora_dropout=0.0, lr=2e-2, target_modules=["q_proj", "lm_head"],
        save_client_adapters=True, fp32_side_branch=beside,
    )  # fmt: skip
    rows = run_experiment(cfg, tmp_path / "run", progress=False)
    assert all(r["effective_deviation"]["max"] <= 1e-5 for r in rows)
    ideal, w0 = verify.ideal_from_client_adapters(tmp_path / "run", cfg)
    emb0 = AutoModelForCausalLM.from_pretrained(tied_llama_dir).get_input_embeddings().weight
    for fmt in ("adapter", "merged"):
        res = export_model(tmp_path / "run", tmp_path / fmt, fmt=fmt)
        got = verify.exported(res.path, cfg)  # loaded as a user would, plain peft or HF
        err, err_w = verify.rel(got, ideal, w0), verify.rel_weight(got, ideal)
        assert verify.verdict(fmt, err, err_w, cfg.rounds, 1e-5), (fmt, err, err_w)
        if fmt == "adapter":
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied_llama_dir),
                                               str(res.path))  # fmt: skip
        else:
            loaded = AutoModelForCausalLM.from_pretrained(str(res.path))
        # the input embedding is the pretrained one, bit for bit
        assert torch.equal(loaded.get_input_embeddings().weight, emb0), fmt
