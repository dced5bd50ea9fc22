"""The server's base delta held by the global model (``Server.delta_source``), #31.

Once a layer's record of everything folded since W0 would turn dense, a server whose
``delta_source`` reads the engine's model drops its own copy: no dense rebuild in that
round, no dense add in every later one. What it sends and saves must not change: reset
payloads and checkpoints are checked against the ideal tracked by hand (``test_scale``'s
fp64 bookkeeping) and against a server that kept its own record.
"""

import functools
import warnings

import pytest
import torch

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info
from fedexlora.bridge.fold import effective_weight, folded_delta
from fedexlora.bridge.layers import lora_layers
from fedexlora.core.aggregation import deviation
from test_scale import _hand_ideal, _model, _rel_gap, _uploads

ROUNDS = 6  # tiny BERT, r=4, 3 clients: the record turns dense in round 2 or 3


def _federate(glob, server, rounds=ROUNDS, seed=0):
    """Rounds of 3 random clients folded into ``glob``; returns the hand ideal."""
    layers = server.layers
    base = {n: effective_weight(layer, lora=False) for n, layer in lora_layers(glob).items()}
    gen = torch.Generator().manual_seed(seed)
    ideal = None
    for _ in range(rounds):
        for c in (0, 1, 2):
            server.payload_for(c)
        ups = _uploads(server, [0, 1, 2], gen)
        ideal, base = _hand_ideal(base, ups, layers)
        outcome = server.aggregate(ups, effective=False)
        apply_outcome(glob, server, outcome, ups)
    return ideal


def _reset_client(tiny_bert_dir, server, client=5):
    fresh = _model(tiny_bert_dir)
    p = server.payload_for(client)
    assert p.reset
    apply_payload(fresh, p)
    return fresh, p


def test_a_new_client_is_rebuilt_from_the_model_held_delta(tiny_bert_dir):
    glob = _model(tiny_bert_dir)
    server = Server(get_state(glob), layer_info(glob), num_clients=6)
    server.delta_source = functools.partial(folded_delta, glob)
    ideal = _federate(glob, server)
    assert server.outgrown == set(server.layers)  # every layer's record went dense
    assert _rel_gap(glob, ideal) <= 1e-6
    fresh, _ = _reset_client(tiny_bert_dir, server)
    assert _rel_gap(fresh, ideal) <= 1e-6  # a client from W0 holds the hand ideal
    # that read checked the model against the rounds since the copy was dropped: from
    # then on the delta lives in the model only
    assert server.outgrown == set(server.layers) and server.nbytes()["base_delta"] == 0


def test_checkpoint_of_a_model_held_server_restores_without_the_model(tiny_bert_dir):
    """The state_dict format does not change: the model's delta is written into it, and a
    server restored without any model sends the very same reset payload."""
    glob = _model(tiny_bert_dir)
    server = Server(get_state(glob), layer_info(glob), num_clients=6)
    server.delta_source = functools.partial(folded_delta, glob)
    ideal = _federate(glob, server)
    assert server.outgrown
    back = Server(get_state(_model(tiny_bert_dir)), layer_info(glob), num_clients=6)
    back.load_state_dict(server.state_dict())
    assert not back.outgrown and back.base_delta  # dense, its own
    a, b = server.payload_for(4), back.payload_for(4)  # a client never sent
    assert a.reset and b.reset and set(a.residuals) == set(b.residuals) == set(server.layers)
    for name in a.residuals:
        assert torch.equal(a.residuals[name].to_dense(), b.residuals[name].to_dense())
    fresh, _ = _reset_client(tiny_bert_dir, back)
    assert _rel_gap(fresh, ideal) <= 1e-6


def test_a_source_that_does_not_hold_the_record_is_not_trusted(tiny_bert_dir):
    """A model that did not fold the rounds (here: a fresh one) is caught at the first
    read after the record turned dense: the server warns, keeps its own record (the
    factors of every round since), and stays exact."""
    glob, other = _model(tiny_bert_dir), _model(tiny_bert_dir)
    server = Server(get_state(glob), layer_info(glob), num_clients=6)
    server.delta_source = functools.partial(folded_delta, other)
    with pytest.warns(UserWarning, match="is not the server's record"):
        ideal = _federate(glob, server)
        server.deltas()  # a read checks the model, at the latest
    assert not server.outgrown
    assert all(server.base_delta[name].dense is not None for name in server.layers)
    fresh, _ = _reset_client(tiny_bert_dir, server)
    assert _rel_gap(fresh, ideal) <= 1e-6


def test_effective_off_changes_nothing_but_the_effective_deviation(tiny_bert_dir):
    glob = _model(tiny_bert_dir)
    servers = [Server(get_state(glob), layer_info(glob), num_clients=3) for _ in range(2)]
    gen = torch.Generator().manual_seed(4)
    ups = _uploads(servers[0], [0, 1, 2], gen)
    on, off = servers[0].aggregate(ups), servers[1].aggregate(ups, effective=False)
    assert off.effective_deviation == {} and set(on.effective_deviation) == set(on.deviation)
    assert on.deviation == off.deviation
    for name in on.residuals:
        assert torch.equal(on.residuals[name].to_dense(), off.residuals[name].to_dense())
    for (a, b), (c, d) in zip(servers[0].state.factors.values(), servers[1].state.factors.values()):
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize(
    "spread, dtype, rel",
    [(1e-1, torch.float32, 1e-6), (1e-4, torch.float32, 1e-6), (1e-4, torch.float64, 1e-10)],
)
def test_deviation_of_weighted_nearly_identical_clients_matches_dense_fp64(spread, dtype, rel):
    """FedIT's deviation from one pair of Gram matrices, against the dense fp64 formula,
    with unequal weights, a non-square layer and clients 1e-4 apart (the Gram matrices are
    of the centred factors: those of the raw factors would cancel their common part).
    fp32 factors: the Gram products run in fp32 (1e-6); fp64 ones in fp64."""
    g = torch.Generator().manual_seed(0)
    d, n, r, k = 48, 80, 3, 4
    A0, B0 = torch.randn(r, n, generator=g), torch.randn(d, r, generator=g)
    As = [(A0 + spread * torch.randn(r, n, generator=g)).to(dtype) for _ in range(k)]
    Bs = [(B0 + spread * torch.randn(d, r, generator=g)).to(dtype) for _ in range(k)]
    w = torch.tensor([5.0, 1.0, 2.0, 3.0])
    p = w.double() / w.double().sum()
    ideal = sum(p[i] * Bs[i].double() @ As[i].double() for i in range(k))
    A_bar = sum(p[i] * As[i].double() for i in range(k))
    B_bar = sum(p[i] * Bs[i].double() for i in range(k))
    # the difference in its centred form (dense fp64 of B̄Ā - ideal itself would cancel
    # all but 1e-8 of two nearly equal matrices: off by 6x at spread 1e-4)
    diff = sum(p[i] * (Bs[i].double() - B_bar) @ (As[i].double() - A_bar) for i in range(k))
    assert torch.allclose(diff, ideal - B_bar @ A_bar, atol=1e-12 * float(ideal.abs().max()))
    want = float(torch.linalg.norm(diff) / torch.linalg.norm(ideal))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = deviation(As, Bs, w)
    assert got == pytest.approx(want, rel=rel)


def test_the_model_held_delta_is_read_in_the_active_adapters_units(tiny_bert_dir):
    """A model with a second adapter, active and of another scale: ``folded_delta`` reads
    the adapter that is federated, not ``default``. It read ``default``'s scale, 4x off
    here, so the server distrusted its own model and kept a dense copy, with a warning."""
    from peft import LoraConfig

    glob = _model(tiny_bert_dir)
    targets = sorted(glob.peft_config["default"].target_modules)
    glob.add_adapter("other", LoraConfig(r=4, lora_alpha=32, target_modules=targets))
    glob.set_adapter("other")
    server = Server(get_state(glob), layer_info(glob), num_clients=6)
    server.delta_source = functools.partial(folded_delta, glob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "is not the server's record" would raise
        _federate(glob, server)
        server.deltas()
    assert server.outgrown == set(server.layers)  # the model's record was trusted
    for name in server.layers:
        mine = folded_delta(glob, name).to_dense()
        assert torch.equal(mine, folded_delta(glob, name, adapter="other").to_dense())
