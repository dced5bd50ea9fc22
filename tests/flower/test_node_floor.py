"""What a Flower client holds to whatever the server says: the run config is the server's
word, so a node's own floor (its ``--node-config``), the DP plan it made itself, and its
figures under secure aggregation are checked on the client."""

import re

import pytest

from test_flower import InProcessGrid
from test_flower_parity import _flower


def _nodes(**floor):
    return [{"partition-id": i, "num-partitions": 3, **floor} for i in range(3)]


@pytest.mark.parametrize(
    ("floor", "run", "message"),
    [
        ({"secure-aggregation": "true"}, {}, "this node requires secure aggregation"),
        (
            {"max-dp-epsilon": "4"},
            {},
            "allows at most dp-epsilon 4 (node config max-dp-epsilon)"
            " and the run asks for no DP-SGD",
        ),
        (
            {"max-dp-epsilon": "4"},
            {"dp_epsilon": 8.0, "dp_delta": 1e-3},
            "the run asks for dp-epsilon = 8",
        ),
        (
            {"max-dp-delta": "1e-4"},
            {"dp_epsilon": 8.0, "dp_delta": 1e-3},
            "allows at most dp-delta 0.0001",
        ),
    ],
)
def test_a_node_refuses_a_run_below_its_own_floor(tiny_cfg, tmp_path, task_identity,
                                                  floor, run, message):  # fmt: skip
    """The server can submit a run without masking or DP, or with a weaker budget; a node
    whose operator set a floor refuses it before anything trains."""
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1, **run)
    grid = InProcessGrid(make_client_app({}), 3, node_configs=_nodes(**floor))
    with pytest.raises(ValueError, match=re.escape(message)):
        _flower(cfg, tmp_path / "run", grid=grid)
    assert grid.trained == []


def test_a_run_at_the_nodes_floor_trains(tiny_cfg, tmp_path, task_identity):
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1, dp_epsilon=4.0,
                           dp_delta=1e-3)  # fmt: skip
    grid = InProcessGrid(
        make_client_app({}),
        3,
        node_configs=_nodes(**{"max-dp-epsilon": "4", "max-dp-delta": "1e-3"}),
    )
    rows, _ = _flower(cfg, tmp_path / "run", grid=grid)
    assert rows[0]["accepted"] == [0, 1, 2]


class _Store:
    def dp_record(self, pid):
        return {}


def test_a_client_takes_back_only_a_dp_plan_it_would_have_made(tiny_cfg):
    """The server sends a client back the plan it last reported (for a client that lost its
    state). A plan with less noise, more steps or another sampling rate would spend more
    than the client's budget: the client refuses it rather than train on the server's word."""
    from fedexlora.flower.client_dp import plan_budget
    from fedexlora.training.privacy import budget_for

    cfg = tiny_cfg.replace(dp_epsilon=8.0, dp_delta=1e-3, rounds=2, local_steps=3)
    own = budget_for(cfg, 0, 40)
    echo = {"dp-noise-multiplier": own.noise_multiplier, "dp-sample-rate": own.sample_rate,
            "dp-planned-steps": own.planned_steps, "dp-steps": 3}  # fmt: skip
    back = plan_budget(cfg, _Store(), echo, 0, 40)
    assert (back.noise_multiplier, back.planned_steps, back.steps) == (
        own.noise_multiplier,
        own.planned_steps,
        3,
    )
    fewer = plan_budget(cfg, _Store(), {**echo, "dp-planned-steps": 2}, 0, 40)
    assert fewer.planned_steps == 2  # spends less: its own budget still holds
    for forged in ({"dp-noise-multiplier": 1e-4}, {"dp-planned-steps": 10**6},
                   {"dp-sample-rate": 1.0}, {"dp-noise-multiplier": float("nan")}):  # fmt: skip
        with pytest.raises(ValueError, match="not one this client would have made"):
            plan_budget(cfg, _Store(), {**echo, **forged}, 0, 40)


def test_under_secure_aggregation_a_clients_dp_refusal_names_none_of_its_figures(
    tiny_cfg, tmp_path, task_identity, monkeypatch
):
    """A client's DP errors name its example count or its sampling rate; under secure
    aggregation the server gets the refusal without them (the node's log keeps them)."""
    from fedexlora.flower import client_dp

    def refuse(cfg, store, conf, pid, n):
        raise ValueError(f"--dp-delta must be below 1 / {n} (this client's examples: {n})")

    monkeypatch.setattr(client_dp, "plan_budget", refuse)
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1, dp_epsilon=8.0,
                           dp_delta=1e-3, secure_aggregation=True)  # fmt: skip
    with pytest.warns(UserWarning, match="this client's examples"):  # on the node only
        with pytest.raises(ValueError) as err:
            _flower(cfg, tmp_path / "run")
    text = str(err.value)
    assert "its reasons stay in its own log" in text and "examples" not in text, text
