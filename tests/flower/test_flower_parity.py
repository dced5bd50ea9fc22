"""The Flower engine against the in-process engine over an in-process grid: the strategy,
feature by feature, and its resume.

Over the in-process grid of ``test_flower.py`` (the real ClientApp and strategy, one
Context per node, every message through Flower's protobuf, no Ray, no sockets): a
misconfigured SuperNode, a reply lost then re-synced, heterogeneous client ranks, saved
client adapters, a 4-bit base, and a run resumed after its server died, with and without
client state on disk. :func:`_flower` and :func:`_close` serve every other file that puts
a feature through both engines. The Ray and SuperLink versions are in
``test_flower_simulation.py`` and ``test_flower_deploy.py``.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedexlora.run.inprocess import run_experiment
from fedexlora.run.report import read_metrics
from fedexlora.run.restore import load_task_for
from test_flower import InProcessGrid, _final_model, _model_rel_diff, _state_dict_rel_diff

# slow: the test order puts it first (tests/conftest.py); its seconds, measured (19 s for
# this file's own tests, 6 s for the two over the grid that test_flower.py held)
pytestmark = pytest.mark.slow(seconds=25)


# -- the Flower engine over the grid, and the comparisons ------------------------------
def _flower(cfg, run_dir, *, grid=None, **settings):
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    rc = to_run_config(cfg, run_dir=str(run_dir), **settings)
    grid = grid or InProcessGrid(make_client_app(rc), cfg.num_clients)
    grid.app = make_client_app(rc)
    return run_server(grid, *resolve_run_config(rc), say=lambda *_: None), grid


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]


def _close(rows_a, rows_b):
    assert [(r["method"], r["round"]) for r in rows_a] == [
        (r["method"], r["round"]) for r in rows_b
    ]
    for a, b in zip(rows_a, rows_b):
        for key in ("sampled", "accepted", "rejected", "dropped", "num_examples"):
            assert a[key] == b[key], key
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-5, abs=1e-6)


# -- the strategy over the grid ------------------------------------------------------
def test_misconfigured_supernode_stops_the_run_naming_it(tiny_cfg, tmp_path, task_identity):
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    rc = to_run_config(tiny_cfg, run_dir=str(tmp_path / "run"))
    confs = [{"partition-id": 0, "num-partitions": 3}, {"partition-id": 1, "num-partitions": 2}]
    confs.append({})
    grid = InProcessGrid(make_client_app(rc), 3, node_configs=confs)
    with pytest.raises(ValueError, match="SuperNode 100[12] cannot take part: "):
        run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    with pytest.raises(ValueError, match=r"--node-config 'partition-id=<i> num-partitions=3'"):
        grid = InProcessGrid(make_client_app(rc), 3, node_configs=confs[:1] + [{}, confs[0]])
        run_server(grid, *resolve_run_config({**rc, "run-dir": str(tmp_path / "r2")}))


def test_dropout_then_resync_stays_exact(tiny_cfg, tmp_path, task_identity):
    """Client 1's reply is lost in round 2; in round 3 it is re-synced from W0.

    Reference: the in-process engine where client 1 simply is not sampled in round 2.
    """
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server
    from fedexlora.run.build import new_model, new_server, prepare
    from fedexlora.run.inprocess import run_method

    method = "fedex"
    cfg = tiny_cfg.replace(methods=[method], rounds=3)
    rc = to_run_config(cfg, run_dir=str(tmp_path / "flower"), min_train_nodes=1)
    fcfg, settings = resolve_run_config(rc)
    grid = InProcessGrid(make_client_app(rc), cfg.num_clients, lose={(2, 1)})
    with pytest.warns(UserWarning, match=f"{method} round 2: client 1 dropped"):
        rows = run_server(grid, fcfg, settings, say=lambda *_: None)
    assert (2, 1) in grid.trained and (3, 1) in grid.trained
    r2 = rows[1]
    assert r2["sampled"] == [0, 1, 2] and r2["dropped"] == [1] and r2["accepted"] == [0, 2]
    assert r2["effective_deviation"]["max"] < 1e-5  # exact over the clients that reported
    assert rows[2]["accepted"] == [0, 1, 2] and rows[2]["dropped"] == []
    assert read_metrics(tmp_path / "flower" / "metrics.jsonl")[1]["dropped"] == [1]

    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, method)
    prep = prepare(cfg, tok, task)
    server = new_server(cfg, method, model)
    sample = server.sample
    server.sample = lambda rnd: [c for c in sample(rnd) if (rnd, c) != (2, 1)]
    ref_rows, ref_model, _ = run_method(
        cfg, method, prep, model=model, server=server, progress=False
    )
    assert [r["num_examples"] for r in rows] == [r["num_examples"] for r in ref_rows]
    got, _ = _final_model(fcfg, tmp_path / "flower", method)
    assert _state_dict_rel_diff(got, ref_model) < 1e-5


# -- the Flower engine against the in-process engine, feature by feature -------------
def test_client_ranks_and_saved_adapters_match_the_local_engine(tiny_cfg, tmp_path, task_identity):
    cfg = tiny_cfg.replace(
        methods=["fedex"], rounds=2, lora_r=4, client_ranks=[2, 4, 3], save_client_adapters=True
    )
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    assert max(r["effective_deviation"]["max"] for r in flower) < 1e-5
    got, _ = _final_model(cfg, tmp_path / "flower", "fedex")
    ref, _ = _final_model(cfg, tmp_path / "local", "fedex")
    assert _state_dict_rel_diff(got, ref) < 1e-6
    for rnd in (1, 2):
        for c, sub in ((0, "rank2"), (1, ""), (2, "rank3")):
            rel = f"clients/round-{rnd}/client-{c}/{sub}/adapter_model.safetensors".replace(
                "//", "/"
            )
            a = load_file(str(tmp_path / "flower" / rel))
            b = load_file(str(tmp_path / "local" / rel))
            assert set(a) == set(b), rel
            for k in a:  # fp32 noise: a client of another rank folds its catch-up in
                # other groupings than the local engine's client does (2.5e-7 of 0.027 seen)
                tol = 1e-5 * float(b[k].abs().max())
                assert torch.allclose(a[k], b[k], rtol=1e-5, atol=tol), (rel, k)
            # each client saved its own; the server added its weight, on both engines
            metas = [
                json.loads(
                    (tmp_path / eng / f"clients/round-{rnd}/client-{c}/meta.json").read_text()
                )
                for eng in ("flower", "local")
            ]
            assert metas[0] == metas[1] and set(metas[0]) >= {"num_examples", "weight"}, metas


def test_clients_that_keep_parts_save_their_own_adapters_under_flower(
    tiny_cfg, tmp_path, task_identity
):
    """FedSA-LoRA's clients keep B and the head: the server never receives them, so only
    the client can save its adapter. Each Flower client saves what it trained, as the
    in-process engine's does (B kept across rounds), and the server adds the weights."""
    cfg = tiny_cfg.replace(methods=["fedsa"], rounds=2, save_client_adapters=True)
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    for rnd in (1, 2):
        for c in range(cfg.num_clients):
            rel = f"clients/round-{rnd}/client-{c}"
            a = load_file(str(tmp_path / "flower" / rel / "adapter_model.safetensors"))
            b = load_file(str(tmp_path / "local" / rel / "adapter_model.safetensors"))
            assert set(a) == set(b) and any("lora_B" in k for k in a), rel
            for k in a:
                tol = 1e-5 * float(b[k].abs().max())
                assert torch.allclose(a[k], b[k], rtol=1e-5, atol=tol), (rel, k)
            metas = [json.loads((tmp_path / e / rel / "meta.json").read_text()) for e in
                     ("flower", "local")]  # fmt: skip
            assert metas[0] == metas[1] and "weight" in metas[0], metas
    saved = tmp_path / "flower/clients/round-2"
    b_of = [load_file(str(saved / f"client-{c}/adapter_model.safetensors"))
            for c in range(cfg.num_clients)]  # fmt: skip
    key = next(k for k in b_of[0] if "lora_B" in k)
    assert not torch.equal(b_of[0][key], b_of[1][key])  # each its own B, not the server's


def test_the_stopping_rule_stops_both_engines_at_the_same_round(tiny_cfg, tmp_path, task_identity):
    """``stop_at`` is read by the one round loop: under Flower too, each method stops
    after the round that reached it, with the in-process engine's rows."""
    cfg = tiny_cfg.replace(methods=["fedex", "fedit"], rounds=3, stop_at=0.0)
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, _ = _flower(cfg, tmp_path / "flower")
    assert [(r["method"], r["round"]) for r in flower] == [("fedex", 1), ("fedit", 1)]
    _close(flower, local)


def test_nf4_base_with_side_branch_matches_the_local_engine(tiny_cfg, tmp_path, task_identity):
    pytest.importorskip("bitsandbytes")
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, quantization="nf4")
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    assert max(r["effective_deviation"]["max"] for r in flower) < 1e-5
    a = load_file(str(tmp_path / "flower/checkpoints/fedex/round-0002/base_deltas.safetensors"))
    b = load_file(str(tmp_path / "local/checkpoints/fedex/round-0002/base_deltas.safetensors"))
    assert set(a) == set(b) and any(k.startswith("side.") for k in a)
    for k in a:  # the side branches hold the same residuals
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k


@pytest.mark.parametrize("client_disk", [True, "node-config", False])
def test_resume_after_the_server_died(tiny_cfg, tmp_path, task_identity, client_disk):
    """Rounds 1-2, then the server and every Context are lost; a new run resumes.

    With client state on disk the clients continue where they were, and the result is
    bit-identical to an uninterrupted run. Without it (a deployment whose SuperNodes
    restarted too), every client is re-synced from W0: the same model within 1e-6
    relative (the training of two more rounds on a base equal to rounding magnifies the
    difference of the smallest tensors, LoRA's B, to about 1e-6 each).
    """
    cfg = tiny_cfg.replace(methods=["fedex", "fedit"], rounds=4)
    extra = {"client_state_dir": str(tmp_path / "state")} if client_disk is True else {}

    def grid():  # fresh Contexts: whatever the ClientApps held in them is lost
        from fedexlora.flower.client_app import make_client_app

        confs = [
            {"partition-id": i, "num-partitions": 3}
            | ({"state-dir": str(tmp_path / f"node-{i}")} if client_disk == "node-config" else {})
            for i in range(3)
        ]
        return InProcessGrid(make_client_app({}), 3, node_configs=confs)

    clean, _ = _flower(cfg, tmp_path / "clean", grid=grid(), **extra)
    run = tmp_path / "run"
    _flower(cfg.replace(rounds=2), run, grid=grid(), **extra)  # killed after round 2
    # a kill leaves rounds = 4 in it, and the run writes its config resolved
    (run / "config.toml").write_text(cfg.resolved().to_toml())
    rows, grid = _flower(cfg, run, grid=grid(), resume=str(run), **extra)
    assert [(r["method"], r["round"]) for r in rows] == [
        (m, r) for m in ("fedex", "fedit") for r in (1, 2, 3, 4)
    ]
    assert read_metrics(run / "metrics.jsonl") == rows  # every method's rows in order
    assert sorted(set(grid.trained)) == [(r, c) for r in (3, 4) for c in (0, 1, 2)]
    if client_disk:
        assert _strip(rows) == _strip(clean)
    else:
        _close(rows, clean)
    for method in cfg.methods:
        got, _ = _final_model(cfg, run, method)
        ref, _ = _final_model(cfg, tmp_path / "clean", method)
        if client_disk:
            assert _state_dict_rel_diff(got, ref) == 0.0, method
        else:
            assert _model_rel_diff(got, ref) < 1e-6, method
            assert _state_dict_rel_diff(got, ref) < 1e-5, method


def test_expected_flower_notes_are_quiet_and_the_rest_is_kept(tiny_cfg, tmp_path, task_identity):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("flwr").addHandler(handler)
    try:
        _flower(tiny_cfg.replace(methods=["fedex"], rounds=1), tmp_path / "run")
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    text = "\n".join(records)
    assert "configure_train: 3 of 3 sampled partitions sent" in text  # informative: kept
    assert "fraction_evaluate is set to 0.0" not in text
    assert "Initial global evaluation results: None" not in text
    assert not logging.getLogger("flwr").filters  # nothing left behind


def test_a_supernode_of_another_configuration_is_refused_naming_version_skew(
    tiny_cfg, tmp_path, task_identity
):
    """A ClientApp that resolved other settings (or hashes them otherwise: another
    fedex-lora version) is refused, both when the server asks each node what it holds and
    when a message reaches it; the error names both causes."""
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    rc = to_run_config(tiny_cfg, run_dir=str(tmp_path / "run"))
    other = to_run_config(tiny_cfg.replace(lr=tiny_cfg.lr * 2), run_dir=str(tmp_path / "run"))
    grid = InProcessGrid(make_client_app(other), tiny_cfg.num_clients)
    skew = r"must share one run config and one fedex-lora version"
    with pytest.raises(ValueError, match=r"resolved another configuration .*" + skew):
        run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    assert not grid.trained  # refused before any client trained

    # a train message reaching such a ClientApp (a node swapped after it answered the
    # server's question) is refused by the ClientApp itself (this grid calls it directly;
    # Flower would send its error back as the reply)
    class Swapped(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            kinds = {m.metadata.message_type for m in messages}
            self.app = make_client_app(other if "train" in kinds else rc)
            return super().send_and_receive(messages, timeout=timeout)

    grid = Swapped(make_client_app(rc), tiny_cfg.num_clients)
    run = {**rc, "run-dir": str(tmp_path / "swapped")}
    with pytest.raises(
        ValueError, match=r"this ClientApp resolved another configuration .*" + skew
    ):
        run_server(grid, *resolve_run_config(run), say=lambda *_: None)
