"""Bridge equivalence: the aggregated global peft model equals an independently merged ideal."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from fedexlora import AdapterState, aggregate_states
from fedexlora.bridge.adapters import get_state, layer_info, set_state
from fedexlora.bridge.fold import fold_residuals
from fedexlora.bridge.layers import lora_layers


def _bert():
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg).eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg).eval()


BERT_TARGETS = r".*\.(query|value|intermediate\.dense)$"
CASES = {
    "bert": (_bert, dict(target_modules=BERT_TARGETS, modules_to_save=["classifier"])),
    "gpt2-conv1d": (_gpt2, dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)),
    "bert-rslora": (
        _bert,
        dict(target_modules=BERT_TARGETS, use_rslora=True, modules_to_save=["classifier"]),
    ),
    "bert-embeddings": (
        _bert,
        dict(target_modules=r".*(word_embeddings|\.query)$", modules_to_save=["classifier"]),
    ),
    "bert-rank-pattern": (
        _bert,
        dict(
            target_modules=BERT_TARGETS,
            rank_pattern={"value": 2},
            alpha_pattern={"intermediate.dense": 5},
            modules_to_save=["classifier"],
        ),
    ),
}


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 100, (4, 10), generator=g)}


def _perturbed_clients(global_state: AdapterState, k: int, scale=0.3):
    g = torch.Generator().manual_seed(2)
    clients = []
    for _ in range(k):
        s = global_state.clone()
        for name, (A, B) in s.factors.items():
            s.factors[name] = (
                A + scale * torch.randn(A.shape, generator=g),
                B + scale * torch.randn(B.shape, generator=g),
            )
        for name, t in s.extra.items():
            s.extra[name] = t + scale * torch.randn(t.shape, generator=g)
        clients.append(s)
    return clients


def _ideal_model(base, peft_scratch, clients, weights):
    """A plain model with W0 + sum p_i delta_i from peft's own get_delta_weight."""
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    ideal = copy.deepcopy(base)
    ideal_params = dict(ideal.named_parameters())
    layers = lora_layers(peft_scratch)
    deltas = {name: 0 for name in layers}
    heads = {}
    for pi, st in zip(p, clients):
        set_state(peft_scratch, st)
        for name, layer in layers.items():
            deltas[name] = deltas[name] + pi * layer.get_delta_weight("default").double()
        for pname, t in st.extra.items():
            heads[pname] = heads.get(pname, 0) + pi * t.double()
    with torch.no_grad():
        for name, delta in deltas.items():
            w = ideal_params[name.removeprefix("base_model.model.") + ".weight"]
            w.add_(delta.to(w.dtype))
        for pname, t in heads.items():
            plain = pname.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
            ideal_params[plain].copy_(t.to(torch.float32))
    return ideal


def _rel(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def _round(case, method, k=3, weights=(5.0, 1.0, 3.0)):
    make, kw = CASES[case]
    base = make()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kw)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    scratch = get_peft_model(copy.deepcopy(base), cfg).eval()
    g0 = get_state(model)
    clients = _perturbed_clients(g0, k)
    ideal = _ideal_model(base, scratch, clients, list(weights))
    agg = aggregate_states(clients, list(weights), method)
    fold_residuals(model, agg.residuals)
    set_state(model, agg.state)
    x = _inputs(model)
    with torch.no_grad():
        out = model(**x).logits
        ref = ideal(**x).logits
    return _rel(out, ref), agg


@pytest.mark.parametrize("case", list(CASES))
def test_fedex_global_model_equals_ideal_merge(case):
    rel, agg = _round(case, "fedex")
    assert rel < 1e-5, rel
    assert max(agg.effective_deviation.values()) < 1e-5
    for R in agg.residuals.values():
        assert R.rank <= 2 * 4


@pytest.mark.parametrize("case", list(CASES))
def test_fedit_deviates_clearly(case):
    rel, agg = _round(case, "fedit")
    assert rel > 1e-3, rel
    assert min(agg.deviation.values()) > 1e-2


@pytest.mark.parametrize("case", ["bert", "gpt2-conv1d"])
def test_flora_global_model_equals_ideal_merge(case):
    rel, _ = _round(case, "flora")
    assert rel < 1e-5, rel


def test_three_rounds_accumulate_exactly():
    """Track the ideal effective weights independently: W <- W - delta(global) + sum p_i delta_i."""
    make, kw = CASES["gpt2-conv1d"]
    base = make()
    cfg = LoraConfig(r=3, lora_alpha=6, init_lora_weights=False, **kw)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    scratch = get_peft_model(copy.deepcopy(base), cfg).eval()
    layers = lora_layers(scratch)
    ideal = copy.deepcopy(base)
    params = dict(ideal.named_parameters())
    key = {n: n.removeprefix("base_model.model.") + ".weight" for n in layers}
    w = [1.0, 2.0, 3.0]
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    set_state(scratch, get_state(model))
    with torch.no_grad():
        for n, layer in layers.items():  # the initial adapters' delta
            params[key[n]].add_(layer.get_delta_weight("default"))
    for _ in range(3):
        global_state = get_state(model)
        clients = _perturbed_clients(global_state, 3, scale=0.2)
        set_state(scratch, global_state)
        with torch.no_grad():
            for n, layer in layers.items():
                params[key[n]].sub_(layer.get_delta_weight("default"))
            for pi, st in zip(p, clients):
                set_state(scratch, st)
                for n, layer in layers.items():
                    params[key[n]].add_(pi.item() * layer.get_delta_weight("default"))
        agg = aggregate_states(clients, w, "fedex")
        fold_residuals(model, agg.residuals)
        set_state(model, agg.state)
    x = _inputs(model)
    with torch.no_grad():
        assert _rel(model(**x).logits, ideal(**x).logits) < 1e-5
        merged = copy.deepcopy(model).merge_and_unload()
        assert _rel(merged(**x).logits, ideal(**x).logits) < 1e-5


def test_layer_info_reads_orientation_and_scale():
    make, kw = CASES["gpt2-conv1d"]
    model = get_peft_model(make(), LoraConfig(r=4, lora_alpha=8, use_rslora=True, **kw))
    info = layer_info(model)
    c_attn = next(v for k, v in info.items() if k.endswith("0.attn.c_attn"))
    assert c_attn.fan_in_fan_out and c_attn.shape == (96, 32) and c_attn.scale == pytest.approx(4.0)
    make, kw = CASES["bert-rank-pattern"]
    info = layer_info(get_peft_model(make(), LoraConfig(r=4, lora_alpha=8, **kw)))
    value = next(v for k, v in info.items() if k.endswith("0.attention.self.value"))
    inter = next(v for k, v in info.items() if k.endswith("0.intermediate.dense"))
    assert not value.fan_in_fan_out and value.rank == 2 and value.scale == pytest.approx(4.0)
    assert inter.shape == (48, 32) and inter.scale == pytest.approx(5 / 4)


def test_refuses_dora_on_an_embedding():
    """FedEx's DoRA path covers linear layers only: DoRA on an embedding is refused."""
    model = get_peft_model(
        _bert(), LoraConfig(r=2, target_modules=["word_embeddings"], use_dora=True)
    )
    with pytest.raises(
        ValueError,
        match=r"word_embeddings' uses DoRA \(use_dora=True\) on a Embedding.*use_dora=False$",
    ):
        get_state(model)


def test_refuses_grouped_convolution_naming_the_way_out():
    """A grouped convolution's LoRA (peft groups only B) is not B @ A: refused, one line."""
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, groups=2), torch.nn.Conv2d(4, 2, 1))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0", "1"]))
    with pytest.raises(
        ValueError,
        match=r"module '.*0': LoRA on a grouped convolution \(groups=2\)"
        r".*exclude_modules",
    ) as err:
        lora_layers(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("conv", "match"),
    [
        (dict(padding=1, padding_mode="circular"), r"padding_mode='circular' is not linear"),
        (dict(padding=1, padding_mode="reflect"), r"padding_mode='reflect' is not linear"),
        (dict(padding="same", padding_mode="replicate"), r"padding_mode='replicate'"),
        (dict(dilation=2), r"dilated convolution \(dilation=\(2, 2\)\)"),
    ],
)
def test_refuses_a_convolution_whose_lora_branch_peft_pads_or_dilates_otherwise(conv, match):
    """peft's lora_A zero-pads and is undilated: with another padding_mode the residual
    folded into the base (which pads as the base does) misses the clients' average at the
    borders (10% of the update, reported as 4e-8); dilated, peft's forward fails."""
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, **conv), torch.nn.Conv2d(4, 2, 1))
    model = get_peft_model(net, LoraConfig(r=2, target_modules=["0", "1"]))
    with pytest.raises(ValueError, match=r"module '.*0': LoRA on a .*" + match) as err:
        lora_layers(model)
    assert "exclude_modules" in str(err.value) and "\n" not in str(err.value)
    # unpadded, the padding mode is never used: accepted
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding_mode="reflect"))
    assert list(lora_layers(get_peft_model(net, LoraConfig(r=2, target_modules=["0"]))))


def test_refuses_mismatched_client_states():
    make, kw = CASES["bert"]
    model = get_peft_model(make(), LoraConfig(r=4, **kw))
    state = get_state(model)
    name = next(iter(state.factors))
    missing = state.clone()
    del missing.factors[name]
    with pytest.raises(ValueError, match="missing modules"):
        set_state(model, missing)
    wrong = state.clone()
    A, B = wrong.factors[name]
    wrong.factors[name] = (A, torch.zeros(B.shape[0], B.shape[1] + 1))
    with pytest.raises(ValueError, match="B has shape"):
        set_state(model, wrong)
    other = AdapterState(factors={"nope": (A, B)}, extra=state.extra)
    with pytest.raises(ValueError, match="unknown modules \\['nope'\\]"):
        set_state(model, other)
    with pytest.raises(ValueError, match="covers other modules"):
        aggregate_states([state, missing], None, "fedex")


@pytest.mark.parametrize("case", ["bert", "gpt2-conv1d", "bert-embeddings"])
def test_client_state_is_lean_and_rebuilds_the_model_bit_for_bit(case):
    """A client keeps what it received, factored, never a base weight; a freshly loaded
    model plus that state equals the live model bit for bit, round after round."""
    from fedexlora.bridge.steps import client_state, load_client_state

    make, kw = CASES[case]
    base = make()
    cfg = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **kw)
    live = get_peft_model(copy.deepcopy(base), cfg).eval()
    weights = {n: layer.get_base_layer().weight for n, layer in lora_layers(live).items()}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    for rnd in range(3):
        clients = _perturbed_clients(get_state(live), 3, scale=0.2)
        agg = aggregate_states(clients, [1.0, 2.0, 3.0], "fedex")
        fold_residuals(live, agg.residuals)
        set_state(live, agg.state)
        state = client_state(live)
        assert all(k.startswith(("side.", "adapter.")) for k in state), sorted(state)[:3]
        held = sum(v.numel() * v.element_size() for k, v in state.items() if k.startswith("side."))
        assert 0 < held < weight_bytes  # rank 4 per round: factored, smaller than a copy
        fresh = get_peft_model(copy.deepcopy(base), cfg).eval()
        load_client_state(fresh, state)
        theirs = fresh.state_dict()
        for name, t in live.state_dict().items():
            assert torch.equal(t, theirs[name]), (rnd, name)


def test_set_trainable_applies_a_round_plan_to_factors_and_head():
    """A, B and the head (``modules_to_save``) freeze and thaw as a round plan asks;
    what the adapter does not own stays as it was."""
    from fedexlora.bridge.adapters import LoraHandle

    model = get_peft_model(
        _bert(), LoraConfig(r=2, target_modules=BERT_TARGETS, modules_to_save=["classifier"])
    )

    def grads(tag):
        return {p.requires_grad for n, p in model.named_parameters() if tag in n}

    frozen_before = {n for n, p in model.named_parameters() if not p.requires_grad}
    handle = LoraHandle(model)
    for train_A, train_B, train_extra in [(False, True, True), (True, False, False),
                                          (True, True, True)]:  # fmt: skip
        handle.set_trainable(train_A, train_B, train_extra)
        assert grads(".lora_A.") == {train_A} and grads(".lora_B.") == {train_B}
        assert grads(".modules_to_save.default.") == {train_extra}
        assert grads("original_module") == {False}  # the head's base copy never trains
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen_before


def test_adapter_nbytes_counts_one_adapter_and_nothing_else(tiny_bert_dir):
    """r (in + out) fp32 numbers per adapted layer, for the adapter asked for only: not a
    second adapter (``client_ranks`` adds one per rank), the head or the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from fedexlora.bridge.fold import adapter_nbytes

    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir)
    targets = ["query", "value"]
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, task_type="SEQ_CLS"))
    model.add_adapter("rank2", LoraConfig(r=2, target_modules=targets, task_type="SEQ_CLS"))
    shapes = [m.weight.shape for n, m in base.named_modules() if n.endswith(("query", "value"))
              and hasattr(m, "weight")]  # fmt: skip
    sides = sum(sum(s) for s in shapes)
    assert len(shapes) == 4  # 2 layers x query, value
    assert adapter_nbytes(model) == 4 * 4 * sides
    assert adapter_nbytes(model, "rank2") == 4 * 2 * sides
