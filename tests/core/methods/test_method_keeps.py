"""A method that keeps a part of the adapter on each client is a spec and its math alone.

``MethodSpec.keeps`` declares what a client keeps for itself (FedSA-LoRA: B and the task
head). Here a toy method keeps A instead, and shares B and the head: registered for the
test only, with no other code, it runs on both engines. Each client trains every round
from the A it kept, uploads no A, and is evaluated on its own test split with its own A
and the averaged B and head, computed here by hand.
"""

import pytest
import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods import REGISTRY, MethodSpec
from fedexlora.core.state import AdapterState
from fedexlora.run.inprocess import run_experiment


def _aggregate(A, B, p, *, out_dtype=None, generator=None, **_):
    """B averaged; A is each client's own (the server keeps its global one as sent)."""
    d, n = B.shape[1], A.shape[2]
    B_new = torch.einsum("k,kdr->dr", p, B)
    out = out_dtype or A.dtype
    return A[0].to(out), B_new.to(out), Residual.zero(d, n, dtype=out, device=A.device)


KEEP_A = MethodSpec(
    name="toy_keep_a",
    title="keep-A (test)",
    paper="none: a test of MethodSpec.keeps",
    trains="A and B (A stays on the client)",
    keeps_local="A_i",
    uploads="B_i and the head",
    downloads="B̄ and the head",
    exact=False,
    linear=True,
    bytes_per_round="up 4krd; down 4krd",
    aggregate=_aggregate,
    keeps=("A",),
)


@pytest.fixture()
def keep_a(monkeypatch):
    monkeypatch.setitem(REGISTRY, KEEP_A.name, KEEP_A)  # the one registry entry


def test_a_spec_refuses_what_cannot_be_kept():
    from dataclasses import replace

    with pytest.raises(ValueError, match="`keeps` takes"):
        replace(KEEP_A, keeps=("C",))
    with pytest.raises(ValueError, match="shares nothing"):
        replace(KEEP_A, keeps=("A", "B"))
    assert KEEP_A.uploaded(1) == (False, True) and KEEP_A.shares_head
    assert REGISTRY["fedsa"].uploaded(1) == (True, False) and not REGISTRY["fedsa"].shares_head


def test_a_method_that_keeps_A_runs_on_both_engines(
    keep_a, tiny_cfg, tmp_path, task_identity, seen_updates
):
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.restore import load_task_for
    from fedexlora.run.rounds import evaluate_personal
    from test_flower_parity import _close, _flower

    cfg = tiny_cfg.replace(methods=[KEEP_A.name], rounds=2, lr=2e-2)
    seen, spy = seen_updates
    local = run_experiment(cfg, tmp_path / "local", progress=False, local_update=spy)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, KEEP_A.name)
    prep = prepare(cfg, tok, task)
    for rnd, row in enumerate(local, start=1):
        assert row["effective_deviation"]["max"] is None  # no one global model
        ups = [seen[(rnd, c)][2] for c in range(cfg.num_clients)]
        assert all(A is None and B is not None for u in ups for A, B in u.state.factors.values())
        assert all(u.state.extra for u in ups)  # the head travels
        n = torch.tensor([float(u.num_examples) for u in ups], dtype=torch.float64)
        p = n / n.sum()  # the default weighting: examples
        B_bar = {k: sum(pi * u.state.factors[k][1].double() for pi, u in zip(p, ups)).float()
                 for k in ups[0].state.factors}  # fmt: skip
        head = {k: sum(pi * u.state.extra[k].double() for pi, u in zip(p, ups)).float()
                for k in ups[0].state.extra}  # fmt: skip
        for c in range(cfg.num_clients):
            after = seen[(rnd, c)][1]
            if rnd == 2:  # it trained round 2 from the A it kept after round 1
                kept, start = seen[(1, c)][1], seen[(2, c)][0]
                for k, (A, _) in kept.factors.items():
                    assert torch.equal(start.factors[k][0], A), k
            own = AdapterState(factors={k: (A, None) for k, (A, _) in after.factors.items()})
            glob = AdapterState(factors={k: (None, B) for k, B in B_bar.items()}, extra=head)
            metrics, m = evaluate_personal(cfg, KEEP_A.name, model, prep, c, glob, own)
            assert m == row["personalized"]["test_examples"][str(c)] > 0
            assert metrics == pytest.approx(row["personalized"]["clients"][str(c)], abs=1e-5)
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    for a, b in zip(flower, local):
        for c, m in a["personalized"]["clients"].items():
            assert m == pytest.approx(b["personalized"]["clients"][c], rel=1e-5, abs=1e-6)
