"""`fedexlora compare`: paired statistics, reuse only of matching cells, the exactness study."""

import math

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app
from fedexlora.experiments.stats import paired

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=13)

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "300"})


def test_paired_statistics_match_a_hand_computation():
    # differences 0.01, 0.03, 0.02: mean 0.02, sd 0.01, se 0.01/sqrt(3); t(0.975, 2) = 4.3027
    p = paired([0.51, 0.53, 0.52], [0.50, 0.50, 0.50])
    se = 0.01 / math.sqrt(3)
    assert p.n == 3 and p.mean == pytest.approx(0.02)
    assert p.lo == pytest.approx(0.02 - 4.302653 * se, abs=1e-6)
    assert p.hi == pytest.approx(0.02 + 4.302653 * se, abs=1e-6)
    # t = 0.02 / se = 3.4641 with 2 df: two-sided p = 0.07418 (t table)
    assert p.p == pytest.approx(0.07418, abs=2e-4)
    assert (p.ahead, p.tied, p.behind) == (3, 0, 0)
    assert "+0.02 [95% CI -0.00484, +0.0448]" in p.text() and "p=0.074, n=3" in p.text()
    # a lower loss is ahead
    q = paired([1.0, 2.0], [1.5, 1.5], higher_is_better=False)
    assert (q.ahead, q.behind) == (1, 1)
    assert paired([0.5, 0.5], [0.5, 0.5]).p == 1.0
    one = paired([0.6], [0.5])
    assert math.isnan(one.lo) and "n=1: no interval" in one.text()
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired([0.1], [0.1, 0.2])


def _grid(model, task, out, *extra):
    return _run("compare", "--out", str(out), "--model", model, "--task", task,
                "--method", "fedex,fedit", "--ranks", "2", "--seeds", "0",
                "--settings", "iid-2", "--rounds", "1", "--local-steps", "1",
                "--max-length", "16", "--max-test", "20", "--min-partition-size", "5",
                *extra)  # fmt: skip


def test_compare_reuses_only_a_matching_cell(tiny_bert_dir, tiny_csv, tmp_path):
    out = tmp_path / "g"
    cell = out / "iid-2_r2_seed0"
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "1e-5")
    assert res.exit_code == 0, res.output
    first = (cell / "metrics.jsonl").read_text()
    assert "lr 1e-05" in (out / "comparison.md").read_text()

    # same settings: reused
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "1e-5")
    assert res.exit_code == 0 and "(done)" in res.output
    assert (cell / "metrics.jsonl").read_text() == first

    # another learning rate: rerun, with the reason, the old cell kept aside
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "2e-3")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "rerun, its settings changed (lr: 1e-05 → 0.002)" in text
    assert (out / "iid-2_r2_seed0.replaced-1" / "metrics.jsonl").read_text() == first
    assert (cell / "metrics.jsonl").read_text() != first
    md = (out / "comparison.md").read_text()
    assert "lr 0.002" in md and "lr 1e-05" not in md and "reused" not in md

    # more rounds: the finished cell is extended by a resume, not rerun
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "2e-3", "--rounds", "2")
    assert res.exit_code == 0, res.output
    assert "extended from 1 to 2 rounds" in res.output
    assert "rounds = 2" in (cell / "config.toml").read_text()
    rows = (cell / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4 and not (out / "iid-2_r2_seed0.replaced-2").exists()
    # the extended cell's config.toml is as it ran (fedex's side branch resolved): the
    # same grid again reuses it
    assert "fp32_side_branch = true" in (cell / "config.toml").read_text()
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "2e-3", "--rounds", "2")
    assert res.exit_code == 0 and "(done)" in res.output, res.output
    assert (cell / "metrics.jsonl").read_text().splitlines() == rows
    # fewer rounds than the cell ran: rerun
    res = _grid(tiny_bert_dir, tiny_csv, out, "--lr", "2e-3", "--rounds", "1")
    assert res.exit_code == 0 and "rounds: 2 → 1" in " ".join(res.output.split())
    assert (out / "iid-2_r2_seed0.replaced-2").is_dir()


def test_exactness_study_fixed_total_steps(tiny_bert_dir, tiny_csv, tmp_path):
    out, doc = tmp_path / "study", tmp_path / "docs" / "WHEN.md"
    res = _run("compare", "--study", "exactness", "--out", str(out), "--report", str(doc),
               "--model", tiny_bert_dir, "--task", tiny_csv, "--seeds", "0,1",
               "--settings", "iid-2,dir0.5-2", "--local-steps", "1,2", "--total-steps", "2",
               "--max-length", "16", "--max-test", "20", "--min-partition-size", "5",
               "--batch-size", "4")  # fmt: skip
    assert res.exit_code == 0, res.output
    # every cell trains 2 local steps per client in all: 2 rounds of 1, or 1 round of 2
    assert "rounds = 2" in (out / "iid-2_r4_s1_seed0" / "config.toml").read_text()
    assert "rounds = 1" in (out / "dir0.5-2_r4_s2_seed1" / "config.toml").read_text()
    # centralized runs once per client count and seed, not in every cell
    assert (out / "centralized-2_r4_seed1" / "metrics.jsonl").is_file()
    assert '"centralized"' not in (out / "iid-2_r4_s1_seed0" / "metrics.jsonl").read_text()
    text = doc.read_text()
    assert "| iid-2 | 1 × 2 |" in text and "| dir0.5-2 | 2 × 1 |" in text
    assert "fedex − fedit [95% CI]" in text and "paired t-test" in text
    assert "2 local steps per client in all" in text
    assert doc.with_suffix(".png").is_file() and "](WHEN.png)" in text
    assert "## What it shows" in text and "cells" in text
    assert f"Written by `fedexlora compare --study exactness --out {out} --report {doc}" in text


def test_privacy_study_reports_accuracy_against_epsilon(tiny_bert_dir, tiny_csv, tmp_path):
    import json

    out, doc = tmp_path / "grid", tmp_path / "docs" / "PRIV.md"
    res = _run("compare", "--study", "privacy", "--out", str(out), "--report", str(doc),
               "--model", tiny_bert_dir, "--task", tiny_csv, "--seeds", "0,1",
               "--settings", "iid-2", "--dp-epsilons", "2,inf", "--rounds", "1",
               "--local-steps", "2", "--fedsb-rank", "4", "--dp-delta", "1e-3",
               "--max-length", "16", "--max-test", "20", "--min-partition-size", "5",
               "--batch-size", "8")  # fmt: skip
    assert res.exit_code == 0, res.output
    private = out / "iid-2_r8_eps2_seed1"
    rows = [json.loads(x) for x in (private / "metrics.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["fedex", "fedit", "ffa", "fedsb"]
    assert all(0 < r["privacy"]["epsilon"] <= 2.0 for r in rows)
    plain = (out / "iid-2_r8_epsinf_seed0" / "metrics.jsonl").read_text()
    assert '"privacy"' not in plain  # inf: no DP at all
    text = doc.read_text()
    assert "| method | ε=2 | no DP |" in text
    for m in ("fedex", "fedit", "ffa", "fedsb"):
        assert f"| {m} | " in text
    assert "| fedsb − fedex | " in text and "| ffa − fedit | " in text
    assert "Fed-SB ahead of FedEx-LoRA under DP" in text and "over the 1 private" in text
    assert "| largest ε spent | " in text and doc.with_suffix(".png").is_file()
    # each column is its own cells' final accuracy (fedsb is the 4th method), by hand
    import statistics

    def cell(eps):
        finals = [
            [json.loads(x) for x in (out / f"iid-2_r8_eps{eps}_seed{s}" / "metrics.jsonl")
             .read_text().splitlines()][3]["metrics"]["accuracy"]
            for s in (0, 1)
        ]  # fmt: skip
        return f"{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}"

    assert f"| fedsb | {cell(2)} | {cell('inf')} |" in text


@pytest.mark.parametrize(
    "args,match",
    [
        (["--local-steps", "3,4", "--total-steps", "10"],
         "--total-steps 10 must be a multiple of every --local-steps value (not of 3, 4)"),
        (["--study", "bogus"], "--study: unknown study 'bogus'; choose from exactness"),
        (["--local-steps", "2", "--report", "x.md"], "--report writes the study over several"),
        (["--local-steps", "0,2"], "--local-steps must be >= 1"),
        (["--full-test", "--max-test", "5"], "--full-test and --max-test contradict"),
        (["--dp-epsilons", "1,x"], "--dp-epsilons must be a comma list of numbers or inf"),
        (["--dp-epsilons", "0,inf"], "--dp-epsilons must all be > 0"),
        (["--target-fraction", "0"], "--target-fraction must be in (0, 1], got 0.0"),
        (["--stop-patience", "0"], "--stop-patience"),
        (["--local-steps", "5", "--total-steps", "24"],
         "--total-steps 24 must be a multiple of every --local-steps value (not of 5)"),
        (["--seeds", "1,1"], "--seeds lists 1 more than once; list each once"),
        (["--ranks", "2,4,2"], "--ranks lists 2 more than once"),
        (["--settings", "iid-3,dir0.5-3,iid-3"], "--settings lists iid-3 more than once"),
    ],
)  # fmt: skip
def test_compare_study_bad_input(args, match, tmp_path):
    res = _run("compare", "--out", str(tmp_path / "c"), *args)
    assert res.exit_code == 2, res.output
    assert match in " ".join(res.output.split()) and "Traceback" not in res.output
    assert not (tmp_path / "c").exists()


def test_holm_correction_by_hand():
    from fedexlora.experiments.compare_report import _holm

    # 18 tests: thresholds 0.05/18 = 0.00278, then 0.05/17 = 0.00294, ...
    assert _holm([0.0051, 0.0098, 0.009], 18) == 0
    assert _holm([0.001, 0.0029, 0.2], 18) == 2  # 0.001 <= 0.00278, 0.0029 <= 0.00294
    assert _holm([0.001, 0.004], 18) == 1
    assert _holm([], 18) == 0


def test_privacy_report_by_hand():
    """Synthetic cells with known accuracies: each column, difference and verdict by hand."""
    from fedexlora.config import RunConfig
    from fedexlora.experiments.cells import Cell, Setting
    from fedexlora.experiments.privacy_report import privacy_report

    s = Setting("iid-3", 3, "iid")
    acc = {  # (eps, seed) -> method -> final accuracy
        (1.0, 0): {"fedex": 0.30, "fedsb": 0.50}, (1.0, 1): {"fedex": 0.32, "fedsb": 0.56},
        (1.0, 2): {"fedex": 0.34, "fedsb": 0.58},
        (math.inf, 0): {"fedex": 0.90, "fedsb": 0.80},
        (math.inf, 1): {"fedex": 0.92, "fedsb": 0.81},
        (math.inf, 2): {"fedex": 0.94, "fedsb": 0.85},
    }  # fmt: skip
    rows, cfgs = {}, {}
    for (eps, seed), by in acc.items():
        cell = Cell(s, 8, None, seed, epsilon=eps)
        private = {"privacy": {"epsilon": 0.97}} if eps < math.inf else {}
        rows[cell] = [{"method": m, "round": 1, "seconds": 1.0, "metrics": {"accuracy": a},
                       **private} for m, a in by.items()]  # fmt: skip
        cfgs[cell] = RunConfig(methods=["fedex", "fedsb"], seed=seed)
    text = privacy_report(rows, cfgs, "p.png", 60.0, 0)
    assert "| fedex | 0.3200 ± 0.0200 | 0.9200 ± 0.0200 |" in text
    assert "| fedsb | 0.5467 ± 0.0416 | 0.8200 ± 0.0265 |" in text
    assert "| largest ε spent | 0.97 | — |" in text
    # fedsb − fedex by seed: +0.20, +0.24, +0.24 at ε=1: mean +0.227, clearly ahead
    assert "| fedsb − fedex | +0.227 [" in text
    assert "fedsb is ahead in 1, behind in 0, no clear difference in 0" in text
    assert "(3 pairs): fedsb − fedex = +0.2267" in text


def test_the_table_gives_rounds_interval_and_bytes_to_target_by_hand():
    """Two seeds of fedex, fedit and centralized: the target is 0.9 of centralized's mean
    final accuracy (0.9 x 0.8 = 0.72); bytes to target are summed round by round."""
    from fedexlora.config import RunConfig
    from fedexlora.experiments.cells import Cell, Setting
    from fedexlora.experiments.compare_report import comparison_table

    def rows(method, accs, per_round):
        return [{"method": method, "round": i, "metrics": {"accuracy": a}, "seconds": 1.0,
                 "bytes_up": per_round, "bytes_down": per_round, "server_seconds": 0.01,
                 "deviation": {"mean": 0.0}, "effective_deviation": {"max": 0.0, "mean": 1e-8}}
                for i, a in enumerate(accs, 1)]  # fmt: skip

    s = Setting("iid-3", 3, "iid")
    cells = {
        # seed 0: fedex reaches 0.72 in round 2 (2 x 2 x 1000 B), fedit never
        Cell(s, 4, None, 0): rows("fedex", [0.5, 0.75, 0.7], 1000)
        + rows("fedit", [0.5, 0.7], 500)
        + rows("centralized", [0.8], 0),
        # seed 1: fedex in round 1 (2000 B), fedit in round 3 (3 x 2 x 500 B)
        Cell(s, 4, None, 1): rows("fedex", [0.72, 0.7, 0.71], 1000)
        + rows("fedit", [0.6, 0.7, 0.8], 500)
        + rows("centralized", [0.8], 0),
    }
    cfg = RunConfig(methods=["fedex", "fedit", "centralized"], rounds=3, stop_patience=2)
    md = comparison_table(cells, {c: cfg for c in cells}, 1.0)
    # final 0.7 and 0.71: mean 0.705, sd 0.00707; t(0.975, 1) = 12.706
    half = 12.7062 * 0.0070711 / math.sqrt(2)
    ci = f"[{0.705 - half:.4f}, {0.705 + half:.4f}]"
    # fedex: 4 kB (seed 0) and 2 kB (seed 1), mean 3 kB; fedit: 3 kB at seed 1 only
    assert (
        f"| fedex | 0.7050 ± 0.0071 | {ci} | 0.7350 ± 0.0212 | 3 | 6 kB | 2 kB | 3 kB (2/2) |" in md
    )
    assert "| fedit | 0.7500 ± 0.0707 |" in md and "| 2-3 | 2.5 kB |" in md
    assert "| 3 kB (1/2) |" in md  # fedit's: one seed reached it
    assert "Target accuracy: 0.7200 (0.9 of centralized's)" in md
    # per seed, and round by round over the rounds both ran: seed 0 rounds 1-2 (0 and
    # +0.05: mean +0.025), seed 1 rounds 1-3 (+0.12, 0, -0.09: mean +0.01)
    assert "- fedex: seed 0 0.7000 (3), 1e-08; seed 1 0.7100 (3), 1e-08\n" in md
    assert "- fedit: seed 0 0.7000 (2), 1e-08; seed 1 0.8000 (3), 1e-08\n" in md
    assert (
        "- fedex − fedit round by round, over the rounds both ran: seed 0 ahead in 1 of 2, "
        "tied in 1, behind in 0, mean fedex − fedit +0.0250; seed 1 ahead in 1 of 3, tied in "
        "1, behind in 1, mean fedex − fedit +0.0100\n" in md
    )
    assert "Stopping rule: a method stops after 2 rounds without a new best accuracy.\n" in md
    ruled = cfg.replace(stop_min_rounds=3, stop_at=0.95)
    assert (
        "Stopping rule: a method stops after 2 rounds without a new best accuracy, not before "
        "round 3, or once its accuracy reaches 0.95.\n"
    ) in comparison_table(cells, {c: ruled for c in cells}, 1.0)
    # a loss (1 - accuracy here): lower is better, so fedex's lower loss in round 2 of seed
    # 0 is ahead, and its mean difference negative (the line says which way is better)
    lossy = {
        c: [{**r, "metrics": {"loss": 1 - r["metrics"]["accuracy"]}} for r in rs]
        for c, rs in cells.items()
    }
    assert (
        "- fedex − fedit round by round (loss: lower is better), over the rounds both ran: "
        "seed 0 ahead in 1 of 2, tied in 1, behind in 0, mean fedex − fedit -0.0250;"
    ) in comparison_table(lossy, {c: cfg for c in cells}, 1.0)
    md = comparison_table(cells, {c: cfg for c in cells}, 1.0, target=0.9)
    assert "never (0/2)" in md and "Target accuracy: 0.9000;" in md
    assert "Held by each client" not in md  # no side branch in these rows

    # what each client holds: fedex's last rows (seed 0: 1000 + 3000 B; seed 1: 1000 +
    # 5000 B), fedit's (none beside); a row from before adapter_bytes existed (a bf16 run's
    # side_bytes alone) leaves its method out instead of failing the report
    for cell, rs in cells.items():
        side = 3000 if cell.seed == 0 else 5000
        for r in rs:
            if r["method"] == "fedex":
                r.update(side_bytes=side, adapter_bytes=1000)
            elif r["method"] == "fedit":
                r.update(side_bytes=0, adapter_bytes=1000)
    md = comparison_table(cells, {c: cfg for c in cells}, 1.0)
    held = "fedex LoRA factors 1 kB + side branch 4 kB; fedit LoRA factors 1 kB + side branch 0 B."
    assert (
        "- fedex: seed 0 0.7000 (3), 1e-08, side branch 3 kB; seed 1 0.7100 (3), 1e-08, "
        "side branch 5 kB\n" in md
    )
    assert "- fedit: seed 0 0.7000 (2), 1e-08; seed 1" in md  # no side branch: none named
    assert (
        f"Held by each client beside its base after the last round (mean over seeds): {held}" in md
    )
    for r in cells[Cell(s, 4, None, 1)]:
        r.pop("adapter_bytes", None)
    md = comparison_table(cells, {c: cfg for c in cells}, 1.0)
    assert "Held by each client" not in md


def test_a_cell_whose_methods_all_stopped_is_done(tmp_path):
    import json

    from fedexlora.config import RunConfig
    from fedexlora.experiments.compare import _status

    cfg = RunConfig(methods=["fedex", "fedit"], rounds=10, stop_patience=1)
    (tmp_path / "config.toml").write_text(cfg.resolved().to_toml())
    rows = [{"method": m, "round": r, "metrics": {"accuracy": a}}
            for m in ("fedex", "fedit") for r, a in ((1, 0.5), (2, 0.4))]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    assert _status(tmp_path, cfg) == ("resume", "resumed (3 of 20 rows done)")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _status(tmp_path, cfg) == ("done", "")
    # with more patience the same rows are not done: the cell resumes
    assert _status(tmp_path, cfg.replace(stop_patience=3))[0] == "resume"
    # the same rows under a longer warm-up: fedex and fedit stopped at round 2 under the
    # saved rule, and go on under this one, which the status names
    warm = cfg.replace(stop_min_rounds=5)
    assert _status(tmp_path, warm) == (
        "resume",
        "resumed (4 of 20 rows done); its stopping rule changed (stop_min_rounds None → 5)",
    )


def _cell(model, task, out, methods, rounds="1", *more):
    return _run("compare", "--out", str(out), "--model", model, "--task", task,
                "--method", methods, "--ranks", "2", "--seeds", "0", "--settings", "iid-2",
                "--rounds", rounds, "--local-steps", "1", "--max-length", "16",
                "--max-test", "20", "--min-partition-size", "5", "--lr", "2e-3", *more)  # fmt: skip


def _by_method(path):
    import json

    rows = {}
    for line in path.read_text().splitlines():
        rows.setdefault(json.loads(line)["method"], []).append(line)
    return rows


def _results(line):
    """What a row says of the model: its metrics, deviation and bytes (not its seconds)."""
    import json

    r = json.loads(line)
    return (r["round"], r["metrics"], r.get("effective_deviation"), r.get("bytes_up"))


def test_a_cell_gains_a_method_and_keeps_its_rows_without_checkpoints(
    tiny_bert_dir, tiny_csv, tmp_path
):
    from conftest import load_script

    keep = load_script("scripts/keep_cells.py")

    ran = tmp_path / "ran"
    res = _cell(tiny_bert_dir, tiny_csv, ran, "fedex,fedit")
    assert res.exit_code == 0, res.output
    first = _by_method(ran / "iid-2_r2_seed0" / "metrics.jsonl")
    # kept as a study keeps it (config.toml, metrics.jsonl; no checkpoints): still finished
    out, cell = tmp_path / "g", tmp_path / "g" / "iid-2_r2_seed0"
    assert keep.keep_cells(ran, out) == ["iid-2_r2_seed0: kept (2 rows, fedex, fedit)"]
    assert keep.keep_cells(ran, out) == ["iid-2_r2_seed0: already kept"]
    assert not (cell / "checkpoints").exists()
    # a cell whose methods have rounds to go is never kept
    from fedexlora.config import load_run_config

    short = tmp_path / "short" / "iid-2_r2_seed0"
    short.mkdir(parents=True)
    (short / "metrics.jsonl").write_text((ran / "iid-2_r2_seed0" / "metrics.jsonl").read_text())
    saved = load_run_config(ran / "iid-2_r2_seed0" / "config.toml")
    (short / "config.toml").write_text(saved.replace(rounds=3).to_toml())
    assert keep.keep_cells(short.parent, tmp_path / "k") == [
        "iid-2_r2_seed0: unfinished (2 rows), not copied"
    ]
    assert not (tmp_path / "k").exists()
    # ... but of one interrupted in its third method, the two that finished are
    (short / "config.toml").write_text(saved.replace(methods=["fedex", "fedit", "ffa"]).to_toml())
    assert keep.keep_cells(short.parent, tmp_path / "k") == [
        "iid-2_r2_seed0: kept fedex, fedit (2 rows); unfinished, not copied: ffa"
    ]
    part = load_run_config(tmp_path / "k" / "iid-2_r2_seed0" / "config.toml")
    assert part == saved.replace(methods=["fedex", "fedit", "ffa"])  # as it ran, ffa to come
    # a resume that gained fedit was stopped in a later method: config.toml still names
    # fedex alone, as it does until the cell has run them all; fedit's rows are kept too
    (short / "config.toml").write_text(saved.replace(methods=["fedex"]).to_toml())
    whole = (short / "metrics.jsonl").read_text()
    (short / "metrics.jsonl").write_text(whole + '{"method": "ffa", "round": 1, "metr')  # torn
    assert keep.keep_cells(short.parent, tmp_path / "gained") == [
        "iid-2_r2_seed0: kept fedex, fedit (2 rows)"
    ]
    assert load_run_config(tmp_path / "gained" / "iid-2_r2_seed0" / "config.toml") == saved
    # judged by the grid's rule instead of config.toml's (which a resume rewrites last):
    # one round of 3 is unfinished, whatever the cell's own file says
    assert keep.keep_cells(short.parent, tmp_path / "ruled", {"rounds": 3}) == [
        "iid-2_r2_seed0: unfinished (2 rows), not copied"
    ]
    assert keep.main([str(short.parent), str(tmp_path / "ruled"), "--study", "convergence"]) == 0
    assert not (tmp_path / "ruled").exists()  # 30 rounds, patience from round 10: unfinished
    assert keep.main([str(short.parent), str(tmp_path / "ruled"), "--study", "nope"]) == 2
    # of a cell where only FedIT finished, beside FedEx-LoRA's fp32_side_branch (resolved
    # on for fedex): the kept config.toml loads (one naming fedit alone would not), and
    # the next compare runs fedex from its first round, to the rows of the whole run
    (short / "metrics.jsonl").write_text("\n".join(first["fedit"]) + "\n")
    (short / "config.toml").write_text(saved.to_toml())
    assert saved.fp32_side_branch and saved.methods == ["fedex", "fedit"]
    assert keep.keep_cells(short.parent, tmp_path / "plain") == [
        "iid-2_r2_seed0: kept fedit (1 rows); unfinished, not copied: fedex"
    ]
    assert load_run_config(tmp_path / "plain" / "iid-2_r2_seed0" / "config.toml") == saved
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path / "plain", "fedex,fedit")
    assert res.exit_code == 0 and "fedit finished before (1 rounds)" in res.output, res.output
    again = _by_method(tmp_path / "plain" / "iid-2_r2_seed0" / "metrics.jsonl")
    assert {m: [_results(x) for x in xs] for m, xs in again.items()} == {
        m: [_results(x) for x in xs] for m, xs in first.items()
    }
    # a cell with more rows, but not of every method kept, replaces nothing: fedit's
    # three rounds beside a kept cell that holds fedex's rows too
    import json

    three = [{**json.loads(first["fedit"][0]), "round": r} for r in (1, 2, 3)]
    (short / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in three))
    (short / "config.toml").write_text(saved.replace(rounds=3).to_toml())
    plain_rows = (tmp_path / "plain" / "iid-2_r2_seed0" / "metrics.jsonl").read_text()
    assert keep.keep_cells(short.parent, tmp_path / "plain") == [
        "iid-2_r2_seed0: not copied, the kept one holds rows of fedex, which this one has "
        "not finished"
    ]
    assert (tmp_path / "plain" / "iid-2_r2_seed0" / "metrics.jsonl").read_text() == plain_rows
    (short / "metrics.jsonl").write_text(whole)
    # a longer cell of other settings never replaces a kept one
    import json

    two = [json.loads(x) for x in (short / "metrics.jsonl").read_text().splitlines()]
    two += [{**r, "round": 2} for r in two]
    (short / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in two))
    (short / "config.toml").write_text(saved.replace(rounds=2, lr=0.1).to_toml())
    assert keep.keep_cells(short.parent, out) == [
        "iid-2_r2_seed0: not copied, the kept one ran otherwise: lr: 0.002 → 0.1"
    ]
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedex,fedit")
    assert res.exit_code == 0 and "(done)" in res.output, res.output
    # --report-only: the report of finished cells, or the unfinished ones named, no training
    (out / "comparison.md").unlink()
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedex,fedit", "1", "--report-only")
    assert res.exit_code == 0 and "| fedit |" in (out / "comparison.md").read_text(), res.output
    # it reads rows alone: a grid trained on a GPU is reported on a machine without one
    res = _cell(
        tiny_bert_dir, tiny_csv, out, "fedex,fedit", "1", "--report-only", "--device", "cuda"
    )
    assert res.exit_code == 0, res.output
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedex,fedit,ffa", "1", "--report-only")
    said = " ".join(res.output.split())
    assert res.exit_code != 0 and "1 of 1 cells" in said and "iid-2_r2_seed0 (gains ffa)" in said
    assert (
        _by_method(cell / "metrics.jsonl") == first
        and "ffa" not in (out / "comparison.md").read_text()
    )
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path / "none", "fedex", "1", "--report-only")
    assert res.exit_code != 0 and "iid-2_r2_seed0 (new)" in res.output, res.output
    assert not (tmp_path / "none").exists()

    # a method more: only it runs; the others' rows are kept as they were
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedex,fedit,ffa")
    assert res.exit_code == 0 and "gains ffa" in res.output, res.output
    rows = _by_method(cell / "metrics.jsonl")
    assert rows["fedex"] == first["fedex"] and rows["fedit"] == first["fedit"]
    assert len(rows["ffa"]) == 1 and not list(out.glob("*.replaced-*"))
    assert "ffa" in (cell / "config.toml").read_text()
    # a grid of fewer methods reads its own from the larger cell
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedex,ffa")
    assert res.exit_code == 0 and "(done)" in res.output, res.output
    md = (out / "comparison.md").read_text()
    assert "| ffa |" in md and "| fedex |" in md and "| fedit |" not in md
    # and fedit alone, though it resolves the fp32 side branch off (no method keeps a
    # residual), reads fedit's rows, which do not depend on it (the test below)
    res = _cell(tiny_bert_dir, tiny_csv, out, "fedit")
    assert res.exit_code == 0 and "(done)" in res.output, res.output
    assert not list(out.glob("*.replaced-*"))
    rows = _by_method(cell / "metrics.jsonl")

    # a method's rows do not depend on the others beside it: ffa alone gives the same
    alone = tmp_path / "alone"
    res = _cell(tiny_bert_dir, tiny_csv, alone, "ffa")
    assert res.exit_code == 0, res.output
    ffa = _by_method(alone / "iid-2_r2_seed0" / "metrics.jsonl")["ffa"]
    assert [_results(x) for x in ffa] == [_results(x) for x in rows["ffa"]]
    # ... and its checkpoint resumes under another list of methods (more rounds, fedex too)
    res = _cell(tiny_bert_dir, tiny_csv, alone, "fedex,ffa", rounds="2")
    assert res.exit_code == 0, res.output
    assert "gains fedex; extended from 1 to 2 rounds" in " ".join(res.output.split())
    assert "resuming ffa after round 1" in res.output
    grown = _by_method(alone / "iid-2_r2_seed0" / "metrics.jsonl")
    assert _results(grown["ffa"][0]) == _results(ffa[0])
    assert len(grown["ffa"]) == 2 and len(grown["fedex"]) == 2
    # a grid of one of them, a round more: only it runs; the other's rows are kept
    res = _cell(tiny_bert_dir, tiny_csv, alone, "ffa", rounds="3")
    assert res.exit_code == 0 and "extended from 2 to 3 rounds" in res.output, res.output
    assert "fedex finished before" not in res.output  # not even looked at
    more = _by_method(alone / "iid-2_r2_seed0" / "metrics.jsonl")
    assert more["fedex"] == grown["fedex"] and len(more["ffa"]) == 3
    assert load_run_config(alone / "iid-2_r2_seed0" / "config.toml").methods == ["ffa", "fedex"]


def test_the_metric_the_rule_reads_has_its_own_columns():
    """The LLM study compares exact match and stops on the held-out loss: the table gives
    each method's final and best loss beside it (mean ± std over seeds), by hand."""
    from fedexlora.config import RunConfig
    from fedexlora.experiments.cells import Cell, Setting
    from fedexlora.experiments.compare_report import comparison_table

    def rows(method, pairs):
        return [{"method": method, "round": i, "metrics": {"exact_match": em, "loss": loss},
                 "seconds": 1.0, "bytes_up": 10, "bytes_down": 10, "server_seconds": 0.01,
                 "deviation": {"mean": 0.0}, "effective_deviation": {"max": 0.0, "mean": 0.0}}
                for i, (em, loss) in enumerate(pairs, 1)]  # fmt: skip

    s = Setting("group-4", 4, "group")
    cells = {
        Cell(s, 8, None, 0): rows("fedex", [(0.1, 1.4), (0.2, 1.2), (0.15, 1.3)]),
        Cell(s, 8, None, 1): rows("fedex", [(0.2, 1.5), (0.3, 1.1)]),
    }
    cfg = RunConfig(methods=["fedex"], rounds=3, stop_patience=1, stop_metric="loss")
    md = comparison_table(cells, {c: cfg for c in cells}, 1.0)
    head = "| method | final exact_match | 95% CI | best exact_match | final loss | best loss |"
    assert head in md
    # final loss 1.3 and 1.1: 1.2 ± 0.1414; best (lowest) 1.2 and 1.1: 1.15 ± 0.0707
    assert (
        "| 0.2500 ± 0.0707 | 1.2000 ± 0.1414 | 1.1500 ± 0.0707 | 2-3 |" in md
    )  # best EM: 0.2, 0.3
    # ruled by the compared metric itself: no more columns
    plain = comparison_table(cells, {c: cfg.replace(stop_metric=None) for c in cells}, 1.0)
    assert "final loss" not in plain and "| best exact_match | rounds |" in plain


def test_a_grid_of_fedit_alone_reads_and_extends_a_cell_run_beside_fedex(
    tiny_bert_dir, tiny_csv, tmp_path
):
    """FedIT's rows do not depend on the side branch's settings, which fedex resolved on:
    a grid of FedIT alone reuses the cell (not moved aside and rerun) and extends it."""
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path, "fedex,fedit")
    assert res.exit_code == 0, res.output
    cell = tmp_path / "iid-2_r2_seed0"
    assert "fp32_side_branch = true" in (cell / "config.toml").read_text()
    before = _by_method(cell / "metrics.jsonl")
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path, "fedit", "1", "--report-only")
    assert res.exit_code == 0 and "(done)" in res.output, res.output
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path, "fedit", "2")
    assert res.exit_code == 0 and "extended from 1 to 2 rounds" in res.output, res.output
    after = _by_method(cell / "metrics.jsonl")
    assert after["fedex"] == before["fedex"]  # the rows kept; fedit's round 1 as it was
    assert _results(after["fedit"][0]) == _results(before["fedit"][0])
    assert len(after["fedit"]) == 2
    assert [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []
    # ... and they are the rows a grid of FedIT alone gives (side branch resolved off)
    res = _cell(tiny_bert_dir, tiny_csv, tmp_path / "alone", "fedit", "2")
    assert res.exit_code == 0, res.output
    alone = _by_method(tmp_path / "alone" / "iid-2_r2_seed0" / "metrics.jsonl")
    assert (
        "fp32_side_branch = false"
        in (tmp_path / "alone" / "iid-2_r2_seed0" / "config.toml").read_text()
    )
    assert [_results(x) for x in alone["fedit"]] == [_results(x) for x in after["fedit"]]


def test_the_side_branch_setting_a_grid_of_fedit_alone_leaves_unset_is_not_a_change():
    from fedexlora.config import RunConfig
    from fedexlora.experiments.compare import cell_changes

    beside = RunConfig(methods=["fedex", "fedit"]).resolved().to_dict()  # side branch on
    alone = RunConfig(methods=["fedit"]).resolved().to_dict()  # off
    assert beside["fp32_side_branch"] is True and alone["fp32_side_branch"] is False
    assert cell_changes(beside, RunConfig(methods=["fedit"])) == []
    # set by the grid, it is compared; and fedex beside fedit needs the cell to have run so
    explicit = RunConfig(methods=["fedit"], fp32_side_branch=False)
    assert cell_changes(beside, explicit) == ["fp32_side_branch: True → False"]
    assert cell_changes(alone, RunConfig(methods=["fedex", "fedit"])) == [
        "fp32_side_branch: False → True"
    ]


def test_a_single_local_steps_value_divides_the_total_steps_into_rounds(tiny_bert_dir, tiny_csv):
    """One --local-steps value with --total-steps: the rounds are their quotient (it used
    to fail with "not of None" whatever the values)."""
    from fedexlora.config import RunConfig
    from fedexlora.experiments.cells import Setting
    from fedexlora.experiments.compare import _plan

    base = RunConfig(model=str(tiny_bert_dir), task=str(tiny_csv), methods=["fedex"],
                     local_steps=12, min_partition_size=5)  # fmt: skip
    plan = _plan(base, [Setting("iid-3", 3, "iid")], [4], [0], None, 24)
    assert [(c.steps, cfg.local_steps, cfg.rounds) for c, cfg in plan] == [(None, 12, 2)]
