"""DP-SGD's randomness is the client's own (issue 55, items 1 and 2).

Whoever knows the run's seed (the server sends it) must not be able to replay a client's
DP training: its Poisson sampling, its Gaussian noise and, under secure aggregation, its
stochastic rounding come from OS entropy. Reproducible DP is an explicit opt-in
(``dp_reproducible``), named as such. And under DP no client sends its (noiseless)
training loss.
"""

import copy
import math

import numpy as np
import pytest
import torch

pytest.importorskip("opacus")

pytestmark = pytest.mark.slow(seconds=60)


def test_secure_random_draws_uniforms_and_gaussians_of_the_asked_scale():
    from fedexlora.core.entropy import SecureRandom

    rng = SecureRandom()
    u = rng.random(200_000)
    assert u.shape == (200_000,) and u.dtype == np.float64
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.001
    z = rng.normal((400, 500), std=2.0).numpy().ravel()
    assert abs(z.mean()) < 0.02 and z.std() == pytest.approx(2.0, rel=0.01)
    kurtosis = float(((z - z.mean()) ** 4).mean() / z.var() ** 2)
    assert kurtosis == pytest.approx(3.0, abs=0.05)  # Gaussian, not uniform (1.8)
    # a fresh stream per instance: no shared seed
    assert not np.array_equal(SecureRandom().random(8), SecureRandom().random(8))


def test_the_secure_optimizer_adds_noise_of_the_planned_scale():
    """An empty Poisson batch: the step is noise alone, of std sigma C / B (mean loss)."""
    from fedexlora.training.entropy import secure_dp_optimizer

    p = torch.nn.Parameter(torch.zeros(300, 200))
    opt = secure_dp_optimizer(
        torch.optim.SGD([p], lr=1.0), noise_multiplier=1.5, max_grad_norm=0.5,
        expected_batch_size=4, loss_reduction="mean",
    )  # fmt: skip
    p.grad_sample = torch.zeros((0, *p.shape))
    opt.step()
    assert float(p.detach().std()) == pytest.approx(1.5 * 0.5 / 4, rel=0.02)
    assert abs(float(p.detach().mean())) < 2e-3


def _replay(cfg, method="fedex"):
    """One client's upload twice, from the same global model, round and run seed."""
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.client_step import local_update
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.privacy import budget_for

    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, method)
    prep = prepare(cfg, tok, task)
    data = prep.train.subset(prep.parts[0])
    budget = budget_for(cfg, 0, len(data))
    return [
        local_update(cfg, method, copy.deepcopy(model), data, 1, 0, dp=copy.copy(budget))
        for _ in range(2)
    ]


def _same(a, b) -> bool:
    fa, fb = a.state.to_flat(), b.state.to_flat()
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_a_dp_update_cannot_be_replayed_from_the_runs_seed(tiny_cfg):
    """The issue's replay: the project's own ``local_update`` with the run's seed, the
    round and the client id. Before: the replay equalled the upload bit for bit. Now it
    differs everywhere, by the noise; the loss is not sent."""
    cfg = tiny_cfg.replace(dp_epsilon=1.0, dp_delta=1e-3, local_steps=4).validate()
    up, replay = _replay(cfg)
    assert not _same(up, replay)
    flat, again = up.state.to_flat(), replay.state.to_flat()
    for key in flat:  # every trained tensor differs (each got its own noise)
        assert float((flat[key] - again[key]).abs().max()) > 1e-4, key
    assert math.isnan(up.train_loss) and math.isnan(replay.train_loss)


def test_under_the_opt_in_a_dp_update_repeats_bit_for_bit(tiny_cfg):
    cfg = tiny_cfg.replace(dp_epsilon=1.0, dp_delta=1e-3, local_steps=4, dp_reproducible=True)
    up, replay = _replay(cfg.validate())
    assert _same(up, replay)
    assert math.isnan(up.train_loss)  # the opt-in repeats the noise, it still sends no loss


def test_without_dp_the_loss_is_sent(tiny_cfg):
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.client_step import local_update
    from fedexlora.run.restore import load_task_for

    cfg = tiny_cfg.replace(local_steps=1).validate()
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    up = local_update(cfg, "fedex", model, prep.train.subset(prep.parts[0]), 1, 0)
    assert math.isfinite(up.train_loss) and up.train_loss > 0


def test_dp_reproducible_needs_dp(tiny_cfg):
    from fedexlora.config import ConfigError

    with pytest.raises(ConfigError, match="`dp_reproducible` applies only with `dp_epsilon`"):
        tiny_cfg.replace(dp_reproducible=True).validate()
    seeded = tiny_cfg.replace(dp_epsilon=1.0, dp_delta=1e-3, dp_reproducible=True).validate()
    assert "NOT private against anyone who knows the seed" in seeded.to_toml()
    assert "NOT private" not in tiny_cfg.replace(dp_epsilon=1.0, dp_delta=1e-3).to_toml()


def test_on_both_engines_the_noise_is_the_clients_own_and_no_loss_is_sent(
    tiny_cfg, tmp_path, task_identity
):
    """One seed, both engines, by default: their DP rounds differ (with the seed's noise
    they were equal, as under ``dp_reproducible``: see ``test_privacy``'s Flower test),
    no Flower client's reply carries a loss, and the rows say where the noise came from."""
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.rounds import DP_SECURE
    from test_flower import InProcessGrid
    from test_flower_parity import _flower

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=8.0, dp_delta=1e-3, rounds=1,
                           local_steps=2)  # fmt: skip
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app({}), 3)
    flower, _ = _flower(cfg, tmp_path / "flower", grid=grid)
    trains = [r for r in grid.replies if r.has_content() and "metrics" in r.content]
    assert len(trains) == 3 and all("arrays" in r.content for r in trains)
    assert not any("train-loss" in r.content["metrics"] for r in trains)
    for rows in (local, flower):
        assert rows[0]["accepted"] == [0, 1, 2]
        assert rows[0]["train_loss"] is None and rows[0]["privacy"]["randomness"] == DP_SECURE
    assert local[0]["deviation"]["per_layer"] != pytest.approx(
        flower[0]["deviation"]["per_layer"], rel=1e-6
    )
    summary = (tmp_path / "local" / "summary.md").read_text()
    assert "No client sent its training loss" in summary and "OS entropy" in summary
    assert "not sent (DP)" in summary


def test_a_flower_node_refuses_seeded_dp_it_did_not_allow(tiny_cfg, tmp_path, task_identity):
    """``dp_reproducible`` arrives in the run config, the server's word: a node takes
    part with seeded (replayable) noise only where its own node config allows it; one
    that has not refuses when the server first asks for its partition, before any
    training, and the server stops with the node's reason."""
    from fedexlora.flower.client_app import make_client_app
    from test_flower import InProcessGrid
    from test_flower_parity import _flower

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=8.0, dp_delta=1e-3, rounds=1,
                           local_steps=1, dp_reproducible=True)  # fmt: skip
    allowed = [
        {"partition-id": i, "num-partitions": 3, **({"dp-reproducible": "true"} if i else {})}
        for i in range(3)
    ]
    grid = InProcessGrid(make_client_app({}), 3, node_configs=allowed)
    with pytest.raises(ValueError, match="this node has not allowed it"):
        _flower(cfg, tmp_path / "flower", grid=grid)
    assert grid.trained == []  # nobody trained
    for conf in allowed:
        conf["dp-reproducible"] = "true"
    grid = InProcessGrid(make_client_app({}), 3, node_configs=allowed)
    rows, _ = _flower(cfg, tmp_path / "allowed", grid=grid)
    assert rows[0]["accepted"] == [0, 1, 2]
