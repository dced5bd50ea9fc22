"""FedEx-LoRA on DoRA models (use_dora=True) through the public API, against a hand ideal.

A tiny Llama with DoRA on q_proj and v_proj, three clients of unequal weight, three
rounds of the public steps (``Server``, ``apply_payload``, ``make_upload``,
``apply_outcome``). Each round's ideal is computed by hand in fp64 from the clients' own
tensors after training: ``T = sum_i p_i diag(m_i / ||V_i||) V_i`` with
``V_i = W + s B_i A_i`` (:func:`fedexlora.core.dora.dora_weight`, checked against peft's
forward in ``test_dora_math.py``), compounding over rounds (each round's clients start
from the global model). The global model and every client at the next round's start must
apply ``T`` in every DoRA layer, hold the averaged factors, the magnitude ``||T||`` and
the base ``T / Dbar - s Bbar Abar``, keep every other parameter bit-identical, and give
the ideal model's logits.
"""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.adapters import get_state, layer_info
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.steps import apply_outcome, apply_payload, make_upload
from fedexlora.core.dora import dora_weight
from fedexlora.server import Server

WEIGHTS = (3, 5, 8)
TOL = 1e-5  # relative to the ideal weight (fp32 fold and magnitude: ~1e-7)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: one thread each (faster than two, and no oversubscription)."""


def _model(**lora):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base = LlamaForCausalLM(cfg).eval()
    opts = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    opts.update(lora)
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(use_dora=True, **opts)).eval()


def _ids(seed):
    return torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(seed))


def _train(model, seed, steps=3):
    x = _ids(seed)
    with torch.no_grad():
        target = torch.randn(model(x).logits.shape, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        (model(x).logits - target).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _tensors(layer):
    """``(W, A, B, m, s)`` of a DoRA layer, fp64, ``W`` as ``(d, n)``."""
    return (
        layer_kinds.base_matrix(layer),
        layer.lora_A["default"].weight.detach().double(),
        layer.lora_B["default"].weight.detach().double(),
        layer.lora_magnitude_vector["default"].weight.detach().double(),
        float(layer.scaling["default"]),
    )


def _weights(model):
    """Each DoRA layer's weight, by hand from its own tensors (fp64)."""
    return {n: dora_weight(*_tensors(x)) for n, x in lora_layers(model).items()}


def _frozen(model):
    """Every parameter that is neither LoRA nor a DoRA layer's (folded) base weight."""
    folded = {n + ".base_layer.weight" for n in lora_layers(model)}
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if ".lora_" not in n and n not in folded
    }


def _rel(got, want):
    return float(torch.linalg.norm(got - want) / torch.linalg.norm(want))


def _ideal_logits(model, T, x):
    """The logits of ``model`` with each DoRA layer applying exactly ``T`` (fp64)."""
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        for n, layer in lora_layers(m).items():
            layer.get_base_layer().weight.copy_(T[n])
            layer.lora_B["default"].weight.zero_()
            layer.lora_magnitude_vector["default"].weight.copy_(torch.linalg.norm(T[n], dim=1))
        return m(x).logits


def test_dora_three_clients_three_rounds_exact():
    server_model = _model()
    clients = [_model() for _ in WEIGHTS]
    frozen0 = _frozen(server_model)
    server = Server(get_state(server_model), layer_info(server_model), num_clients=3)
    p = torch.tensor(WEIGHTS, dtype=torch.float64) / sum(WEIGHTS)
    T = _weights(server_model)  # round 0: the pretrained weight (B = 0)
    for rnd in range(1, 4):
        for i, c in enumerate(clients):
            apply_payload(c, server.payload_for(i))
            for n, w in _weights(c).items():  # every client starts at the ideal
                assert _rel(w, T[n]) < TOL, (rnd, i, n, _rel(w, T[n]))
        uploads, own, scales = [], [], []
        for i, c in enumerate(clients):
            _train(c, seed=10 * rnd + i)
            own.append(_weights(c))
            scales.append({n: _tensors(x) for n, x in lora_layers(c).items()})
            uploads.append(make_upload(c, WEIGHTS[i], client_id=i))
        T = {n: sum(p[i] * own[i][n] for i in range(3)) for n in T}  # compounding
        outcome = server.aggregate(uploads)
        apply_outcome(server_model, server, outcome, uploads)
        for n, layer in lora_layers(server_model).items():
            W, A, B, m, s = _tensors(layer)
            assert _rel(dora_weight(W, A, B, m, s), T[n]) < TOL, (rnd, n)
            Abar = sum(p[i] * scales[i][n][1] for i in range(3))
            Bbar = sum(p[i] * scales[i][n][2] for i in range(3))
            assert _rel(A, Abar) < 1e-6 and _rel(B, Bbar) < 1e-6, (rnd, n)
            assert _rel(m, torch.linalg.norm(T[n], dim=1)) < TOL, (rnd, n)
            Dbar = sum(
                p[i]
                * scales[i][n][3]
                / torch.linalg.norm(
                    scales[i][n][0] + s * (scales[i][n][2] @ scales[i][n][1]), dim=1
                )
                for i in range(3)
            )
            assert _rel(W, T[n] / Dbar[:, None] - s * Bbar @ Abar) < TOL, (rnd, n)
        for n, t in _frozen(server_model).items():  # bit for bit
            assert torch.equal(t, frozen0[n]), n
        x = _ids(99)
        with torch.no_grad():
            got = server_model(x).logits.double()
        assert _rel(got, _ideal_logits(server_model, T, x)) < TOL, rnd


def test_dora_refused_by_other_methods_in_one_line():
    model = _model()
    with pytest.raises(
        ValueError, match=r"q_proj' uses DoRA .*method 'fedit'.*'fedex'.*use_dora=False$"
    ):
        Server(get_state(model), layer_info(model), method="fedit", num_clients=3)


def test_dora_on_a_bf16_base_refused_in_one_line():
    model = _model().to(torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"q_proj' uses DoRA .*torch.bfloat16 base.*load the model in fp32"
    ):
        get_state(model)


def test_dora_adapter_export_on_the_untouched_base_is_the_global_model(tmp_path):
    """save_adapter keeps use_dora and the magnitude: on the pretrained base, the widened
    factors rebuild ``V'`` (base plus what was folded) and the magnitude gives ``T``."""
    from peft import PeftModel

    from fedexlora.run.export import save_adapter

    server_model = _model()
    clients = [_model() for _ in WEIGHTS]
    server = Server(get_state(server_model), layer_info(server_model), num_clients=3)
    for rnd in range(1, 3):
        uploads = []
        for i, c in enumerate(clients):
            apply_payload(c, server.payload_for(i))
            _train(c, seed=10 * rnd + i)
            uploads.append(make_upload(c, WEIGHTS[i], client_id=i))
        apply_outcome(server_model, server, server.aggregate(uploads), uploads)
    save_adapter(server_model, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_model().get_base_model(), str(tmp_path / "adapter"))
    x = _ids(7)
    with torch.no_grad():
        want = server_model(x).logits.double()
        got = loaded.eval()(x).logits.double()
    assert _rel(got, want) < TOL


def test_dora_client_catching_up_after_skipped_rounds_holds_the_global_model():
    """Partial participation: a client back after skipped rounds gets the residuals it
    missed (additive, as for LoRA) and the latest row scale, and applies the server's
    global DoRA weights exactly."""
    server_model = _model()
    clients = [_model() for _ in WEIGHTS]
    server = Server(get_state(server_model), layer_info(server_model), num_clients=3, fraction=0.34)
    back = 0
    for rnd in range(1, 5):
        uploads = []
        for i in server.sample(rnd):
            back += server.client_version.get(i, 0) < server.version - 1  # skipped rounds
            apply_payload(clients[i], server.payload_for(i))
            want, got = _weights(server_model), _weights(clients[i])
            for n in want:
                assert _rel(got[n], want[n]) < TOL, (rnd, i, n, _rel(got[n], want[n]))
            _train(clients[i], seed=10 * rnd + i)
            uploads.append(make_upload(clients[i], WEIGHTS[i], client_id=i))
        apply_outcome(server_model, server, server.aggregate(uploads), uploads)
    assert back  # some client did catch up over more than one round
