"""A method that trains a different factor is a spec, its round plan and its math alone.

``MethodSpec.round_plan`` says what a method's clients train, upload and keep in a round
(RoLoRA's factor by round is its flags' plan). Here a toy method trains both factors in
round 1 and A alone after, B frozen and not uploaded (FFA-LoRA's mirror; B starts at 0,
so A alone would never move), through its plan only: registered for the test, with no
other code, it runs on both engines, uploads what its plan says, and the model is the
average of the clients' models, computed here by hand from what each client held.
"""

import pytest
import torch

from fedexlora.core.methods import REGISTRY, LocalHooks, MethodSpec, RoundPlan
from fedexlora.core.methods.fedex import aggregate as fedex_aggregate


def _train_a(rnd):
    # B starts at 0: A has no gradient until B moves
    return RoundPlan() if rnd == 1 else RoundPlan(train_B=False, upload_B=False)


TRAIN_A = MethodSpec(
    name="toy_train_a",
    title="train-A (test)",
    paper="none: a test of MethodSpec.round_plan",
    trains="A and B in round 1, then A (B frozen)",
    keeps_local="nothing",
    uploads="A_i, B_i in round 1, then A_i",
    downloads="A and B",
    exact=True,
    linear=False,
    bytes_per_round="up 4kr(d+n) (round 1), then 4krn; down 4kr(d+n)",
    aggregate=fedex_aggregate,
    round_plan=_train_a,
)


@pytest.fixture()
def train_a(monkeypatch):
    monkeypatch.setitem(REGISTRY, TRAIN_A.name, TRAIN_A)  # the one registry entry


def test_a_method_that_trains_only_A_runs_exactly_on_both_engines(
    train_a, tiny_cfg, tmp_path, task_identity, seen_updates
):
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for
    from test_flower_parity import _close, _flower

    cfg = tiny_cfg.replace(methods=[TRAIN_A.name], rounds=2, lr=2e-2)
    seen, spy = seen_updates
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, TRAIN_A.name)
    prep = prepare(cfg, tok, task)
    layers = lora_layers(model, "default")
    before = {k: effective_weight(layer) for k, layer in layers.items()}
    scale = {k: float(layer.scaling["default"]) for k, layer in layers.items()}

    state = {}  # round -> the global model's effective weights after it

    def after_round(row, server, mdl):
        state[row["round"]] = {k: effective_weight(layer) for k, layer in layers.items()}

    rows, _, _ = run_method(
        cfg, TRAIN_A.name, prep, model=model, progress=False, local_update=spy,
        after_round=after_round,
    )  # fmt: skip
    assert [r["accepted"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    for rnd in (1, 2):
        ups = [seen[(rnd, c)] for c in range(cfg.num_clients)]
        for start, after, up in ups:  # after round 1, B never moved on a client; A did
            for k, (A, B) in after.factors.items():
                assert torch.equal(B, start.factors[k][1]) == (rnd > 1), (rnd, k)
                assert not torch.equal(A, start.factors[k][0]), (rnd, k)
                assert (up.state.factors[k][1] is None) == (rnd > 1), (rnd, k)  # B not sent
        n = torch.tensor([float(u.num_examples) for _, _, u in ups], dtype=torch.float64)
        p = n / n.sum()
        for k in layers:
            # each client's model: the global one it started from, its adapter moved
            models = [
                before[k]
                + scale[k]
                * (after.factors[k][1].double() @ after.factors[k][0].double()
                   - start.factors[k][1].double() @ start.factors[k][0].double())
                for start, after, _ in ups
            ]  # fmt: skip
            ideal = sum(pi * m for pi, m in zip(p, models))
            update = ideal - before[k]
            gap = float((state[rnd][k] - ideal).norm() / update.norm())
            assert gap <= 1e-5, (rnd, k, gap)
        before = state[rnd]
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, rows)


def _freeze_everything(model, rnd):
    for p in model.model.parameters():  # what a hook must not decide: what trains
        p.requires_grad_(False)
    return LocalHooks()


def test_a_hook_cannot_change_what_the_round_plan_trains(
    monkeypatch, tiny_cfg, tmp_path, task_identity, seen_updates
):
    from dataclasses import replace

    from fedexlora.core.methods import LocalModel
    from fedexlora.run.inprocess import run_experiment

    # Arrange: FedEx-LoRA's plan (A, B and the head train), a hook that freezes them all
    toy = replace(TRAIN_A, name="toy_freezer", round_plan=None, local_round=_freeze_everything)
    monkeypatch.setitem(REGISTRY, toy.name, toy)
    cfg = tiny_cfg.replace(methods=[toy.name], rounds=1, lr=2e-2)
    seen, spy = seen_updates

    # Act
    run_experiment(cfg, tmp_path, progress=False, local_update=spy)

    # Assert: the client step applied the plan after the hook; every part moved
    assert not hasattr(LocalModel, "set_trainable")
    for c in range(cfg.num_clients):
        start, after, up = seen[(1, c)]
        for k, (A, B) in after.factors.items():
            assert not torch.equal(A, start.factors[k][0]), (c, k)
            assert not torch.equal(B, start.factors[k][1]), (c, k)
        assert up.state.extra and all(
            not torch.equal(t, start.extra[k]) for k, t in after.extra.items()
        ), c
