"""The 2024-25 methods, each against an independent computation from its paper's equations
(dense fp64, never the method's own code), then end to end on both engines, where the
model's effective weights are checked against an ideal rebuilt from the saved client
adapters."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedexlora.bridge.adapters import get_state, layer_info
from fedexlora.bridge.fold import effective_weight
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.steps import apply_payload
from fedexlora.core.aggregation import aggregate
from fedexlora.core.messages import ClientUpload
from fedexlora.run.inprocess import run_experiment
from fedexlora.server import Server

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=9)


def _factors(k=4, r=3, d=10, n=12, seed=0, shared_A=False):
    g = torch.Generator().manual_seed(seed)
    A0 = torch.randn(r, n, generator=g, dtype=torch.float64)
    As = [A0.clone() if shared_A else torch.randn(r, n, generator=g, dtype=torch.float64)
          for _ in range(k)]  # fmt: skip
    Bs = [torch.randn(d, r, generator=g, dtype=torch.float64) for _ in range(k)]
    w = torch.rand(k, generator=g, dtype=torch.float64) + 0.1
    return As, Bs, w / w.sum()


def _projector(rows):  # sign- and basis-free: the row space of an (r, n) matrix
    return rows.T @ torch.linalg.pinv(rows.T)


def _two_rank_model(tiny_bert_dir):
    """A rank-4 global adapter (random B, so its update is not zero) and a rank-2 one:
    ``(model, global layer info, rank-2 layer info)``."""
    import dataclasses

    from fedexlora.bridge.models import load_model

    model = load_model(
        tiny_bert_dir, causal=False, num_labels=3, r=4, alpha=8, dropout=0.0,
        target_modules=["query", "value"],
    )[0]  # fmt: skip
    model.add_adapter("rank2", dataclasses.replace(model.peft_config["default"], r=2))
    g = torch.Generator().manual_seed(0)
    for layer in lora_layers(model).values():
        w = layer.lora_B["default"].weight
        w.data = torch.randn(w.shape, generator=g)
    return model, layer_info(model, "default"), layer_info(model, "rank2")


# -- FedSVD ---------------------------------------------------------------------------
def test_fedsvd_is_the_svd_of_the_averaged_B_times_the_shared_A():
    As, Bs, p = _factors(shared_A=True)
    res = aggregate(As, Bs, p, method="fedsvd")
    B_bar = sum(pi * B for pi, B in zip(p, Bs))
    ideal = B_bar @ As[0]  # = sum_i p_i B_i A (A shared): the round is exact
    U, S, Vh = torch.linalg.svd(ideal)
    r = As[0].shape[0]
    assert torch.allclose(res.B @ res.A, ideal, atol=1e-10)
    assert torch.allclose(res.A @ res.A.T, torch.eye(r, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(_projector(res.A), Vh[:r].T @ Vh[:r], atol=1e-10)
    # every singular value sits in B: its columns are U_r Σ_r (up to sign)
    assert torch.allclose(res.B.norm(dim=0), S[:r], atol=1e-10)
    assert res.residual.is_zero


def test_fedsvd_refuses_clients_whose_A_differ():
    As, Bs, p = _factors()
    with pytest.raises(ValueError, match="fedsvd requires every client to share the frozen A"):
        aggregate(As, Bs, p, method="fedsvd")


def test_fedsvd_server_sends_the_new_A_every_round_and_ffa_does_not(tiny_bert_dir):
    from test_scale import _model

    model = _model(tiny_bert_dir)
    for method, sends_A in (("fedsvd", True), ("ffa", False)):
        server = Server(get_state(model), layer_info(model), num_clients=2, method=method)
        first = [server.payload_for(c) for c in (0, 1)]
        assert all(all(A is not None for A, _ in p.state.factors.values()) for p in first)
        g = torch.Generator().manual_seed(1)
        ups = [
            ClientUpload(
                c,
                type(server.state)(
                    factors={
                        k: (None, torch.randn(B.shape, generator=g))
                        for k, (_, B) in server.state.factors.items()
                    },  # fmt: skip
                    extra=server.state.extra,
                ),
                10 + c,
            )
            for c in (0, 1)
        ]
        before = {k: A.clone() for k, (A, _) in server.state.factors.items()}
        outcome = server.aggregate(ups)
        assert outcome.accepted == [0, 1]
        moved = any(not torch.equal(server.state.factors[k][0], A) for k, A in before.items())
        assert moved is sends_A
        nxt = server.payload_for(0)
        assert all((A is not None) is sends_A for A, _ in nxt.state.factors.values())
        # a client that applies it holds the server's global factors (A included)
        apply_payload(model, first[0])
        apply_payload(model, nxt)
        got = get_state(model)
        for k, (A, B) in server.state.factors.items():
            assert torch.equal(got.factors[k][0], A) and torch.equal(got.factors[k][1], B)


# -- FlexLoRA -------------------------------------------------------------------------
def test_flexlora_is_the_eckart_young_truncation_of_the_weighted_update():
    As, Bs, p = _factors(k=4, r=3)
    res = aggregate(As, Bs, p, method="flexlora")
    full = sum(pi * B @ A for pi, A, B in zip(p, As, Bs))  # rank up to k r = 12
    U, S, Vh = torch.linalg.svd(full)
    r = 3
    best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
    assert torch.allclose(res.B @ res.A, best, atol=1e-10)
    # its loss is exactly the energy beyond rank r (Eckart-Young), and it is not zero
    lost = torch.linalg.norm(full - res.B @ res.A)
    assert torch.isclose(lost, S[r:].pow(2).sum().sqrt(), rtol=1e-10) and lost > 0.1
    assert torch.allclose(res.A @ res.A.T, torch.eye(r, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(res.B.norm(dim=0), S[:r], atol=1e-10)  # Σ in B, as released
    assert res.residual.is_zero


def test_flexlora_lower_rank_client_gets_the_truncation_and_nothing_folded(tiny_bert_dir):
    """A rank-2 client of a rank-4 global adapter: its payload is the best rank-2 part of
    the global update in its own scale, with no residual (FedEx would fold the tail), in
    the released factors: A = V_rᵀ (orthonormal rows), B = U_r Σ_r / s_i."""
    model, glob, low = _two_rank_model(tiny_bert_dir)
    for method, folds in (("flexlora", False), ("fedex", True)):
        server = Server(get_state(model, adapter="default"), glob, num_clients=2, method=method,
                        client_layers={1: low})  # fmt: skip
        pay = server.payload_for(1)
        assert bool(pay.residuals) is folds
        if folds:
            continue
        for name, (A, B) in pay.state.factors.items():
            gA, gB = server.state.factors[name]
            full = glob[name].scale * gB.double() @ gA.double()
            U, S, Vh = torch.linalg.svd(full)
            best = U[:, :2] @ torch.diag(S[:2]) @ Vh[:2]
            got = low[name].scale * B.double() @ A.double()
            assert torch.allclose(got, best, atol=1e-6 * float(S[0])), name
            eye = torch.eye(2, dtype=torch.float64)
            assert torch.allclose(A.double() @ A.double().T, eye, atol=1e-5), name
            assert torch.allclose(B.double().norm(dim=0), S[:2] / low[name].scale, rtol=1e-5)


# -- LoRA-FAIR ------------------------------------------------------------------------
def _fair_dense(dB, B_bar, A_bar, ideal, lam=0.01):
    """The paper's objective on dense (d, n) matrices: 1 - cos + λ ||ΔB||²."""
    X = (B_bar + dB) @ A_bar
    cos = torch.nn.functional.cosine_similarity(ideal.flatten(), X.flatten(), dim=0)
    return 1 - cos + lam * dB.pow(2).sum()


def _fair_check(A_bar, B_new, As, Bs, p, rtol):
    """B_new - B̄ is a stationary point of the dense objective (its gradient at most
    ``rtol`` of the gradient at ΔB = 0, FedIT's B), and aligns better than FedIT."""
    ideal = sum(pi * B @ A for pi, A, B in zip(p, As, Bs))
    B_bar = sum(pi * B for pi, B in zip(p, Bs))
    assert torch.allclose(A_bar, sum(pi * A for pi, A in zip(p, As)), atol=1e-6)

    def value_and_grad(dB):
        dB = dB.clone().requires_grad_(True)
        loss = _fair_dense(dB, B_bar, A_bar, ideal)
        return float(loss), torch.autograd.grad(loss, dB)[0]

    f0, g0 = value_and_grad(torch.zeros_like(B_bar))
    f1, g1 = value_and_grad(B_new - B_bar)
    assert f1 < f0 - 1e-4  # the correction helps
    assert float(g1.norm()) <= rtol * float(g0.norm())  # and it is the optimum's
    return float((B_new - B_bar).norm())


def test_lorafair_corrects_B_to_the_optimum_of_its_objective():
    As, Bs, p = _factors(k=4, r=3)
    res = aggregate(As, Bs, p, method="lorafair")
    assert _fair_check(res.A, res.B, As, Bs, p, rtol=1e-6) > 1e-3  # a real correction, not zero
    assert res.residual.is_zero
    # and it is not FedEx: what the refined factors miss of the ideal is lost
    ideal = sum(pi * B @ A for pi, A, B in zip(p, As, Bs))
    assert torch.linalg.norm(ideal - res.B @ res.A) > 1e-2 * torch.linalg.norm(ideal)


# -- RoLoRA ---------------------------------------------------------------------------
def test_rolora_averages_the_trained_factor_and_the_round_is_exact():
    As, Bs, p = _factors(shared_A=True)  # an odd round: B trained against the shared A
    res = aggregate(As, Bs, p, method="rolora")
    assert torch.allclose(res.B, sum(pi * B for pi, B in zip(p, Bs)), atol=1e-12)
    assert torch.allclose(res.A, As[0], atol=1e-12)
    ideal = sum(pi * B @ A for pi, A, B in zip(p, As, Bs))
    assert torch.allclose(res.B @ res.A, ideal, atol=1e-10) and res.residual.is_zero
    As2, _, _ = _factors(seed=1)  # an even round: A trained against the shared B
    Bs2 = [Bs[0].clone() for _ in As2]
    res = aggregate(As2, Bs2, p, method="rolora")
    assert torch.allclose(res.A, sum(pi * A for pi, A in zip(p, As2)), atol=1e-12)
    ideal = sum(pi * B @ A for pi, A, B in zip(p, As2, Bs2))
    assert torch.allclose(res.B @ res.A, ideal, atol=1e-10)
    with pytest.raises(ValueError, match="rolora requires one factor shared"):
        aggregate(*_factors(seed=2)[:2], p, method="rolora")


def test_rolora_server_takes_B_in_odd_rounds_and_A_in_even_ones(tiny_bert_dir):
    from test_scale import _model

    model = _model(tiny_bert_dir)
    server = Server(get_state(model), layer_info(model), num_clients=2, method="rolora")
    g = torch.Generator().manual_seed(0)

    def upload(c, A, B):
        factors = {
            k: (torch.randn(a.shape, generator=g) if A else None,
                torch.randn(b.shape, generator=g) if B else None)
            for k, (a, b) in server.state.factors.items()
        }  # fmt: skip
        return ClientUpload(c, type(server.state)(factors=factors, extra=server.state.extra), 10)

    for rnd, (train_A, train_B) in ((1, (False, True)), (2, (True, False))):
        for c in (0, 1):
            server.payload_for(c)
        before = {k: (A.clone(), B.clone()) for k, (A, B) in server.state.factors.items()}
        wrong = upload(0, train_B, train_A)  # the factor this round does not train
        outcome = server.aggregate([wrong, upload(1, train_A, train_B)])
        assert outcome.accepted == [1] and "keys" in outcome.rejected[0], rnd
        for k, (A, B) in server.state.factors.items():
            assert torch.equal(A, before[k][0]) is (not train_A), (rnd, k)
            assert torch.equal(B, before[k][1]) is (not train_B), (rnd, k)


# -- end to end, both engines ---------------------------------------------------------
def _client_rounds(run_dir, cfg):
    """Per round: the weights and (A, B) per layer of every saved client adapter."""
    out = []
    for rnd in range(1, cfg.rounds + 1):
        clients = sorted((run_dir / "clients" / f"round-{rnd}").iterdir())
        metas = [json.loads((c / "meta.json").read_text()) for c in clients]
        tensors = [load_file(str(c / "adapter_model.safetensors")) for c in clients]
        out.append(([m["weight"] for m in metas], tensors))
    return out


def _hand_model(run_dir, cfg, w0, truncate):
    """The global model's adapted weights rebuilt from W0 and the client adapters alone:
    ``W0 + s Σ p_i B_i A_i`` of the last round (neither method folds into the base),
    truncated to rank r by a dense SVD for FlexLoRA."""
    scale = cfg.lora_alpha / cfg.lora_r
    weights, tensors = _client_rounds(run_dir, cfg)[-1]
    out = {}
    for n in w0:
        upd = sum(
            p * t[f"{n}.lora_B.weight"].double() @ t[f"{n}.lora_A.weight"].double()
            for p, t in zip(weights, tensors)
        )
        if truncate:
            U, S, Vh = torch.linalg.svd(upd)
            upd = U[:, : cfg.lora_r] @ torch.diag(S[: cfg.lora_r]) @ Vh[: cfg.lora_r]
        out[n] = w0[n] + scale * upd
    return out


def _frlora_model(run_dir, cfg):
    """FRLoRA's global model rebuilt by hand from the pristine weight W (a model loaded with
    peft's default init) and each round's ``s (B̄ Ā - B0 A0)`` from the saved client
    adapters. The frlora model's start, ``W0 - s B0 A0`` plus ``s B0 A0``, is checked
    against W (fp32 rounding of W's split, relative to W), and ``s B0 A0`` against the
    rank-r truncation of our own SVD of W. Returns (W, want, s B0 A0)."""
    from fedexlora.run.build import new_model
    from fedexlora.run.restore import load_task_for
    from test_precision import _w0

    s, r = cfg.lora_alpha / cfg.lora_r, cfg.lora_r
    task = load_task_for(cfg)
    pristine = lora_layers(new_model(cfg, task, "fedex")[0])
    start_model = lora_layers(new_model(cfg, task, "frlora")[0])
    rounds = _client_rounds(run_dir, cfg)
    w, want, starts = {}, {}, {}
    for n, layer in pristine.items():
        W = _w0(layer)
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        A0, B0 = start_model[n].lora_A["default"].weight, start_model[n].lora_B["default"].weight
        start = s * B0.double() @ A0.double()  # s B0 A0 as peft's PiSSA init made it
        best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        assert torch.allclose(start, best, atol=1e-5 * float(S[0])), n
        W_start = effective_weight(start_model[n]).double()
        assert torch.linalg.norm(W_start - W) <= 1e-6 * torch.linalg.norm(W), n
        total = W_start.clone()
        for weights, tensors in rounds:
            A_bar = sum(p * t[f"{n}.lora_A.weight"].double() for p, t in zip(weights, tensors))
            B_bar = sum(p * t[f"{n}.lora_B.weight"].double() for p, t in zip(weights, tensors))
            total += s * B_bar @ A_bar - start
        w[n], want[n], starts[n] = W_start, total, start
    return w, want, starts


@pytest.mark.parametrize("method", ["fedsvd", "flexlora", "lorafair", "rolora", "frlora"])
def test_paper_method_end_to_end_on_both_engines(tiny_cfg, tmp_path, task_identity, method):
    from test_flower import _final_model
    from test_flower_parity import _close, _flower
    from test_precision import _rel, _w0

    cfg = tiny_cfg.replace(methods=[method], rounds=2, lr=2e-2, save_client_adapters=True)
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    model, _ = _final_model(cfg, tmp_path / "local", method)
    layers = lora_layers(model)
    w0 = {n: _w0(layer) for n, layer in layers.items()}
    got = {n: effective_weight(layer).double() for n, layer in layers.items()}
    if method == "lorafair":  # the model is W0 + s (B̄ + ΔB) Ā, ΔB the optimum
        weights, tensors = _client_rounds(tmp_path / "local", cfg)[-1]
        p = torch.tensor(weights, dtype=torch.float64)
        state = _final_model(cfg, tmp_path / "local", method)[1].state
        want = {}
        for n, w in w0.items():
            As = [t[f"{n}.lora_A.weight"].double() for t in tensors]
            Bs = [t[f"{n}.lora_B.weight"].double() for t in tensors]
            A_g, B_g = (x.double() for x in state.factors[n])
            _fair_check(A_g, B_g, As, Bs, p, rtol=1e-2)  # B_g is rounded to fp32
            want[n] = w + cfg.lora_alpha / cfg.lora_r * B_g @ A_g
    elif method == "frlora":  # the base holds W0 - s B0 A0 (peft's PiSSA init)
        w0, want, start = _frlora_model(tmp_path / "local", cfg)
        for n, (A, B) in _final_model(cfg, tmp_path / "local", method)[1].state.factors.items():
            # the adapter is back at (A0, B0) after every round
            got_start = cfg.lora_alpha / cfg.lora_r * B.double() @ A.double()
            assert torch.allclose(got_start, start[n], atol=1e-6), n
    else:
        want = _hand_model(tmp_path / "local", cfg, w0, truncate=method == "flexlora")
    assert _rel(got, want, w0) <= 1e-5
    dev = [r["effective_deviation"]["max"] for r in local]
    if method in ("fedsvd", "rolora"):  # exact: the model is the clients' average
        assert max(dev) <= 1e-5
    else:  # lossy: the truncation's loss, measured on the model and reported
        assert min(dev) > 1e-3
    for r in local:
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["server_seconds"] > 0
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    other, _ = _final_model(cfg, tmp_path / "flower", method)
    for n, layer in lora_layers(other).items():
        assert torch.allclose(effective_weight(layer).double(), got[n], rtol=0, atol=1e-6), n


def test_rolora_refuses_dp_sgd_with_a_clear_error(tiny_cfg):
    with pytest.raises(ValueError, match="method 'rolora' \\(its trained factor changes by round"):
        tiny_cfg.replace(methods=["rolora"], dp_epsilon=8.0).validate()


# -- FRLoRA ---------------------------------------------------------------------------
def test_frlora_folds_the_product_of_the_averages_and_restarts():
    As, Bs, p = _factors(k=4)
    g = torch.Generator().manual_seed(5)
    A0 = torch.randn(3, 12, generator=g, dtype=torch.float64)
    B0 = torch.randn(10, 3, generator=g, dtype=torch.float64)
    res = aggregate(As, Bs, p, method="frlora", start=(A0, B0))
    A_bar = sum(pi * A for pi, A in zip(p, As))
    B_bar = sum(pi * B for pi, B in zip(p, Bs))
    assert torch.equal(res.A, A0) and torch.equal(res.B, B0)  # the adapter restarts
    assert torch.allclose(res.residual.to_dense(), B_bar @ A_bar - B0 @ A0, atol=1e-10)
    assert res.residual.rank <= 2 * 3
    with pytest.raises(ValueError, match="method 'frlora' needs `start`"):
        aggregate(As, Bs, p, method="frlora")


def test_frlora_refuses_a_quantized_base_with_a_clear_error(tiny_cfg):
    with pytest.raises(ValueError, match="method 'frlora' starts its adapter from the SVD"):
        tiny_cfg.replace(methods=["frlora"], quantization="nf4").validate()
