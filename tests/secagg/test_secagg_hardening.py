"""Secure aggregation, hardened (#47): masks from the whole secret, seeded rounding, and
a client that never sends in the clear what its own configuration says to mask."""

import hashlib

import numpy as np
import pytest

pytest.importorskip("flwr")

from conftest import without_timings  # noqa: E402
from test_secure_aggregation import (
    _protocol,  # noqa: E402  (one SecAgg+ round in process)
    wide_bert_dir,  # noqa: E402, F401  (layers sending sketches)
)

pytestmark = pytest.mark.slow(seconds=75)


def test_every_bit_of_the_secret_changes_the_mask():
    from fedexlora.secagg.protocol import _mask

    seed = hashlib.sha256(b"a pairwise key").digest()  # 32 bytes, as the protocol's
    base = _mask(seed, 1000)
    assert base.min() >= 0 and base.max() < 2**32
    for bit in range(8 * len(seed)):
        flipped = bytearray(seed)
        flipped[bit // 8] ^= 1 << (bit % 8)
        other = _mask(bytes(flipped), 1000)
        assert np.mean(other != base) > 0.99, bit
    # Flower's generator folds a seed to 32 bits (XOR of its words): two secrets with the
    # same words in another order give it one mask, and ours two
    swapped = seed[4:8] + seed[:4] + seed[8:]
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    flower = [pseudo_rand_gen(s, 2**32, [(1000,)])[0] for s in (seed, swapped)]
    assert np.array_equal(*flower)
    assert np.mean(_mask(swapped, 1000) != base) > 0.99


def test_masks_cancel_and_every_round_masks_anew():
    rng = np.random.default_rng(0)
    vectors = [rng.integers(0, 2**20, size=500) for _ in range(3)]
    plain = sum(vectors) % 2**32
    first, _, seen1 = _protocol(3, vectors)
    second, _, seen2 = _protocol(3, vectors)
    masked1, masked2 = ({c: r for s, c, r in seen if s == "collect"} for seen in (seen1, seen2))
    assert np.array_equal(first, plain) and np.array_equal(second, plain)
    for c in range(3):
        one, two = (np.frombuffer(m[c], dtype=np.uint32) for m in (masked1, masked2))
        assert not np.array_equal(one.astype(np.int64) % 2**32, vectors[c])
        assert np.mean(one != two) > 0.99  # fresh keys, fresh masks: rounds differ


def test_stochastic_rounding_is_drawn_from_the_run_seed_per_client_and_round():
    from fedexlora.secagg.encoding import Quantization
    from fedexlora.secagg.rounds import rounding_generator

    q = Quantization.for_clients(3)
    x = np.random.default_rng(1).normal(size=4000) * 1e-3
    before = np.random.get_state()[1].copy()
    same = [q.encode(x, rounding_generator(7, 2, 1))[0] for _ in range(2)]
    assert np.array_equal(*same)
    assert np.array_equal(np.random.get_state()[1], before)  # numpy's global: untouched
    for other in (rounding_generator(7, 2, 0), rounding_generator(7, 3, 1),
                  rounding_generator(8, 2, 1)):  # fmt: skip
        assert not np.array_equal(q.encode(x, other)[0], same[0])
    # still the value: unbiased, within one step of the last limb
    assert np.max(np.abs(q.decode(same[0], 1) - x)) <= q.resolution


def test_two_secure_runs_with_one_seed_write_identical_rows(tiny_cfg, tmp_path):
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, lr=2e-2)
    rows = [
        [without_timings(r) for r in run_experiment(cfg, tmp_path / f"run{i}", progress=False)]
        for i in range(2)
    ]
    assert rows[0] == rows[1]
    assert rows[0][-1]["secure"]["clipped"] == 0


def test_a_client_configured_for_secure_aggregation_never_sends_in_the_clear(
    tiny_cfg, tmp_path, task_identity
):
    """A server that asks for a clear upload (the stage dropped from its train message)
    gets a refusal naming why, and no client sends an array."""
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server
    from test_flower import InProcessGrid

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, engine="flower", rounds=1)
    rc = to_run_config(cfg, run_dir=str(tmp_path / "flower"))
    grid = InProcessGrid(make_client_app(rc), 3)
    send, replies = grid.send_and_receive, []

    def dishonest(messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            conf = m.content["config"]
            if m.metadata.message_type == "train" and conf.get("secagg-stage") == "collect":
                conf.pop("secagg-stage")  # the upload's message: "send it in the clear"
        got = list(send(messages, timeout=timeout))
        replies.extend(got)
        return got

    grid.send_and_receive = dishonest
    with pytest.raises(Exception, match="refuses to send its upload in the clear"):
        run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    assert replies and not any(r.has_content() and r.content.array_records for r in replies)


def test_a_round_with_two_survivors_is_refused_and_changes_nothing(tiny_cfg, tmp_path):
    """Of two survivors, each learns the other's upload from the sum: never completed."""
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.secagg.protocol import SecAggError
    from fedexlora.secagg.rounds import client_reply

    rng = np.random.default_rng(2)
    vectors = [rng.integers(0, 2**20, size=50) for _ in range(3)]
    with pytest.raises(SecAggError, match="a round needs 3"):
        _protocol(3, vectors, drop=(2,))

    def reply(session, setup, message, upload, **kw):
        if session.client == 2 and kw["rnd"] == 1:
            return None  # drops out after training: 2 of 3 would be left
        return client_reply(session, setup, message, upload, **kw)

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, lr=2e-2)
    rows = run_experiment(cfg, tmp_path, progress=False, secure_reply=reply)
    assert rows[0]["accepted"] == [] and rows[1]["accepted"] == [0, 1, 2]
    assert all("a round needs 3" in why for why in rows[0]["rejected"].values())
    assert "the global model is unchanged" in rows[0]["note"]


def test_a_client_answers_each_stage_once_and_in_order():
    """The stage check stops a replay: a client that sent its masked vector never shares
    its secrets again (fresh Shamir shares of one mask seed would let the server rebuild
    both the seed and the private key)."""
    from fedexlora.secagg.protocol import ClientSession, ServerSession

    k, size = 3, 20
    server = ServerSession(list(range(k)), size)
    sessions = {c: ClientSession(c) for c in range(k)}
    setup = server.setup()
    server.take_keys({c: sessions[c].setup(m) for c, m in setup.items()})
    share = server.share_keys()

    def refused(c, call, *args):
        with pytest.raises(ValueError, match="stage"):
            getattr(sessions[c], call)(*args)

    refused(0, "masked", {}, np.zeros(size, dtype=np.int64))  # before sharing keys
    refused(0, "unmask", {})
    server.take_shares({c: sessions[c].share_keys(m) for c, m in share.items()})
    refused(0, "share_keys", share[0])  # twice: fresh shares of its secrets
    collect = server.collect()
    vec = np.arange(size, dtype=np.int64)
    server.take_masked({c: sessions[c].masked(m, vec) for c, m in collect.items()})
    refused(0, "share_keys", share[0])  # after its masked vector: the replay
    refused(0, "masked", collect[0], vec)  # a second vector under the same masks
    unmask = server.unmask()
    server.take_unmask({c: sessions[c].unmask(m) for c, m in unmask.items()})
    refused(0, "unmask", unmask[0])  # its shares once
    refused(0, "share_keys", share[0])


def test_uniform_weighting_holds_under_secure_aggregation(tiny_cfg, tmp_path):
    """--weighting uniform with secure aggregation: the model is the uniform ideal, rebuilt
    from the clients' own adapters (their example counts differ: dirichlet parts)."""
    import json

    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.layout import RunLayout
    from test_secure_aggregation import _model_vs_ideal, _secure_cfg

    cfg = _secure_cfg(tiny_cfg, rounds=1, weighting="uniform")
    run_experiment(cfg, tmp_path, progress=False)
    metas = [
        json.loads(RunLayout(tmp_path).client_adapter_meta(1, c).read_text()) for c in range(3)
    ]
    assert len({m["num_examples"] for m in metas}) > 1  # by examples, another model
    assert all(m["weight"] == pytest.approx(1 / 3) for m in metas)
    assert _model_vs_ideal(cfg, tmp_path) <= 1e-5


def test_what_the_server_learns_of_a_refusing_client_names_none_of_its_figures(tiny_cfg, tmp_path):
    """A client whose count cannot be weighed drops out; the reason, which the server
    records, names neither its count nor its values."""
    from fedexlora.core.messages import ClientUpload
    from fedexlora.run.client_step import local_update
    from fedexlora.run.inprocess import run_experiment

    odd = {(1, 1): 2**21 + 7, (1, 2): -13}  # too many for the weights; not a count

    def faulty(cfg, method, model, data, rnd, client, **kw):
        up = local_update(cfg, method, model, data, rnd, client, **kw)
        n = odd.get((rnd, client))
        return up if n is None else ClientUpload(client, up.state, n, up.train_loss)

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, rounds=1, num_clients=5)
    rows = run_experiment(cfg, tmp_path, progress=False, local_update=faulty)
    why = rows[0]["rejected"]
    assert rows[0]["accepted"] == [0, 3, 4]
    assert "exceeds" in why["1"] and "not a positive integer" in why["2"]
    for reason in (why["1"], why["2"]):
        assert "2097159" not in reason and "-13" not in reason and "got" not in reason


def test_two_secure_runs_whose_layers_send_sketches_write_identical_rows(
    tiny_cfg, tmp_path, request
):
    """#55: the rebuild from sketches (QR, least squares, SVD) repeats to the bit, so two
    runs with one seed write the same rows (deviations included) and checkpoints."""
    from fedexlora.core.sketch import SketchPlan
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(
        model=request.getfixturevalue("wide_bert_dir"),
        methods=["fedex"],
        secure_aggregation=True,
        lr=2e-2,
    )
    assert SketchPlan(cfg.num_clients, 0).shape(96, 96, cfg.lora_r) is not None  # sketched
    rows = [
        [without_timings(r) for r in run_experiment(cfg, tmp_path / f"run{i}", progress=False)]
        for i in range(2)
    ]
    assert rows[0] == rows[1]
    assert all(r["deviation"] for r in rows[0][1:])  # a residual was rebuilt each round
    import hashlib

    def files(run):
        return {
            p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*.safetensors"))
        }

    assert files(tmp_path / "run0") == files(tmp_path / "run1") != {}
