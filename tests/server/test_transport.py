"""Transport: payloads bring every client exactly to the global model, whatever it missed."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

from fedexlora.bridge.adapters import get_state, layer_info, set_state
from fedexlora.bridge.fold import fold_residuals
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.steps import apply_payload
from fedexlora.server import ClientUpload, Payload, Server


def _peft_gpt2(n_embd=32):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_embd=n_embd, n_layer=2, n_head=2, n_positions=32)
    base = GPT2LMHeadModel(cfg).eval()
    lora = LoraConfig(r=3, lora_alpha=6, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    return get_peft_model(base, lora).eval()


def _effective(model):
    """Per adapted layer: base weight (out, in) + peft's own delta."""
    out = {}
    for name, layer in lora_layers(model).items():
        w = layer.get_base_layer().weight.detach()
        w = w.T if layer.fan_in_fan_out else w
        delta = layer.get_delta_weight("default")
        out[name] = w.double() + (delta.T if layer.fan_in_fan_out else delta).double()
    return out


def _rel(a, b):
    return max((torch.linalg.norm(a[k] - b[k]) / torch.linalg.norm(b[k])).item() for k in a)


def _train(state, gen, scale=0.05):
    s = state.clone()
    for name, (A, B) in s.factors.items():
        s.factors[name] = (
            A + scale * torch.randn(A.shape, generator=gen),
            B + scale * torch.randn(B.shape, generator=gen),
        )
    return s


def _run_partial(method, rounds=5, num_clients=6, fraction=0.5, residual_rank=None, n_embd=32):
    server_model = _peft_gpt2(n_embd)
    clients = [copy.deepcopy(server_model) for _ in range(num_clients)]
    server = Server(
        get_state(server_model),
        layer_info(server_model),
        method=method,
        num_clients=num_clients,
        fraction=fraction,
        seed=3,
        residual_rank=residual_rank,
    )
    gen = torch.Generator().manual_seed(0)
    worst, sizes = 0.0, []
    for rnd in range(1, rounds + 1):
        uploads = []
        for c in server.sample(rnd):
            wire = server.payload_for(c).to_bytes()  # what goes over the wire
            payload = Payload.from_bytes(wire)
            sizes.append(payload.nbytes)
            apply_payload(clients[c], payload)  # a reset one starts again from W0
            worst = max(worst, _rel(_effective(clients[c]), _effective(server_model)))
            uploads.append(ClientUpload(c, _train(get_state(clients[c]), gen), 10 + c))
        outcome = server.aggregate(uploads)
        fold_residuals(server_model, outcome.residuals)
        set_state(server_model, server.state)
    return worst, server, sizes


@pytest.mark.parametrize("n_embd", [32, 128])
def test_partial_participation_catch_up_is_exact(n_embd):
    """32: the history reaches one round, so clients are reset from W0 when they come
    back; 128: it reaches several, so they are caught up from it."""
    worst, server, _ = _run_partial("fedex", n_embd=n_embd)
    assert worst < 1e-6
    assert server.version == 5
    # versions no remembered client needs are pruned
    oldest = min(server.client_version.values(), default=server.version)
    assert oldest <= server.history_floor
    assert (n_embd == 128) == bool(server.client_version)  # 128: clients told to keep


@pytest.mark.parametrize("method", ["fedit", "flora"])
def test_other_methods_also_reach_the_global_model(method):
    worst, _, _ = _run_partial(method, rounds=3)
    assert worst < 1e-6


def test_catch_up_is_refactored_not_stacked():
    _, server, _ = _run_partial("fedex", rounds=5, n_embd=128)
    since = min(server.history)
    missed = server.version - since
    assert missed >= 2
    res = server.catch_up(since)
    for name, info in server.layers.items():
        d, n = info.shape
        bound = min(d, n, missed * 5 * info.rank)
        assert res[name].rank <= bound
        dense_bytes = d * n * 4
        assert res[name].nbytes <= dense_bytes


def test_payload_roundtrip_and_bytes_counted_from_tensors():
    model = _peft_gpt2()
    server = Server(get_state(model), layer_info(model), num_clients=2)
    gen = torch.Generator().manual_seed(0)
    ups = []
    for c in server.sample(1):
        server.payload_for(c)
        ups.append(ClientUpload(c, _train(get_state(model), gen), 5))
    server.aggregate(ups)
    p = server.payload_for(0)
    flat = p.to_flat()
    assert p.nbytes == sum(t.numel() * t.element_size() for t in flat.values())
    back = Payload.from_flat(flat, round=p.round, version=p.version)
    assert back.nbytes == p.nbytes
    for name, r in p.residuals.items():
        assert torch.equal(back.residuals[name].to_dense(), r.to_dense())


def _rounds(model, residual_rank):
    """3 rounds of 4 clients with seeded uploads; the uploads depend only on A and B."""
    server = Server(get_state(model), layer_info(model), num_clients=4, residual_rank=residual_rank)
    gen = torch.Generator().manual_seed(1)
    outcomes = []
    for rnd in range(1, 4):
        ups = []
        for c in server.sample(rnd):
            server.payload_for(c)
            ups.append(ClientUpload(c, _train(server.state, gen, 0.3), 7 + c))
        outcomes.append(server.aggregate(ups))
        fold_residuals(model, outcomes[-1].residuals)
        set_state(model, server.state)
    return server, outcomes


def test_lossy_residual_rank_keeps_the_remainder_as_error_feedback():
    model = _peft_gpt2()
    server, outcomes = _rounds(model, residual_rank=1)
    for out in outcomes:
        assert all(r.rank <= 1 for r in out.residuals.values())
        assert max(out.feedback_norm.values()) > 0
    # nothing dropped for good: lossy model + scale * feedback == exact model of those uploads
    # (truncation touches only R, so both runs see the same A, B and the same uploads)
    eff = _effective(model)
    for name, layer in lora_layers(model).items():
        eff[name] = eff[name] + layer.scaling["default"] * server.feedback[name].to_dense().double()
    exact = _peft_gpt2()
    _rounds(exact, residual_rank=None)
    assert _rel(eff, _effective(exact)) < 1e-6


def test_lossy_run_is_labelled_approximate_and_logs_its_gap(tiny_cfg, tmp_path):
    from fedexlora.run.inprocess import run_experiment

    rows = run_experiment(
        tiny_cfg.replace(methods=["fedex"], residual_rank=1), tmp_path, progress=False
    )
    assert all(r["approximate"] for r in rows)
    assert all(r["approximation_gap"]["max"] > 0 for r in rows)
    assert all(max(r["residual_rank"].values()) <= 1 for r in rows)
    assert "fedex (approximate)" in (tmp_path / "summary.md").read_text()
