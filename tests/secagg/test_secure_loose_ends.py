"""Secure aggregation's loose ends (issue 55, item 6): nothing of a client's in the clear
by another door, and the protocol's own bytes counted."""

import pytest

pytest.importorskip("flwr")

pytestmark = pytest.mark.slow(seconds=120)


def test_a_client_configured_for_secure_aggregation_refuses_a_clear_evaluation(
    tiny_cfg, tmp_path, task_identity
):
    """After a secure round, a server that sends EVALUATE messages (a personalized
    method's, asking for each client's metrics and test-split size) gets refusals
    naming why, and no figure of any client."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from fedexlora.bridge.adapters import get_state
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_array_record, to_run_config
    from fedexlora.flower.server_app import run_server
    from fedexlora.run.build import new_model
    from fedexlora.run.restore import load_task_for
    from test_flower import InProcessGrid

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, engine="flower", rounds=1)
    rc = to_run_config(cfg, run_dir=str(tmp_path / "flower"))
    grid = InProcessGrid(make_client_app(rc), 3)
    send, trains = grid.send_and_receive, {}

    def recording(messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train" and "version" in m.content["config"]:
                trains[m.metadata.dst_node_id] = dict(m.content["config"])
        return list(send(messages, timeout=timeout))

    grid.send_and_receive = recording
    rows = run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    assert rows[-1]["accepted"] == [0, 1, 2]
    model, _ = new_model(cfg, load_task_for(cfg), "fedex")
    arrays = to_array_record(get_state(model).to_flat())
    messages = []
    for node, conf in trains.items():
        keep = ("method", "partition-id", "fingerprint", "run-token")
        # the version the client holds after the round (what a personal evaluation asks)
        fields = {k: conf[k] for k in keep} | {"server-round": 1, "base-version": conf["version"]}
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(fields)})
        messages.append(
            Message(content, message_type=MessageType.EVALUATE, dst_node_id=node, group_id="ev")
        )
    replies = send(messages)
    assert len(replies) == 3
    for reply in replies:
        conf = reply.content["config"]
        assert "metrics" not in conf and "test-examples" not in conf, dict(conf)
        assert "refuses to send its own evaluation in the clear" in str(conf["error"])


def test_the_export_check_reads_only_the_accepted_clients_adapters(tiny_cfg, tmp_path):
    """Round 1 is refused (two survivors), yet clients 0 and 1 trained and saved their
    adapters; the ideal that ``benchmarks/verify_export.py`` rebuilds leaves them out, as
    the model does, and equals the model within 1e-5."""
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.secagg.rounds import client_reply
    from test_secure_aggregation import _model_vs_ideal

    def reply(session, setup, message, upload, **kw):
        if session.client == 2 and kw["rnd"] == 1:
            return None  # drops out after training: 2 of 3 would be left
        return client_reply(session, setup, message, upload, **kw)

    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, lr=2e-2,
                           save_client_adapters=True)  # fmt: skip
    rows = run_experiment(cfg, tmp_path, progress=False, secure_reply=reply)
    assert rows[0]["accepted"] == [] and rows[1]["accepted"] == [0, 1, 2]
    saved = sorted(p.name for p in (tmp_path / "clients" / "round-1").iterdir())
    assert saved == ["client-0", "client-1"]  # trained, saved, and in no model
    assert _model_vs_ideal(cfg, tmp_path) <= 1e-5


def _bytes_in(value) -> int:
    """An independent count of a reply: each byte string's length (keys, ciphertexts,
    shares) and 8 bytes for each number (the node ids a share names)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return 8
    if isinstance(value, dict):
        return sum(_bytes_in(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes_in(v) for v in value)
    return 0


def test_the_protocols_keys_and_shares_are_counted_on_both_engines(
    tiny_cfg, tmp_path, task_identity, monkeypatch
):
    """``bytes_up_protocol``: what SecAgg+'s server side received of stages 0, 1 and 3,
    counted at the server session itself; the same on both engines; apart from
    ``bytes_up`` (the masked vectors)."""
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.secagg import protocol
    from test_flower_parity import _flower

    received = []
    for stage in ("take_keys", "take_shares", "take_unmask"):
        orig = getattr(protocol.ServerSession, stage)

        def spy(self, replies, _orig=orig):
            received.append(sum(_bytes_in(r) for r in replies.values()))
            return _orig(self, replies)

        monkeypatch.setattr(protocol.ServerSession, stage, spy)
    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, rounds=2, num_clients=4,
                           min_partition_size=5)  # fmt: skip
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    assert len(received) == 6  # three stages a round
    per_round = [sum(received[:3]), sum(received[3:])]
    received.clear()
    flower, _ = _flower(cfg, tmp_path / "flower")
    assert [sum(received[:3]), sum(received[3:])] == per_round
    for rows in (local, flower):
        assert [r["bytes_up_protocol"] for r in rows] == per_round
        for r in rows:  # at least two keys, and shares for every other client, each
            assert r["bytes_up_protocol"] > 4 * (2 * 32 + 3 * 32)
            assert r["bytes_up"] > 0 and r["bytes_up"] != r["bytes_up_protocol"]
    print("bytes_up_protocol per client and round (k=4):", [b / 4 for b in per_round])


def test_train_loss_has_one_definition_clear_and_secure(tiny_cfg, tmp_path, seen_updates):
    """A round's ``train_loss`` is the accepted clients' losses weighted as the model is
    (here by examples), on the clear path as inside secure aggregation's sum: computed
    by hand from the clients' own uploads, and equal across the two paths."""
    from fedexlora.run.inprocess import run_experiment

    seen, spy = seen_updates
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, weighting="examples")
    clear = run_experiment(cfg, tmp_path / "clear", progress=False, local_update=spy)
    ups = [seen[(1, c)][2] for c in clear[0]["accepted"]]
    sizes = [int(u.num_examples) for u in ups]
    assert len(set(sizes)) > 1, "the partitions must differ in size for the test to tell"
    hand = sum(n * u.train_loss for n, u in zip(sizes, ups)) / sum(sizes)
    assert clear[0]["train_loss"] == pytest.approx(hand, rel=1e-12)
    plain = sum(u.train_loss for u in ups) / len(ups)
    assert abs(hand - plain) > 1e-6  # the unweighted mean is another figure
    secure = run_experiment(cfg.replace(secure_aggregation=True), tmp_path / "secure",
                            progress=False)  # fmt: skip
    assert secure[0]["train_loss"] == pytest.approx(hand, rel=1e-6)
