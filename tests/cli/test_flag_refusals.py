"""Flags that would do nothing, or the wrong thing, refused before the model loads.

Every test here holds :func:`conftest.model_never_loads` (but the side-budget one, which
needs the model's layers): under a bug that lets the input through, it fails at the
model's load, in seconds, not after a whole run.
"""

import json

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app
from fedexlora.config import RunConfig

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _flat(res) -> str:
    return "".join(res.output.split())


def _clear(res, *needles):
    """A one-line error (exit 2) that says each of ``needles``, and no traceback."""
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    for needle in needles:
        assert "".join(needle.split()) in _flat(res), res.output


def _tiny(model, task, out, *extra):
    return _run("run", "--model", model, "--task", task, "--min-partition-size", "5",
                "--rounds", "1", "--local-steps", "1", "--max-test", "8", "--max-length", "16",
                "--out", out, "--no-progress", *extra)  # fmt: skip


@pytest.mark.parametrize(
    "extra,why",
    [
        (["--lr", "inf"], "`--lr` must be a finite number, got inf"),
        (["--lr", "nan"], "`--lr` must be a finite number, got nan"),
        (["--weight-decay", "inf"], "`--weight-decay` must be a finite number, got inf"),
        (["--max-update-norm", "nan"], "`--max-update-norm` must be a finite number"),
        (["--dp-epsilon", "inf"], "`--dp-epsilon` must be a finite number, got inf; fix"),
        (["--dtype", "bf16", "--side-budget", "inf"],
         "`--side-budget` must be a finite number, got inf; fix: --side-budget 0.5"),
        (["--method", "fedit", "--dtype", "bf16", "--side-budget", "0.5"],
         "`--side-budget` bounds or holds the residuals kept beside the base, and methods "
         "['fedit'] keep none"),
        (["--method", "fedit", "--dtype", "bf16", "--side-rank", "4"],
         "`--side-rank` bounds or holds the residuals kept beside the base, and methods "
         "['fedit'] keep none"),
        (["--method", "fedit", "--fp32-side-branch"],
         "`--fp32-side-branch` bounds or holds the residuals kept beside the base, and "
         "methods ['fedit'] keep none"),
        (["--dtype", "bf16", "--no-fp32-side-branch"],
         "--no-fp32-side-branch applies to an fp32 base; a bf16/fp16 or quantized base "
         "always keeps its residuals in an fp32 side branch (--dtype bf16); fix: drop "
         "--no-fp32-side-branch"),
        (["--dtype", "fp16", "--fp32-side-branch"],
         "--fp32-side-branch applies to an fp32 base"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)  # fmt: skip
def test_a_flag_that_would_do_nothing_is_refused(
    extra, why, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "o"
    _clear(_tiny(tiny_bert_dir, tiny_csv, out, *extra), why)
    assert not out.exists()


def test_fedit_side_rank_does_not_suggest_the_flag_that_does_nothing(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    res = _tiny(tiny_bert_dir, tiny_csv, tmp_path / "o", "--method", "fedit", "--side-rank", "4")
    _clear(res, "keep none", "fix: drop --side-rank")
    assert "--fp32-side-branch" not in res.output


def test_fedit_beside_an_exact_method_keeps_the_side_branch(tiny_cfg):
    """Not refused: fedex holds residuals, so the side modes and the flag mean something."""
    cfg = tiny_cfg.replace(methods=["fedex", "fedit"], dtype="bf16", side_budget=0.5)
    assert cfg.errors() == []
    assert tiny_cfg.replace(methods=["fedex", "fedit"], fp32_side_branch=True).errors() == []


def test_a_config_file_that_sets_the_methods_twice_is_refused(tmp_path, model_never_loads):
    cfg = tmp_path / "c.toml"
    cfg.write_text('method = "fedex"\nmethods = ["fedit"]\n')
    why = "`method` and `methods` are the same setting, given twice; keep one"
    for res in (_run("validate", cfg), _run("run", "--config", cfg, "--out", tmp_path / "o")):
        _clear(res, why)
    assert not (tmp_path / "o").exists()


def test_a_flag_still_overrides_a_files_method(tmp_path):
    from fedexlora.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('method = "fedex"\n')
    assert load_config(cfg, {"methods": ["fedit"]}).methods == ["fedit"]


def _a_run_of_two_rounds(out, tiny_bert_dir, tiny_csv):
    """A run directory as two finished rounds leave it (its config and its rows)."""
    cfg = RunConfig(model=tiny_bert_dir, task=tiny_csv, rounds=2, min_partition_size=5)
    out.mkdir()
    (out / "config.toml").write_text(cfg.validate().resolved().to_toml())
    rows = [{"method": "fedex", "round": r, "metrics": {"accuracy": 0.5}} for r in (1, 2)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_a_resume_that_would_cut_the_run_back_is_refused(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "run"
    rows = _a_run_of_two_rounds(out, tiny_bert_dir, tiny_csv)
    res = _run("run", "--resume", out, "--rounds", "1", "--no-progress")
    _clear(res, f"--rounds 1: the run in {str(out)!r} has already trained 2 rounds",
           "fix: --rounds 3 or more")  # fmt: skip
    assert [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] == rows


def test_an_out_that_holds_a_run_is_refused_before_the_model_loads(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "run"
    _a_run_of_two_rounds(out, tiny_bert_dir, tiny_csv)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _tiny(tiny_bert_dir, tiny_csv, out)
    _clear(res, f"--out {str(out)!r} already holds a run; pass --resume to continue it")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_compare_into_a_runs_directory_is_refused_without_a_resume_hint(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "run"
    _a_run_of_two_rounds(out, tiny_bert_dir, tiny_csv)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _run("compare", "--out", out, "--model", tiny_bert_dir, "--task", tiny_csv)
    _clear(res, f"--out {str(out)!r} holds a run of `fedexlora run`, not a compare grid")
    assert "--resume" not in res.output  # compare has no --resume
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_out_that_is_a_file_is_refused_before_the_model_loads(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "a-file"
    out.write_text("mine\n")
    _clear(_tiny(tiny_bert_dir, tiny_csv, out), f"--out {str(out)!r} is a file, not a directory")
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--max-length", "100000"], ["--max-length 100000 exceeds the 128 positions model",
                                      "(max_position_embeddings); use --max-length 128 or less"]),
        # the split leaves too few rows: named, not the client count
        (["--test-fraction", "0.99"],
         ["has 2 training rows left after its test split (--test-fraction 0.99)",
          "fewer than --num-clients 3; fix: a lower --test-fraction"]),
    ],
)  # fmt: skip
def test_a_setting_the_task_or_model_cannot_take_is_refused_before_the_model_loads(
    flags, said, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "o"
    _clear(_tiny(tiny_bert_dir, tiny_csv, out, *flags), *said)
    assert not out.exists()


def test_a_side_budget_below_one_rank_is_refused_and_leaves_nothing(
    tmp_path, tiny_bert_dir, tiny_csv
):
    # tiny BERT in bf16: a 32x32 layer's base is 2048 bytes; one fp32 rank of it takes
    # 4 (32 + 32) = 256 bytes, 0.125 of the base. A budget of 0.1 would cap it at rank 0.
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--dtype", "bf16", "--side-budget", "0.1")
    _clear(res, "--side-budget 0.1 holds less than one rank of side branch in",
           "takes 0.125 of its base's bytes", "fix: --side-budget 0.13 or more")  # fmt: skip
    assert not out.exists()


def test_client_data_that_does_not_fit_is_refused_by_file_and_row(
    tiny_bert_dir, tiny_csv, tmp_path, model_never_loads
):
    res = _tiny(tiny_bert_dir, tiny_csv, tmp_path / "r", "--client-data", tmp_path / "none")
    _clear(res, "is not a directory", "0.jsonl, 1.jsonl")
    own = tmp_path / "own"
    own.mkdir()
    for i, label in enumerate(["sport", "tech", "politics"]):
        (own / f"{i}.jsonl").write_text(json.dumps({"text": "a b c", "label": label}) + "\n")
    res = _tiny(tiny_bert_dir, tiny_csv, tmp_path / "r", "--client-data", own)
    _clear(res, "1.jsonl", "row 0 has label 'tech', which is not one of the task's classes")
    (own / "1.jsonl").unlink()
    res = _tiny(tiny_bert_dir, tiny_csv, tmp_path / "r", "--client-data", own)
    _clear(res, "has no file for client 1")
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
