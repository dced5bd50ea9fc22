"""DP-SGD under secure aggregation (#47): each client keeps its accounting to itself.

A client's sampling rate ``batch / n`` tells its example count, which secure aggregation
hides; so no reply the server receives and no row it writes holds a client's figures,
and each client's budget still holds across a resume and a lost state.
"""

import json

import pytest

pytest.importorskip("flwr")
pytest.importorskip("opacus")

from conftest import crash_then_resume, without_timings  # noqa: E402

pytestmark = pytest.mark.slow(seconds=60)

_FIGURES = ("sample_rate", "noise_multiplier", "planned_steps", "dp-sample-rate", "dp-epsilon")


def _dp_secure(tiny_cfg, **kw):
    return tiny_cfg.replace(
        methods=["fedex"], secure_aggregation=True, dp_epsilon=4.0, dp_delta=1e-3,
        local_steps=1, lr=2e-2, **kw,
    )  # fmt: skip


def _rounding_seeds(monkeypatch) -> list:
    """The ``seed`` of every client's stochastic rounding (``client_reply``), as called."""
    import fedexlora.secagg.rounds as secagg_rounds

    seeds, real = [], secagg_rounds.client_reply

    def spy(*args, **kwargs):
        seeds.append(kwargs["seed"])
        return real(*args, **kwargs)

    monkeypatch.setattr(secagg_rounds, "client_reply", spy)
    return seeds


def test_in_process_under_dp_the_rounding_is_the_clients_own(tiny_cfg, tmp_path, monkeypatch):
    """By default each client's stochastic rounding is drawn from OS entropy (no seed a
    server knows), and the secure rows carry no loss (none went into the sum)."""
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.rounds import DP_SECURE

    seeds = _rounding_seeds(monkeypatch)
    rows = run_experiment(_dp_secure(tiny_cfg, rounds=1), tmp_path, progress=False)
    assert seeds == [None, None, None]
    assert rows[0]["accepted"] == [0, 1, 2] and rows[0]["train_loss"] is None
    assert rows[0]["privacy"]["randomness"] == DP_SECURE


def test_in_process_rows_hold_no_clients_figures_and_a_resume_keeps_the_budget(
    tiny_cfg, tmp_path, monkeypatch
):
    """Two rounds planned, run straight and crashed in round 2 then resumed: the same
    rows, none naming a client's figures; resumed to three, every client refuses (its
    own checkpointed record says its budget is spent)."""
    from fedexlora.run.inprocess import run_experiment

    # seeded DP (the opt-in), so that the resumed run can equal the straight one
    cfg = _dp_secure(tiny_cfg, rounds=2, dp_reproducible=True)
    seeds = _rounding_seeds(monkeypatch)
    straight = run_experiment(cfg, tmp_path / "straight", progress=False)
    assert seeds and all(s == cfg.seed for s in seeds)  # the opt-in seeds the rounding too
    text = (tmp_path / "straight" / "metrics.jsonl").read_text()
    assert not any(f in text for f in _FIGURES)
    for row in straight:
        p = row["privacy"]
        assert p["kept_by_clients"] and p["clients"] == {} and p["epsilon"] is None
        assert row["accepted"] == [0, 1, 2]
    assert "kept its accounting to itself" in (tmp_path / "straight" / "summary.md").read_text()

    resumed = crash_then_resume(cfg, tmp_path / "resumed", crash_round=2)
    assert [without_timings(r) for r in resumed] == [without_timings(r) for r in straight]

    longer = run_experiment(cfg.replace(rounds=3), tmp_path / "resumed", resume=True,
                            progress=False)  # fmt: skip
    assert longer[-1]["round"] == 3
    assert longer[-1]["privacy"]["refused"] == [0, 1, 2] and longer[-1]["accepted"] == []


def test_under_flower_no_reply_names_a_clients_figures_and_a_lost_record_refuses(
    tiny_cfg, tmp_path, task_identity, monkeypatch
):
    """Every reply the server receives is recorded: none carries a DP figure. Resumed
    with every client's Context lost (a new federation), a client that trained cannot
    be sent its figures back (the server has none): it refuses rather than start over."""
    from fedexlora.flower.client_app import make_client_app
    from test_flower import InProcessGrid
    from test_flower_parity import _flower

    cfg = _dp_secure(tiny_cfg, rounds=2)
    run = tmp_path / "run"
    grid = InProcessGrid(make_client_app({}), 3)
    seeds = _rounding_seeds(monkeypatch)
    first, _ = _flower(cfg, run, grid=grid)
    assert seeds == [None] * 6  # each client's rounding from OS entropy, both rounds
    assert all(r["train_loss"] is None for r in first)
    assert [r["accepted"] for r in first] == [[0, 1, 2], [0, 1, 2]]
    trains = [r for r in grid.replies if r.has_content() and "metrics" in r.content]
    assert trains
    for r in trains:
        assert not any(str(k).startswith("dp-") for k in r.content["metrics"]), r.content
    text = (run / "metrics.jsonl").read_text()
    assert not any(f in text for f in _FIGURES)
    assert all(json.loads(line)["privacy"]["kept_by_clients"] for line in text.splitlines())

    longer = cfg.replace(rounds=3)  # within its plan a client would train again
    (run / "config.toml").write_text(longer.to_toml())
    with pytest.warns(UserWarning, match="lost its DP-SGD record"):
        rows, _ = _flower(longer, run, grid=InProcessGrid(make_client_app({}), 3), resume=str(run))
    assert rows[-1]["round"] == 3 and rows[-1]["privacy"]["refused"] == [0, 1, 2]
    assert rows[-1]["accepted"] == []
