"""FedSA-LoRA (Guo et al., ICLR 2025): A averaged, B and the task head kept by each
client, each client evaluated on its own test split; against computations by hand, on
both engines, and across a resume."""

import pytest
import torch

from fedexlora.bridge.adapters import get_state, layer_info
from fedexlora.core.aggregation import aggregate
from fedexlora.core.messages import ClientUpload
from fedexlora.run.inprocess import run_experiment
from fedexlora.server import Server
from test_paper_methods import _factors


def test_fedsa_averages_A_and_leaves_B_to_the_clients():
    As, Bs, p = _factors(k=4)
    Bs = [Bs[0].clone() for _ in Bs]  # clients send no B: the server fills in its own
    res = aggregate(As, Bs, p, method="fedsa")
    assert torch.allclose(res.A, sum(pi * A for pi, A in zip(p, As)), atol=1e-12)
    assert torch.equal(res.B, Bs[0]) and res.residual.is_zero


def test_fedsa_server_sends_and_takes_no_B_after_a_clients_first_payload(tiny_bert_dir):
    from test_scale import _model

    model = _model(tiny_bert_dir)
    server = Server(get_state(model), layer_info(model), num_clients=2, method="fedsa")
    first = server.payload_for(0)
    assert first.reset and all(B is not None for _, B in first.state.factors.values())
    g = torch.Generator().manual_seed(0)

    def upload(c, with_B):
        factors = {
            k: (torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g) if with_B
                else None)
            for k, (a, b) in server.state.factors.items()
        }  # fmt: skip
        return ClientUpload(c, type(server.state)(factors=factors), 10)  # no head: kept

    server.payload_for(1)
    B_before = {k: B.clone() for k, (_, B) in server.state.factors.items()}
    outcome = server.aggregate([upload(0, True), upload(1, False)])
    assert outcome.accepted == [1] and "keys" in outcome.rejected[0]  # a B is refused
    assert all(torch.equal(B, B_before[k]) for k, (_, B) in server.state.factors.items())
    nxt = server.payload_for(1)
    assert not nxt.reset and all(B is None for _, B in nxt.state.factors.values())
    assert not nxt.state.extra and server.state.extra  # the server's head stays its own


def test_partition_like_gives_each_client_its_training_share_of_every_class():
    import numpy as np

    from fedexlora.tasks.partition import partition_like

    rng = np.random.default_rng(0)
    train = rng.integers(0, 3, 300)
    parts = [list(range(0, 40)), list(range(40, 200)), list(range(200, 300))]
    train[:40] = 0  # client 0 holds only class 0
    test = rng.integers(0, 3, 90)
    got = partition_like(train, parts, test, 90, seed=1)
    assert sorted(i for c in got for i in c) == list(range(90))
    assert all(test[i] == 0 for i in got[0])
    for y in range(3):
        held = np.array([np.count_nonzero(train[p] == y) for p in parts])
        want = held / held.sum() * np.count_nonzero(test == y)
        have = [np.count_nonzero(test[c] == y) for c in got]
        assert np.all(np.abs(have - want) <= 1), (y, have, want)
    iid = partition_like(None, parts, None, 10, seed=1)
    assert sorted(map(len, iid)) == [3, 3, 4]


def test_fedsa_end_to_end_each_client_keeps_its_B_on_both_engines(
    tiny_cfg, tmp_path, task_identity, seen_updates
):
    """Each client trains from the B and head it kept, and the row's per-client metrics are
    those of (the uniform mean of the uploaded A's, the release's weighting, the client's
    own B and head) on the client's own test split; Flower's clients, each holding its own
    model, agree."""
    from fedexlora.core.state import AdapterState
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.restore import load_task_for
    from fedexlora.run.rounds import evaluate_personal
    from test_flower_parity import _close, _flower

    cfg = tiny_cfg.replace(methods=["fedsa"], rounds=2, lr=2e-2)
    seen, spy = seen_updates
    local = run_experiment(cfg, tmp_path / "local", progress=False, local_update=spy)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedsa")
    prep = prepare(cfg, tok, task)
    for rnd, row in enumerate(local, start=1):
        assert row["deviation"]["mean"] is None and row["effective_deviation"]["max"] is None
        ups = [seen[(rnd, c)][2] for c in range(cfg.num_clients)]
        assert all(B is None for u in ups for _, B in u.state.factors.values())
        assert all(not u.state.extra for u in ups)  # the head stays on the client too
        assert len({u.num_examples for u in ups}) > 1  # dataset sizes differ: weights matter
        p = torch.full((len(ups),), 1 / len(ups), dtype=torch.float64)
        A_bar = {k: sum(pi * u.state.factors[k][0].double() for pi, u in zip(p, ups)).float()
                 for k in ups[0].state.factors}  # fmt: skip
        for c in range(cfg.num_clients):
            after = seen[(rnd, c)][1]
            if rnd == 2:  # it trained round 2 from the B and head it kept after round 1
                kept, start = seen[(1, c)][1], seen[(2, c)][0]
                for k, (_, B) in kept.factors.items():
                    assert torch.equal(start.factors[k][1], B), k
                for k, t in kept.extra.items():
                    assert torch.equal(start.extra[k], t), k
            own = AdapterState(factors={k: (None, B) for k, (_, B) in after.factors.items()},
                               extra=after.extra)  # fmt: skip
            glob = AdapterState(factors={k: (A, None) for k, A in A_bar.items()})
            metrics, m = evaluate_personal(cfg, "fedsa", model, prep, c, glob, own)
            assert m == row["personalized"]["test_examples"][str(c)] > 0
            assert metrics == pytest.approx(row["personalized"]["clients"][str(c)], abs=1e-6)
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    for a, b in zip(flower, local):
        assert a["personalized"]["test_examples"] == b["personalized"]["test_examples"]
        for c, m in a["personalized"]["clients"].items():
            assert m == pytest.approx(b["personalized"]["clients"][c], rel=1e-5, abs=1e-6)


def test_fedsa_resume_continues_each_clients_own_B(tiny_cfg, tmp_path, task_identity):
    """The in-process engine checkpoints what its clients keep: a resumed run is the
    uninterrupted one."""
    cfg = tiny_cfg.replace(methods=["fedsa"], rounds=2, lr=2e-2)
    whole = run_experiment(cfg, tmp_path / "whole", progress=False)
    run_experiment(cfg.replace(rounds=1), tmp_path / "cut", progress=False)
    again = run_experiment(cfg, tmp_path / "cut", resume=True, progress=False)
    # round 2 trains from the B each client kept (from B = 0 its loss differs)
    assert again[1]["train_loss"] == pytest.approx(whole[1]["train_loss"], rel=1e-6)
    assert again[1]["personalized"] == whole[1]["personalized"]
    assert again[1]["metrics"] == whole[1]["metrics"]
