"""Many clients: bounded server state, and exact catch-up after any absence.

The ideal global model is tracked by hand in fp64, from the uploads alone:
``ideal_t = base_{t-1} + sum_i p_i s B_i A_i`` and ``base_t = ideal_t - s B_bar A_bar``.
"""

import functools

import pytest
import torch

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info
from fedexlora.bridge.fold import effective_weight, folded_delta
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.models import load_model
from fedexlora.core.state import AdapterState
from fedexlora.server import ClientUpload

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=6)


def _model(path):
    model, _ = load_model(path, causal=False, num_labels=3, r=4, alpha=8, dropout=0.0, seed=0)
    return model.eval()


def _uploads(server: Server, clients, gen: torch.Generator) -> list[ClientUpload]:
    """Random client updates around the global state, with random example counts."""
    out = []
    for c in clients:
        factors = {
            k: (
                A + 0.05 * torch.randn(A.shape, generator=gen),
                B + 0.05 * torch.randn(B.shape, generator=gen),
            )
            for k, (A, B) in server.state.factors.items()
        }
        extra = {
            k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in server.state.extra.items()
        }
        n = int(torch.randint(5, 50, (1,), generator=gen))
        out.append(ClientUpload(c, AdapterState(factors, extra), n))
    return out


def _hand_ideal(base: dict, uploads, layers) -> tuple[dict, dict]:
    """(ideal effective weights, next ideal base) by hand, fp64."""
    total = sum(u.num_examples for u in uploads)
    eff, nxt = {}, {}
    for name, info in layers.items():
        s = info.scale
        avg_prod = sum(
            (u.num_examples / total)
            * s
            * (u.state.factors[name][1].double() @ u.state.factors[name][0].double())
            for u in uploads
        )
        A_bar = sum((u.num_examples / total) * u.state.factors[name][0].double() for u in uploads)
        B_bar = sum((u.num_examples / total) * u.state.factors[name][1].double() for u in uploads)
        eff[name] = base[name] + avg_prod
        nxt[name] = eff[name] - s * (B_bar @ A_bar)
    return eff, nxt


def _rel_gap(model, ideal: dict) -> float:
    num = den = 0.0
    for name, layer in lora_layers(model).items():
        w = effective_weight(layer)
        num += float((w - ideal[name]).pow(2).sum())
        den += float(ideal[name].pow(2).sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("from_model", [False, True], ids=["own-record", "model-held"])
def test_client_absent_for_50_rounds_is_exact_and_server_state_stays_bounded(
    tiny_bert_dir, from_model
):
    """``model-held``: the server reads its dense base deltas from the global model
    (``delta_source``, as both engines set it) instead of keeping them: the client away
    for 50 rounds is rebuilt from what the model holds, still against the hand ideal."""
    torch.manual_seed(0)
    glob, away, regular = _model(tiny_bert_dir), _model(tiny_bert_dir), _model(tiny_bert_dir)
    layers = layer_info(glob)
    server = Server(get_state(glob), layers, num_clients=6)
    if from_model:
        server.delta_source = functools.partial(folded_delta, glob)
    base = {n: effective_weight(layer, lora=False) for n, layer in lora_layers(glob).items()}
    gen = torch.Generator().manual_seed(1)
    dense = {n: info.shape[0] * info.shape[1] * 4 for n, info in layers.items()}
    resets, catch_ups = [], []
    ideal_eff = {n: effective_weight(x) for n, x in lora_layers(glob).items()}  # round 0

    def client_round(model, c):
        p = server.payload_for(c)
        apply_payload(model, p)
        (resets if p.reset else catch_ups).append((c, p.round))
        return p

    for rnd in range(1, 56):
        clients = [2, 3]
        if rnd in (1, 52):  # client 0: round 1, then away for 50 rounds
            client_round(away, 0)
            assert _rel_gap(away, ideal_eff) <= 1e-6
            clients.append(0)
        if rnd >= 30 or rnd % 7 == 0:  # client 1: now and then, then every round
            client_round(regular, 1)
            assert _rel_gap(regular, ideal_eff) <= 1e-6
            clients.append(1)
        for c in (2, 3):
            server.payload_for(c)
        ups = _uploads(server, clients, gen)
        ideal_eff, base = _hand_ideal(base, ups, layers)
        outcome = server.aggregate(ups)
        apply_outcome(glob, server, outcome, ups)
        assert _rel_gap(glob, ideal_eff) <= 1e-6
        # bounded: per layer, the base delta and the older history fit in one dense
        # update, plus the latest round's residual
        newest = max(server.history)
        for name in layers:
            older = sum(
                r[name].nbytes for v, r in server.history.items() if v != newest and name in r
            )
            assert server.record.nbytes(name) + older <= dense[name]
            if from_model:  # what turned dense lives in the model only
                assert (name in server.outgrown) == (name not in server.base_delta)
                assert name not in server.base_delta or server.base_delta[name].dense is None
    assert (0, 52) in resets  # away for 50 rounds: rebuilt from the base delta
    assert (1, 31) in catch_ups  # back after one round: caught up from the history
    assert (1, 14) in resets  # back after 7 rounds: the history no longer reaches
    assert server.history_floor > 2
    # the server's memory does not depend on how many rounds a client missed
    parts = server.nbytes()
    if from_model:  # once read (and so checked), the deltas live in the model only
        server.deltas()
        assert server.outgrown == set(layers) and server.nbytes()["base_delta"] == 0
    assert parts["history"] + parts["base_delta"] <= sum(dense.values()) + sum(
        r.nbytes for r in server.history[max(server.history)].values()
    )


def test_reset_payload_round_trips_and_drops_what_was_folded(tiny_bert_dir):
    from fedexlora.server import Payload

    model = _model(tiny_bert_dir)
    server = Server(get_state(model), layer_info(model), num_clients=2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        server.payload_for(0)
        server.payload_for(1)
        server.aggregate(_uploads(server, [0, 1], gen))
    assert server.base_delta
    server.forget_client(0)
    p = server.payload_for(0)
    assert p.reset
    back = Payload.from_bytes(p.to_bytes())
    assert back.reset and back.version == p.version
    # a model that already folded something is brought back to W0 before the delta
    fresh = _model(tiny_bert_dir)
    apply_payload(model, back)
    apply_payload(fresh, back)
    for (n, a), (_, b) in zip(lora_layers(model).items(), lora_layers(fresh).items()):
        assert torch.equal(effective_weight(a), effective_weight(b)), n
    apply_payload(model, back)  # applying the same reset payload twice changes nothing
    for (n, a), (_, b) in zip(lora_layers(model).items(), lora_layers(fresh).items()):
        assert torch.equal(effective_weight(a), effective_weight(b)), n


@pytest.mark.parametrize("method", ["fedex", "ffa"])
def test_old_style_payload_without_reset_flag_still_loads(tiny_bert_dir, method):
    from fedexlora.core.messages import Payload, _to_bytes

    model = _model(tiny_bert_dir)
    server = Server(get_state(model), layer_info(model), num_clients=1, method=method)
    p = server.payload_for(0)
    data = _to_bytes(p.to_flat(), {"round": p.round, "version": p.version})
    assert not Payload.from_bytes(data).reset


def _scale_cfg(tiny_bert_dir, clients=200, rounds=20):
    from fedexlora.config import RunConfig

    return RunConfig(
        model=tiny_bert_dir,
        task=f"synthetic:{clients * 10}",
        methods=["fedex"],
        num_clients=clients,
        partition="iid",
        min_partition_size=4,
        rounds=rounds,
        local_steps=1,
        batch_size=4,
        max_length=16,
        lr=5e-3,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        fraction=0.01,
        max_test=40,
    )


def _watch_payloads(monkeypatch, server, on_payload):
    """A client step for the in-process engine that calls ``on_payload(client, payload,
    model)`` for each client it trains, as it starts: ``model`` then holds the global
    model the payload must bring the client to."""
    from fedexlora.run.client_step import local_update as real_update

    sent = {}
    real_payload_for = server.payload_for

    def payload_for(client):
        sent[client] = real_payload_for(client)
        return sent[client]

    def local_update(cfg, method, model, data, rnd, client, **kwargs):
        on_payload(client, sent.pop(client), model)
        return real_update(cfg, method, model, data, rnd, client, **kwargs)

    monkeypatch.setattr(server, "payload_for", payload_for)
    return local_update


def test_200_clients_in_process_each_sampled_client_is_exact_after_its_payload(
    tiny_bert_dir, monkeypatch
):
    """Every sampled client's model, rebuilt from what it held plus its payload, is the
    global model; the server's memory stays within its bound every round."""
    from fedexlora.bridge.fold import load_side_state, side_state
    from fedexlora.run.build import new_model, new_server, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    cfg = _scale_cfg(tiny_bert_dir)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    server = new_server(cfg, "fedex", model)
    probe = new_model(cfg, task, "fedex")[0]
    snapshots = {0: {}}  # version -> what the global model had folded (clients hold these)
    held, gaps, kinds = {}, [], []

    def on_payload(c, payload, glob):
        load_side_state(probe, snapshots[held.get(c, 0)])
        apply_payload(probe, payload)
        gaps.append(_rel_gap(probe, {n: effective_weight(x) for n, x in lora_layers(glob).items()}))
        kinds.append(payload.reset)
        held[c] = payload.version

    def after_round(row, server, mdl):
        snapshots.setdefault(server.version, {k: v.clone() for k, v in side_state(mdl).items()})
        newest = server.history[max(server.history)] if server.history else {}
        bound = sum(4 * i.shape[0] * i.shape[1] for i in server.layers.values())
        parts = server.nbytes()
        assert parts["history"] + parts["base_delta"] <= bound + sum(
            r.nbytes for r in newest.values()
        )

    watched = _watch_payloads(monkeypatch, server, on_payload)
    rows, _, _ = run_method(
        cfg, "fedex", prep, progress=False, model=model, server=server, after_round=after_round,
        local_update=watched,
    )  # fmt: skip
    assert len(rows) == 20 and all(len(r["sampled"]) == 2 for r in rows)
    assert len(gaps) == 40 and max(gaps) <= 1e-6
    assert server.version >= 15  # the global model moved: the check compared real updates
    assert len(held) > 30  # many different clients came and went


def test_200_virtual_clients_under_flower_match_the_in_process_engine(
    tiny_bert_dir, tmp_path, monkeypatch, task_identity
):
    """200 Flower nodes, 2 sampled per round: fedex-lora's ServerApp loop, strategy and
    ClientApp over the in-process grid of ``test_flower.py`` (one Context per node, every
    message through Flower's protobuf). Flower's simulation runtime itself (Ray, a
    SuperLink, a SIGKILL) is ``test_flower_simulation.py``'s."""
    from fedexlora.run.build import new_model, new_server, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    cfg = _scale_cfg(tiny_bert_dir, rounds=4)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    server = new_server(cfg, "fedex", model)
    last_keep = {}  # client -> what its latest payload said
    with pytest.MonkeyPatch.context() as watch:  # the Flower run trains its clients unwatched
        watched = _watch_payloads(watch, server, lambda c, p, m: last_keep.__setitem__(c, p.keep))
        local, _, _ = run_method(
            cfg, "fedex", prepare(cfg, tok, task), progress=False, model=model, server=server,
            local_update=watched,
        )  # fmt: skip
    from test_flower_parity import _flower

    flower, _ = _flower(  # client state on disk, where run_flower_experiment puts it
        cfg.replace(engine="flower"),
        tmp_path / "flower",
        client_state_dir=str(tmp_path / "flower" / "client-state"),
    )
    assert [r["round"] for r in flower] == [1, 2, 3, 4]
    for a, b in zip(flower, local):
        keys = ("sampled", "accepted", "num_examples", "bytes_up", "bytes_down", "bytes_down_max")
        for key in keys + ("server_bytes",):
            assert a[key] == b[key], (a["round"], key)
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-5, abs=1e-6)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    # the same global model: the final checkpoint's factors and head against in-process
    # (a reused spare model that kept what it folded would train from another base;
    # measured: at most 1.9e-7 apart, and 1.0e-5 with that fault)
    from safetensors.torch import load_file

    from fedexlora.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(tmp_path / "flower" / "checkpoints" / "fedex")
    theirs = load_file(str(ckpt / "tensors.safetensors"))
    for key, t in server.state.to_flat().items():
        other = theirs[f"state.{key}"]
        assert torch.linalg.norm(other - t) <= 1e-6 * torch.linalg.norm(t), key
    # clients told not to keep their model (all but those sampled before any history
    # existed) left nothing on disk
    told_to_keep = {c for c, keep in last_keep.items() if keep}
    assert 0 < len(told_to_keep) < len(last_keep)
    kept = list((tmp_path / "flower" / "client-state").rglob("*.safetensors"))
    assert {p.parent.name for p in kept} == {f"partition-{c}" for c in told_to_keep}


def test_clients_sampled_rarely_are_told_not_to_keep_their_model(tiny_bert_dir):
    model = _model(tiny_bert_dir)
    gen = torch.Generator().manual_seed(5)
    # every client every round: every payload is worth keeping
    full = Server(get_state(model), layer_info(model), num_clients=3)
    for _ in range(6):
        assert all(full.payload_for(c).keep for c in range(3))
        full.aggregate(_uploads(full, range(3), gen))
    # 1 client in 100 per round: the history cannot reach back ~100 rounds
    rare = Server(get_state(model), layer_info(model), num_clients=100, fraction=0.02)
    kept = []
    for rnd in range(1, 8):
        ps = {c: rare.payload_for(c) for c in rare.sample(rnd)}
        kept += [p.keep for p in ps.values()]
        for c, p in ps.items():
            assert (c in rare.client_version) == p.keep
        rare.aggregate(_uploads(rare, ps, gen))
    assert kept[:2] == [True, True] and not any(kept[2:])  # no history yet in round 1
    # a client told not to keep gets a reset payload next time
    c = next(iter(ps))
    assert rare.payload_for(c).reset


@pytest.mark.parametrize(
    ("clients", "fraction", "expected"), [(10, 0.25, 3), (5, 0.5, 3), (6, 0.25, 2), (3, 0.1, 1)]
)
def test_sample_size_rounds_half_up(tiny_bert_dir, clients, fraction, expected):
    model = _model(tiny_bert_dir)
    server = Server(get_state(model), layer_info(model), num_clients=clients, fraction=fraction)
    assert server.sample_size() == expected
    assert all(len(server.sample(r)) == expected for r in (1, 2, 3))
