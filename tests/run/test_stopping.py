"""The study's stopping rule: a method stops when it stops improving, or reaches a value."""

import pytest

from fedexlora.config import RunConfig
from fedexlora.run.stopping import cell_done, method_done, stop_reason, until_stop


def _rows(method, values, metric="accuracy"):
    return [{"method": method, "round": i, "metrics": {metric: v}} for i, v in enumerate(values, 1)]


def test_patience_counts_rounds_since_the_first_best():
    cfg = RunConfig(rounds=30, stop_patience=2)
    assert stop_reason(cfg, _rows("fedex", [0.5, 0.6, 0.6])) is None  # a tie is no better
    why = stop_reason(cfg, _rows("fedex", [0.5, 0.6, 0.6, 0.59]))
    assert why == "accuracy not better than round 2's 0.6 for 2 rounds (stop_patience 2)"
    assert stop_reason(cfg, _rows("fedex", [0.5, 0.6, 0.55, 0.61])) is None  # a new best
    # lower is better for a loss: the falling loss goes on, the rising one stops
    assert stop_reason(cfg, _rows("fedex", [2.0, 1.5, 1.4], "loss")) is None
    assert "round 1's 2" in stop_reason(cfg, _rows("fedex", [2.0, 2.1, 2.2], "loss"))


def test_no_method_stops_before_the_min_rounds_and_the_best_counts_from_round_1():
    """FFA-LoRA on Dirichlet(0.5)-3, seed 2, round by round (studies/convergence): the
    accuracy wandered while its training loss fell, and patience 3 alone stopped it after
    round 5 at 0.36. With ``stop_min_rounds`` 10 it goes on to round 10; from there the
    rule reads every round's value, round 2's best included."""
    wandered = [0.2472, 0.3888, 0.3528, 0.3371, 0.3596]
    cfg = RunConfig(rounds=30, stop_patience=3)
    assert "round 2's 0.3888 for 3 rounds" in stop_reason(cfg, _rows("ffa", wandered))
    warm = cfg.replace(stop_min_rounds=10)
    for n in range(5, 10):
        rows = _rows("ffa", wandered + [0.3] * (n - 5))
        assert stop_reason(warm, rows) is None and not method_done(warm, rows)
    ten = _rows("ffa", wandered + [0.3] * 5)
    assert stop_reason(warm, ten) == (
        "accuracy not better than round 2's 0.3888 for 8 rounds (stop_patience 3)"
    )
    # a method that learns in the warm-up is read as before once it is over
    assert stop_reason(warm, _rows("ffa", wandered + [0.5, 0.9, 0.8, 0.8, 0.8])) == (
        "accuracy not better than round 7's 0.9 for 3 rounds (stop_patience 3)"
    )
    assert stop_reason(warm.replace(stop_at=0.38), _rows("ffa", wandered[:2])) is not None
    # the rows a run made without it are not cut by it before round 10
    assert until_stop(warm.replace(methods=["ffa"]), ten) == ten


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (dict(stop_min_rounds=5), "delays --stop-patience, which is off"),
        (dict(stop_min_rounds=0, stop_patience=3), "stop_min_rounds"),
    ],
)
def test_bad_min_rounds_are_named(settings, said):
    errs = RunConfig(**settings).errors()
    assert any(said in e for e in errs), errs


def test_a_warm_up_past_the_last_round_is_a_short_run_of_a_study():
    """``compare --study llm --rounds 1`` (a quick look at a preset): the warm-up of 10
    outlasts the budget, and the run simply ends at its last round."""
    cfg = RunConfig(rounds=1, stop_patience=3, stop_min_rounds=10)
    assert cfg.errors() == []
    assert method_done(cfg, _rows("fedex", [0.1])) and stop_reason(cfg, _rows("f", [0.1])) is None


def test_stop_at_and_no_rule():
    cfg = RunConfig(rounds=30, stop_at=0.8)
    assert stop_reason(cfg, _rows("fedex", [0.5, 0.79])) is None
    assert stop_reason(cfg, _rows("fedex", [0.5, 0.8])) == (
        "accuracy 0.8 reached stop_at 0.8 in round 2"
    )
    assert stop_reason(RunConfig(rounds=30), _rows("fedex", [0.5] * 20)) is None  # no rule
    assert stop_reason(cfg, []) is None


def test_a_cell_is_done_when_every_method_ran_all_rounds_or_stopped():
    cfg = RunConfig(methods=["fedex", "fedit"], rounds=4, stop_patience=1)
    fedex = _rows("fedex", [0.5, 0.4])  # stopped after round 2
    fedit = _rows("fedit", [0.5, 0.6, 0.7])  # still improving, one round to go
    assert method_done(cfg, fedex) and not method_done(cfg, fedit)
    assert not cell_done(cfg, fedex + fedit)
    assert cell_done(cfg, fedex + _rows("fedit", [0.5, 0.6, 0.7, 0.8]))
    assert not cell_done(cfg, fedex)  # fedit has not started


def test_until_stop_cuts_a_run_made_without_the_rule_where_the_rule_stops():
    rows = _rows("fedex", [0.5, 0.4, 0.45, 0.9]) + _rows("fedit", [0.1, 0.2, 0.3, 0.4])
    kept = until_stop(RunConfig(methods=["fedex", "fedit"], rounds=4, stop_patience=2), rows)
    assert [(r["method"], r["round"]) for r in kept] == [
        ("fedex", 1), ("fedex", 2), ("fedex", 3),
        ("fedit", 1), ("fedit", 2), ("fedit", 3), ("fedit", 4),
    ]  # fmt: skip
    assert until_stop(RunConfig(methods=["fedex", "fedit"], rounds=4), rows) == rows


def test_a_run_stops_each_method_by_the_rule_and_a_resume_runs_no_more(tiny_cfg, tmp_path, capsys):
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.report import read_metrics

    # accuracy is >= 0 after any round: each method stops after its first of 5
    cfg = tiny_cfg.replace(methods=["fedex", "fedit"], rounds=5, stop_at=0.0)
    rows = run_experiment(cfg, tmp_path, progress=False)
    assert [(r["method"], r["round"]) for r in rows] == [("fedex", 1), ("fedit", 1)]
    out = capsys.readouterr().out
    assert "fedex: stopped after round 1: accuracy" in out, out
    again = run_experiment(cfg, tmp_path, resume=True, progress=False)  # nothing more to do
    assert [(r["method"], r["round"]) for r in again] == [("fedex", 1), ("fedit", 1)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    # a resume without the rule (stop_at is resume-safe, like rounds) goes on to round 5
    more = run_experiment(cfg.replace(stop_at=None), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in more if r["method"] == "fedex"] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(("field", "value"), [("stop_patience", 0), ("stop_at", "x")])
def test_bad_stopping_values_are_named(field, value):
    errs = RunConfig(**{field: value}).errors()
    assert any(field in e for e in errs), errs


def test_the_rule_reads_the_stop_metric_when_one_is_given():
    """A noisy primary metric (exact match) against the loss beside it: with
    ``stop_metric="loss"`` the falling loss goes on where exact match would have stopped."""
    rows = [
        {"method": "fedex", "round": i, "metrics": {"exact_match": em, "loss": loss}}
        for i, (em, loss) in enumerate([(0.2, 1.4), (0.3, 1.3), (0.2, 1.2), (0.25, 1.1)], 1)
    ]
    primary = RunConfig(rounds=30, stop_patience=2)
    assert "exact_match not better than round 2's 0.3" in stop_reason(primary, rows)
    by_loss = primary.replace(stop_metric="loss")
    assert stop_reason(by_loss, rows) is None and not method_done(by_loss, rows)
    assert "loss not better than round 2's 1.3" in stop_reason(
        by_loss, [*rows[:2], *({**r, "metrics": {"loss": 1.35}} for r in rows[2:])]
    )
    assert until_stop(by_loss, rows) == rows


def test_a_stop_metric_the_task_lacks_is_refused_before_anything_is_written(
    tiny_cfg, tmp_path, model_never_loads
):
    from fedexlora.run.layout import RunError
    from fedexlora.run.preflight import check_inputs

    with pytest.raises(RunError, match="--stop-metric 'exact_match' is not a metric of task"):
        check_inputs(tiny_cfg.replace(stop_metric="exact_match"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    check_inputs(tiny_cfg.replace(stop_metric="f1_macro"), tmp_path / "out")  # the task's own
