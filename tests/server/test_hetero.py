"""Heterogeneous client ranks: every client holds the global model exactly, every round."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from fedexlora.bridge.adapters import get_state, layer_info, set_state
from fedexlora.bridge.fold import fold_residuals
from fedexlora.bridge.layers import lora_layers
from fedexlora.server import ClientUpload, Payload, Server


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    ).eval()


def _bert():
    torch.manual_seed(0)
    return BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=40,
        )
    ).eval()


CASES = {
    "gpt2-conv1d": (_gpt2, dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)),
    "bert-rslora": (
        _bert,
        dict(target_modules=["query", "value", "intermediate.dense"], use_rslora=True),
    ),
}


def _effective(model):
    out = {}
    for name, layer in lora_layers(model).items():
        w = layer.get_base_layer().weight.detach().double()
        w = w.T if layer.fan_in_fan_out else w
        d = layer.get_delta_weight(layer.active_adapters[0]).double()
        out[name] = w + (d.T if layer.fan_in_fan_out else d)
    return out


def _rel(a, b):
    return max((torch.linalg.norm(a[k] - b[k]) / torch.linalg.norm(b[k])).item() for k in a)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", ["fedex", "flora"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_ranks_2_4_8_exact_every_round(case, method, dtype, tol):
    """fp64 shows the algebra is exact; fp32 shows rounding stays small (the SVD split and
    the change of the remainder each round add a few roundings on top of plain FedEx)."""
    make, kw = CASES[case]
    base = make().to(dtype)
    ranks = [2, 4, 8]
    glob = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, **kw)).eval()
    clients = [
        get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=16, **kw)).eval()
        for r in ranks
    ]
    server = Server(
        get_state(glob),
        layer_info(glob),
        method=method,
        num_clients=3,
        client_layers={i: layer_info(m) for i, m in enumerate(clients)},
    )
    gen = torch.Generator().manual_seed(0)
    weights = [30, 10, 20]
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    for rnd in range(1, 4):
        uploads, trained = [], []
        for c in server.sample(rnd):
            payload = Payload.from_flat(server.payload_for(c).to_flat(), round=rnd, version=0)
            fold_residuals(clients[c], payload.residuals)
            set_state(clients[c], payload.state)
            assert _rel(_effective(clients[c]), _effective(glob)) < tol, (rnd, c)
            st = get_state(clients[c])
            for name, (A, B) in st.factors.items():
                st.factors[name] = (
                    A + 0.1 * torch.randn(A.shape, generator=gen),
                    B + 0.1 * torch.randn(B.shape, generator=gen),
                )
            set_state(clients[c], st)
            trained.append(_effective(clients[c]))
            uploads.append(ClientUpload(c, st, weights[c]))
        out = server.aggregate(uploads)
        fold_residuals(glob, out.residuals)
        set_state(glob, server.state)
        # the global model is exactly the weighted average of the clients' trained models,
        # each with its own rank and scale
        ideal = {k: sum(pi * t[k] for pi, t in zip(p, trained)) for k in trained[0]}
        assert _rel(_effective(glob), ideal) < tol, rnd
        assert max(out.effective_deviation.values()) < 1e-5


def test_low_rank_client_gets_the_most_energy():
    from fedexlora.core.aggregation import split_leading

    g = torch.Generator().manual_seed(0)
    A, B = (
        torch.randn(8, 30, generator=g, dtype=torch.float64),
        torch.randn(20, 8, generator=g, dtype=torch.float64),
    )
    A2, B2, tail = split_leading(A, B, 2)
    full = B @ A
    s = torch.linalg.svdvals(full)
    assert torch.allclose(B2 @ A2 + tail.to_dense(), full, atol=1e-10)
    assert torch.linalg.norm(tail.to_dense()) == pytest.approx(s[2:].norm().item(), rel=1e-9)


def test_hetero_refuses_methods_that_cannot_be_exact():
    glob = get_peft_model(_gpt2(), LoraConfig(r=4, target_modules=["c_attn"]))
    small = get_peft_model(_gpt2(), LoraConfig(r=2, target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="heterogeneous client ranks need method"):
        Server(
            get_state(glob),
            layer_info(glob),
            method="ffa",
            num_clients=2,
            client_layers={1: layer_info(small)},
        )


def test_engine_with_client_ranks_is_exact_and_resumes(tiny_cfg, tmp_path):
    from fedexlora.run.checkpoint import latest_checkpoint
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, lora_r=8, client_ranks=[2, 4, 8])
    rows = run_experiment(cfg, tmp_path / "a", progress=False)
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in rows)
    assert all(r["accepted"] == [0, 1, 2] for r in rows)
    # the low-rank clients upload fewer bytes than a rank-8 client would
    full = run_experiment(cfg.replace(client_ranks=None), tmp_path / "b", progress=False)
    assert rows[0]["bytes_up"] < full[0]["bytes_up"]
    # resume from round 1 reproduces round 2 exactly (remainders are checkpointed)
    import shutil

    shutil.rmtree(latest_checkpoint(tmp_path / "a" / "checkpoints" / "fedex"))
    again = run_experiment(cfg, tmp_path / "a", resume=True, progress=False)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rs]  # noqa: E731
    assert strip(again) == strip(rows)


def test_client_ranks_config_errors():
    from fedexlora.config import RunConfig

    errs = RunConfig(num_clients=3, client_ranks=[2, 4], lora_r=4).errors()
    assert any("one rank per client (3), got 2" in e for e in errs)
    errs = RunConfig(num_clients=2, client_ranks=[2, 4], lora_r=8).errors()
    assert any("must equal max(client_ranks) = 4, got 8" in e for e in errs)
    errs = RunConfig(num_clients=2, client_ranks=[2, 4], lora_r=4, methods=["ffa"]).errors()
    assert any("cannot be combined with methods ['ffa']" in e for e in errs)
    # it calls exact only the methods `fedexlora methods` calls exact, from the registry
    from fedexlora.core.methods import REGISTRY

    (msg,) = [e for e in errs if "cannot be combined" in e]
    said_exact = msg.split(" (exact)")[0].removeprefix("`client_ranks` works with ").split(" and ")
    assert said_exact and all(REGISTRY[m].exact and REGISTRY[m].hetero_ranks for m in said_exact)
    takes = {m for m, s in REGISTRY.items() if s.hetero_ranks}
    assert all(f"{m}" in msg for m in takes) and "(not exact;" in msg
    for m in sorted(takes):  # each accepted on either engine
        for engine in ("local", "flower"):
            cfg = RunConfig(num_clients=2, client_ranks=[2, 4], lora_r=4, methods=[m])
            assert not [e for e in cfg.replace(engine=engine).errors() if "client_ranks" in e]
