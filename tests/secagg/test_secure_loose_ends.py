"""Secure aggregation's loose ends (issue 55, item 6): nothing of a client's in the clear
by another door, and the protocol's own bytes counted."""

import pytest

pytest.importorskip("flwr")


def test_a_client_configured_for_secure_aggregation_refuses_a_clear_evaluation(
    tiny_cfg, tmp_path, task_identity
):
    """After a secure round, a server that sends EVALUATE messages (a personalized
    method's, asking for each client's metrics and test-split size) gets refusals
    naming why, and no figure of any client."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from fedexlora.bridge.adapters import get_state
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server
    from fedexlora.run.build import new_model
    from fedexlora.run.restore import load_task_for
    from fedexlora.flower.records import to_array_record
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
