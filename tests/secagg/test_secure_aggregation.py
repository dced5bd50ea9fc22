"""Secure aggregation (SecAgg+): the server sees only sums, and FedEx stays exact.

Exactness is measured on the model, against the ideal rebuilt by hand from the clients'
own saved adapters (``benchmarks/verify_export.py``), never from the server's report.
"""

import numpy as np
import pytest
import torch

from fedexlora.core.messages import ClientUpload
from fedexlora.core.methods import REGISTRY, get_method
from fedexlora.core.secure import SecureLayout, client_vector, read_sums, secure_refusal
from fedexlora.core.sketch import SketchPlan
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.secagg.encoding import Quantization
from fedexlora.secagg.protocol import ClientSession, SecAggError, ServerSession, run_round
from fedexlora.server.server import Server

SECURE = sorted(n for n, s in REGISTRY.items() if secure_refusal(s) is None)


# -- the quantization ---------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3, 5, 1000])
def test_limbs_sum_exactly_within_float_rounding(k):
    rng = np.random.default_rng(k)
    n = 2000
    # values from 1e-9 to 10: FedEx's products sit far below its factors
    xs = [rng.normal(size=n) * 10.0 ** rng.uniform(-9, 1, size=n) for _ in range(min(k, 8))]
    xs += [xs[i % len(xs)] for i in range(k - len(xs))]
    q = Quantization.for_clients(k)
    assert k * q.target_range < 2**32 and q.target_range <= 2**30
    total = sum(q.encode(x, rng)[0] for x in xs) % 2**32
    got = q.decode(total, k)
    want = np.sum(np.array(xs, dtype=np.longdouble), axis=0)  # 64-bit mantissa on x86
    err = np.abs(got - want).astype(np.float64)
    assert np.max(err) <= k * q.resolution + 4 * np.finfo(float).eps * float(np.max(np.abs(want)))
    assert q.resolution < 1e-12  # 52 bits and more over +-256
    # Flower's quantizer alone (one limb at its 30 bits) is far coarser
    one = Quantization(q.clip, q.target_range, 1, k)
    one_total = sum(one.encode(x, rng)[0] for x in xs) % 2**32
    assert np.max(np.abs(one.decode(one_total, k) - want)) > 1e3 * np.max(err)


def test_values_beyond_the_range_are_clipped_and_counted():
    q = Quantization.for_clients(3, clip=4.0)
    ints, clipped = q.encode(np.array([1.0, -5.0, 7.0, 3.9]), np.random.default_rng(0))
    assert clipped == 2
    assert np.allclose(q.decode(ints, 1), [1.0, -4.0, 4.0, 3.9])


# -- the protocol -------------------------------------------------------------------------
def _protocol(k, vectors, drop=(), threshold=0.5):
    server = ServerSession(list(range(k)), vectors[0].size, threshold=threshold, seed=3)
    clients = {c: ClientSession(c) for c in range(k)}
    seen = []

    def exchange(stage, msgs):
        fn = {"setup": "setup", "share-keys": "share_keys", "unmask": "unmask"}[stage]
        replies = {c: getattr(clients[c], fn)(m) for c, m in msgs.items()}
        seen.extend((stage, c, r) for c, r in replies.items())
        return replies

    def collect(msgs):
        out = {c: clients[c].masked(m, vectors[c]) for c, m in msgs.items() if c not in drop}
        seen.extend(("collect", c, r) for c, r in out.items())
        return out

    return run_round(server, exchange, collect), server, seen


def test_secagg_plus_sums_the_survivors_and_hides_each_vector():
    rng = np.random.default_rng(0)
    k, n = 4, 5000
    vectors = [rng.integers(0, 2**20, size=n) for _ in range(k)]
    total, server, seen = _protocol(k, vectors)
    assert np.array_equal(total, np.sum(vectors, axis=0) % 2**32)
    masked = [np.frombuffer(r, dtype=np.uint32).astype(float) for s, _, r in seen if s == "collect"]
    for m in masked:  # each recorded vector is noise to every client's own
        for v in vectors:
            assert abs(np.corrcoef(m, v)[0, 1]) < 5 / np.sqrt(n)
    # a client that drops out after sharing its keys: the survivors' sum, exactly
    total, server, _ = _protocol(k, vectors, drop=(2,))
    assert server.dropped == {2} and server.survivors == {0, 1, 3}
    assert np.array_equal(total, np.sum([vectors[c] for c in (0, 1, 3)], axis=0) % 2**32)
    # a vector of the wrong size: left out, its masks removed as a dropout's
    server = ServerSession(list(range(k)), n, seed=3)
    clients = {c: ClientSession(c) for c in range(k)}
    run = {"setup": "setup", "share-keys": "share_keys", "unmask": "unmask"}

    def exchange(stage, msgs):
        return {c: getattr(clients[c], run[stage])(m) for c, m in msgs.items()}

    def collect(msgs):
        out = {c: clients[c].masked(m, vectors[c]) for c, m in msgs.items()}
        out[3] = out[3][:-4]
        return out

    total = run_round(server, exchange, collect)
    assert server.survivors == {0, 1, 2} and "expected" in server.malformed[3]
    assert np.array_equal(total, np.sum(vectors[:3], axis=0) % 2**32)
    # too few survivors to rebuild the secrets: refused, never a wrong sum
    with pytest.raises(SecAggError, match="masked vectors"):
        _protocol(k, vectors, drop=(0, 1, 2), threshold=1.0)
    with pytest.raises(SecAggError, match="at least 3 clients"):
        ServerSession([0, 1], 10)
    # 13 clients: each shares with 2 ceil(log2 13) + 1 = 9 (itself and 8 neighbours)
    vectors = [rng.integers(0, 2**20, size=64) for _ in range(13)]
    total, server, _ = _protocol(13, vectors, drop=(3, 11))
    assert server.num_shares == 9 and all(len(n) == 9 for n in server.neighbours.values())
    alive = [c for c in range(13) if c not in (3, 11)]
    assert np.array_equal(total, np.sum([vectors[c] for c in alive], axis=0) % 2**32)


# -- the server's math from the sums ------------------------------------------------------
def _random_round(method, k=3, r=3, d=7, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = get_method(method)
    layers = {f"l{i}": LayerInfo(2.0, False, r, (d, n)) for i in range(2)}
    factors = {
        name: (torch.randn(r, n, generator=g), torch.randn(d, r, generator=g) * 0.1)
        for name in layers
    }
    if spec.latent:
        factors = {name: (torch.eye(r), torch.randn(r, r, generator=g)) for name in layers}
        layers = {name: LayerInfo(2.0, False, r, (r, r)) for name in layers}
    state = AdapterState(factors=factors, extra={"head": torch.randn(3, generator=g)})
    server = Server(state, layers, method=method, num_clients=k, seed=1)
    for c in range(k):
        server.payload_for(c)
    template = server.upload_template(1)
    uploads = []
    for c in range(k):
        flat = {
            key: t + 0.05 * torch.randn(t.shape, generator=g)
            for key, t in template.to_flat().items()
        }
        uploads.append(ClientUpload(c, AdapterState.from_flat(flat), 10 + 7 * c, 0.5 + c))
    return server, template, uploads


@pytest.mark.parametrize("method", SECURE)
def test_aggregate_from_the_sums_equals_aggregate_from_the_uploads(method):
    """Each method that runs securely: its round from the sums is its round from the uploads.

    The sums here are plain (no masks, no quantization): this checks the server's math.
    """
    plain, template, uploads = _random_round(method)
    secure, _, _ = _random_round(method)
    want = plain.aggregate(uploads, effective=False)
    spec = get_method(method)
    layout = SecureLayout.for_template(template, products=spec.secure_products)
    # each client weighs in as the server weighs it (examples, unless a method says uniform)
    n = {u.client_id: 1 if plain.weighting == "uniform" else u.num_examples for u in uploads}
    summed = sum(client_vector(layout, u.state, n[u.client_id] / 64, u.train_loss) for u in uploads)
    sums = read_sums(layout, summed, template)
    got = secure.aggregate_secure(sums, [0, 1, 2])
    assert got.accepted == [0, 1, 2]
    for key, t in plain.state.to_flat().items():
        assert torch.allclose(secure.state.to_flat()[key], t, atol=1e-6), key
    for name in plain.layers:  # the same model: factors plus what was folded
        scale = plain.layers[name].scale
        A0, B0 = plain.state.factors[name]
        A1, B1 = secure.state.factors[name]
        fw = scale * (B0.double() @ A0.double())
        fs = scale * (B1.double() @ A1.double())
        if name in want.residuals:
            fw = fw + scale * want.residuals[name].to_dense().double()
        if name in got.residuals:
            fs = fs + scale * got.residuals[name].to_dense().double()
        assert torch.allclose(fw, fs, atol=1e-5), name
    weights = torch.tensor([n[u.client_id] for u in uploads], dtype=torch.float64)
    loss = float((weights * torch.tensor([u.train_loss for u in uploads])).sum() / weights.sum())
    assert got.secure["train_loss"] == pytest.approx(loss)
    if spec.secure_products:  # FedEx: the residual is the ideal minus the averaged product
        p = weights / weights.sum()
        for name in plain.layers:
            ideal = sum(
                pi * u.state.factors[name][1].double() @ u.state.factors[name][0].double()
                for pi, u in zip(p, uploads)
            )
            A, B = secure.state.factors[name]
            avg = B.double() @ A.double()
            dense = got.residuals[name].to_dense().double()  # relative to the residual itself
            assert torch.linalg.norm(avg + dense - ideal) <= 1e-6 * torch.linalg.norm(ideal - avg)


def test_methods_that_cannot_run_securely_are_refused_by_name():
    from fedexlora.config import ConfigError, RunConfig

    refused = sorted(n for n, s in REGISTRY.items() if secure_refusal(s))
    assert {"flexlora", "hetlora", "flora", "lorafair", "frlora", "centralized"} <= set(refused)
    # a personalized method: each client's own metrics and test-split size, in the clear
    assert "fedsa" in refused and "metrics and test-split size" in secure_refusal(REGISTRY["fedsa"])
    assert {"fedex", "fedit", "ffa", "fedsb"} <= set(SECURE)
    for m in refused:
        with pytest.raises(ConfigError, match=f"'{m}'"):
            RunConfig(methods=[m], secure_aggregation=True).validate()
    with pytest.raises(ConfigError, match="at least 3 clients per round"):
        RunConfig(num_clients=4, fraction=0.5, secure_aggregation=True).validate()
    with pytest.raises(ConfigError, match="cannot be combined with `max_update_norm`"):
        RunConfig(max_update_norm=1.0, secure_aggregation=True).validate()
    RunConfig(methods=SECURE, secure_aggregation=True).validate()


def test_cli_refuses_a_method_that_cannot_run_securely(tmp_path):
    from typer.testing import CliRunner

    from fedexlora.cli import app

    res = CliRunner().invoke(
        app,
        ["run", "--method", "fedex,flexlora", "--secure-aggregation", "--out", str(tmp_path / "r")],
    )
    assert res.exit_code != 0
    assert "flexlora" in res.output and "secure aggregation" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "r").exists()


# -- the engines --------------------------------------------------------------------------
def _verify():
    from conftest import load_script

    return load_script("benchmarks/verify_export.py")


def _model_vs_ideal(cfg, run_dir):
    from fedexlora.bridge.adapters import lora_layers
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.run.checkpoint import config_fingerprint, latest_checkpoint
    from fedexlora.run.restore import load_task_for, restore_model

    v = _verify()
    ideal, w0 = v.ideal_from_client_adapters(run_dir, cfg)
    ckpt = latest_checkpoint(run_dir / "checkpoints" / "fedex")
    model = restore_model(cfg, load_task_for(cfg), "fedex", ckpt, config_fingerprint(cfg))[0]
    got = {n: effective_weight(layer) for n, layer in lora_layers(model).items()}
    return v.rel(got, ideal, w0)


@pytest.fixture(scope="session")
def wide_bert_dir(tmp_path_factory):
    """tiny BERT at hidden size 96: its 96 x 96 query and value layers send sketches
    (smaller than their products at r = 4, 4 clients), its 24 x 96 FFN layer its product.
    """
    from conftest import save_tiny_bert

    d = tmp_path_factory.mktemp("wide-bert")
    return save_tiny_bert(d, hidden_size=96, intermediate_size=24)


@pytest.fixture(params=["dense", "sketch"])
def width_cfg(request, tiny_cfg):
    """tiny BERT, whose products travel dense, or the wide one, whose q, v sketches do."""
    if request.param == "dense":
        return tiny_cfg
    return tiny_cfg.replace(model=request.getfixturevalue("wide_bert_dir"))


def _secure_cfg(tiny_cfg, **kw):
    # lr 2e-2, as in test_precision: an update large enough that fp32's rounding of the
    # folded residual stays far below 1e-5 of it
    return tiny_cfg.replace(
        methods=["fedex"], secure_aggregation=True, save_client_adapters=True, lr=2e-2, **kw
    )


def test_local_engine_fedex_under_secure_aggregation_equals_the_ideal_with_a_dropout(
    width_cfg, tmp_path, monkeypatch
):
    """(a) exact on the model; (b) the server's code path gets only keys, ciphertexts,
    shares and masked vectors; (c) client 1 trains in round 2 but its masked vector never
    arrives: the round is exact over clients 0 and 2.
    """
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.secagg import protocol
    from fedexlora.secagg.rounds import _plan_of, client_reply

    received = []
    for stage in ("take_keys", "take_shares", "take_masked", "take_unmask"):
        orig = getattr(protocol.ServerSession, stage)

        def spy(self, replies, _orig=orig, _stage=stage):
            received.extend((_stage, c, r) for c, r in replies.items())
            return _orig(self, replies)

        monkeypatch.setattr(protocol.ServerSession, stage, spy)
    uploads = {}
    from fedexlora.run.client_step import local_update as orig_update

    def keep(cfg, method, model, data, rnd, client, **kw):
        up = orig_update(cfg, method, model, data, rnd, client, **kw)
        if (rnd, client) == (1, 2):  # a NaN: the client refuses to send it, and drops out
            flat = {k: v.clone() for k, v in up.state.to_flat().items()}
            next(iter(flat.values())).view(-1)[0] = float("nan")
            return ClientUpload(client, AdapterState.from_flat(flat), up.num_examples)
        uploads[(rnd, client)] = up
        return up

    calls, layouts = [], []

    def reply(session, setup, message, upload, **kw):
        calls.append(session.client)
        layouts.append(
            SecureLayout.for_template(upload.state, products=True, sketch=_plan_of(setup))
        )
        if len(calls) > 4 and session.client == 1:  # round 2: clients 0, 1, 2, 3
            return None
        return client_reply(session, setup, message, upload, **kw)

    # 4 clients: a round that loses one still sums the 3 a secure round needs
    cfg = _secure_cfg(width_cfg, rounds=2, num_clients=4)
    rows = run_experiment(cfg, tmp_path, progress=False, local_update=keep, secure_reply=reply)
    assert calls == [0, 1, 2, 3] * 2
    assert [r["accepted"] for r in rows] == [[0, 1, 3], [0, 2, 3]]
    assert rows[0]["dropped"] == [2] and "NaN" in rows[0]["rejected"]["2"]
    assert rows[1]["dropped"] == [1]
    assert "after sharing its keys" in rows[1]["rejected"]["1"]
    for rnd, kept in ((1, ["client-0", "client-1", "client-3"]),
                      (2, ["client-0", "client-2", "client-3"])):  # fmt: skip
        saved = sorted(p.name for p in (tmp_path / "clients" / f"round-{rnd}").iterdir())
        assert saved == kept  # an upload that never arrived is in no ideal
    assert _model_vs_ideal(cfg, tmp_path) <= 1e-5
    assert all(r["effective_deviation"]["max"] <= 1e-5 for r in rows)
    assert all(r["secure"]["clipped"] == 0 for r in rows)
    assert all(r["deviation"]["max"] > 1e-3 for r in rows)  # FedIT's loss, which FedEx corrects
    # (b) what the server received: keys, ciphertexts, shares, and masked vectors that
    # are noise to every client's true upload
    masked = [np.frombuffer(r, dtype=np.uint32) for s, _, r in received if s == "take_masked"]
    assert len(masked) == 4 * cfg.rounds - 2
    _assert_noise(masked, uploads.values(), Quantization.for_clients(4))
    for stage, _, r in received:
        if stage != "take_masked":  # public keys, ciphertexts and Shamir shares only
            assert all(isinstance(v, (bytes, list)) for v in r.values()), (stage, r)
    # the sketch where it is smaller than the product (the wide model's q and v), and the
    # bytes up are the masked vectors received: 3 limbs of 4 bytes a number (example
    # weighting: 52 + 20 bits), and the count
    sketched = {name for name, _ in layouts[-1].sketches}
    qv = {n for n in uploads[(2, 0)].state.factors if "dense" not in n}  # query, value
    assert sketched == (qv if "wide" in cfg.model else set())
    sizes = [len(r) for s, _, r in received if s == "take_masked"]
    assert sizes == [4 * (layouts[-1].size * _limbs(4) + 1)] * 6
    assert [r["bytes_up"] for r in rows] == [sum(sizes[:3]), sum(sizes[3:])]
    assert rows[1]["num_examples"] == sum(int(uploads[(2, c)].num_examples) for c in (0, 2, 3))


def _limbs(k):
    """Limbs of ``k`` clients' round under example weighting (3: 52 + 20 bits)."""
    from fedexlora.secagg.rounds import BITS, WEIGHT_BITS

    limbs = Quantization.for_clients(k, bits=BITS + WEIGHT_BITS).limbs
    assert limbs == 3
    return limbs


def _assert_noise(masked, uploads, quant):
    """Each recorded vector is noise to every client's true one (its limb 0: the value
    itself, as the client quantized it); the same statistic finds an unmasked vector.
    """
    from fedexlora.secagg.rounds import MAX_EXAMPLES

    for up in uploads:
        # the weight, loss, factors and head: the vector's start, whatever follows it
        # (the layers' products or sketches)
        layout = SecureLayout.for_template(up.state, products=False)
        n = layout.size
        truth = client_vector(layout, up.state, up.num_examples / MAX_EXAMPLES, up.train_loss)
        rng = np.random.default_rng(up.client_id)
        limb0 = quant.encode(truth.numpy(), rng)[0][:n].astype(float)
        again = quant.encode(truth.numpy(), rng)[0][:n].astype(float)  # as if sent unmasked
        assert np.corrcoef(again, limb0)[0, 1] > 0.5  # far above the noise bound below
        for m in masked:
            assert abs(np.corrcoef(m[:n].astype(float), limb0)[0, 1]) < 5 / np.sqrt(n)


def test_flower_engine_fedex_under_secure_aggregation_equals_the_ideal_with_a_dropout(
    width_cfg, tmp_path, task_identity, monkeypatch
):
    """The Flower strategy and ClientApp over the in-process grid (Flower's protobuf both
    ways): (a) exact on the model, (b) the server receives only keys, ciphertexts, shares
    and masked vectors, (c) client 1's masked vector is lost in round 2: the round is
    exact over clients 0, 2 and 3 (a secure round needs 3), and client 1 is re-synced in
    round 3.
    """
    import shutil

    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server
    from test_flower import InProcessGrid

    cfg = _secure_cfg(width_cfg, rounds=3, engine="flower", num_clients=4)
    run_dir = tmp_path / "flower"
    rc = to_run_config(cfg, run_dir=str(run_dir))
    grid = InProcessGrid(make_client_app(rc), 4)
    received = []
    send = grid.send_and_receive

    def recording(messages, *, timeout=None):
        messages = list(messages)
        stages = {
            m.metadata.dst_node_id: (
                str(m.content["config"].get("secagg-stage", "")),
                int(m.content["config"].get("server-round", 0)),
            )
            for m in messages
            if m.metadata.message_type == "train"
        }
        replies = []
        for reply in send(messages, timeout=timeout):
            stage, rnd = stages.get(reply.metadata.src_node_id, ("", 0))
            if (stage, rnd, reply.metadata.src_node_id) == ("collect", 2, 1001):
                continue  # client 1's masked vector never arrives
            if stage:
                received.append((stage, reply.metadata.src_node_id - 1000, reply.content))
            replies.append(reply)
        return replies

    grid.send_and_receive = recording
    from fedexlora.flower import client_app

    sent, orig = [], client_app._secure_upload

    def capture(context, conf, up, *args):
        sent.append(up)
        return orig(context, conf, up, *args)

    monkeypatch.setattr(client_app, "_secure_upload", capture)
    rows = run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    assert [r["accepted"] for r in rows] == [[0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3]]
    assert rows[1]["dropped"] == [1]
    assert all(r["secure"]["clipped"] == 0 for r in rows)
    # FedEx's deviation comes from the sums; the model's cannot (no upload is seen): n/a
    assert all(r["deviation"]["max"] > 1e-3 for r in rows)
    assert all(r["effective_deviation"]["max"] is None for r in rows)
    # the trained adapter of the lost reply is in no ideal: it never reached the server
    shutil.rmtree(run_dir / "clients" / "round-2" / "client-1")
    assert _model_vs_ideal(cfg, run_dir) <= 1e-5
    # (b) no reply carries an array, and each masked vector is noise to the clients' uploads
    assert {s for s, _, _ in received} == {"setup", "share-keys", "collect", "unmask"}
    for stage, c, content in received:
        assert not content.array_records, (stage, c)
    masked = [
        np.frombuffer(content["config"]["secagg.masked"], dtype=np.uint32)
        for stage, _, content in received
        if stage == "collect"
    ]
    assert len(sent) == 12 and len(masked) == 11  # client 1's in round 2 was lost
    _assert_noise(masked, sent, Quantization.for_clients(4))
    # bytes up: the masked vectors received, sketches where smaller than the products
    # (the test matrices' seed changes no size)
    layout = SecureLayout.for_template(sent[0].state, products=True, sketch=SketchPlan(4, 0))
    assert bool(layout.sketches) == ("wide" in cfg.model)
    assert [m.nbytes for m in masked] == [4 * (layout.size * _limbs(4) + 1)] * 11
    assert [r["bytes_up"] for r in rows] == [4 * masked[0].nbytes, 3 * masked[0].nbytes,
                                             4 * masked[0].nbytes]  # fmt: skip


def test_the_download_under_secure_aggregation_is_the_clear_runs(tiny_cfg, wide_bert_dir, tmp_path):
    """The residual is kept factored at rank (k - 1) r, sketched or dense, as in the clear
    run: every round's bytes down (each payload's tensors) equal the clear run's.
    """
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(model=wide_bert_dir, methods=["fedex"], rounds=3, lr=2e-2)
    clear = run_experiment(cfg, tmp_path / "clear", progress=False)
    secure = run_experiment(
        cfg.replace(secure_aggregation=True), tmp_path / "secure", progress=False
    )
    assert [r["accepted"] for r in secure] == [[0, 1, 2]] * 3
    assert [r["bytes_down"] for r in secure] == [r["bytes_down"] for r in clear]
    assert [r["bytes_down_max"] for r in secure] == [r["bytes_down_max"] for r in clear]
    assert secure[1]["bytes_down"] > secure[0]["bytes_down"]  # round 2 carries residuals
