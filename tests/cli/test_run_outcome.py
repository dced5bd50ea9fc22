"""What a finished run says about itself: a divergence is an error, not a result; the
run's own warnings are one line each."""

import json
import sys

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _flat(res) -> str:
    return "".join(res.output.split())


def test_a_run_whose_training_diverges_exits_1_keeps_its_rows_and_exports_nothing(
    tmp_path, tiny_bert_dir, tiny_csv, one_torch_thread
):
    out, export = tmp_path / "run", tmp_path / "exported"
    res = _run("run", "--model", tiny_bert_dir, "--task", tiny_csv, "--min-partition-size", "5",
               "--rounds", "2", "--local-steps", "2", "--max-length", "16", "--lr", "1e10",
               "--out", out, "--export", export, "--no-progress")  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r["round"] for r in rows if r["train_loss"] != r["train_loss"])  # NaN
    assert f"trainingdiverged(fedexinround{first})" in _flat(res)
    assert "Lower--lr(now1e+10)" in _flat(res)
    assert f"`fedex` diverged** in round {first}" in (out / "summary.md").read_text()
    assert not export.exists()


def test_a_healthy_run_is_not_called_diverged(tmp_path, tiny_bert_dir, tiny_csv, one_torch_thread):
    out = tmp_path / "run"
    res = _run("run", "--model", tiny_bert_dir, "--task", tiny_csv, "--min-partition-size", "5",
               "--rounds", "1", "--local-steps", "1", "--max-length", "16", "--out", out,
               "--no-progress")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "diverged" not in res.output and "diverged" not in (out / "summary.md").read_text()


def test_the_runs_own_warnings_print_as_one_line_and_others_as_python_prints_them():
    import warnings

    import fedexlora.tasks.data as data
    from fedexlora.quiet import quiet_libraries

    quiet_libraries()  # what every command calls
    mine = warnings.formatwarning("3 of 9 rows are empty", UserWarning, data.__file__, 12)
    assert mine == "warning: 3 of 9 rows are empty\n"
    theirs = warnings.formatwarning("deprecated", UserWarning, "/site/lib/torch/x.py", 7, "")
    assert theirs.startswith("/site/lib/torch/x.py:7: UserWarning: deprecated")


def _qa(path, long_prompts: int, rows: int = 40):
    with open(path, "w") as f:
        for i in range(rows):
            q = f"what is {i % 7} plus {i % 5}?" + " and then" * (30 if i < long_prompts else 0)
            f.write(json.dumps({"prompt": q, "response": f"it is {i % 7 + i % 5}"}) + "\n")
    return path


def test_prompts_that_fill_max_length_are_named_not_called_a_divergence(
    tmp_path, tiny_llama_dir, one_torch_thread
):
    """A prompt that fills --max-length leaves no answer token: its loss is 0/0. All such:
    refused before training; some: counted in a warning, and the run trains."""
    every = _qa(tmp_path / "long.jsonl", long_prompts=40)
    res = _run("run", "--model", tiny_llama_dir, "--task", every, "--max-length", "24",
               "--rounds", "1", "--local-steps", "1", "--min-partition-size", "5",
               "--out", tmp_path / "a", "--no-progress")  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "every training example's prompt fills --max-length 24 tokens" in " ".join(
        res.output.split()
    )
    assert "raise --max-length" in res.output and "diverged" not in res.output
    some = _qa(tmp_path / "some.jsonl", long_prompts=8)
    with pytest.warns(UserWarning, match=r"of \d+ training examples keep no answer token"):
        res = _run("run", "--model", tiny_llama_dir, "--task", some, "--max-length", "24",
                   "--rounds", "1", "--local-steps", "1", "--min-partition-size", "5",
                   "--max-test", "4", "--max-new-tokens", "2", "--out", tmp_path / "b",
                   "--no-progress")  # fmt: skip
    assert res.exit_code == 0, res.output


def test_a_disk_that_fills_mid_run_is_one_line_and_the_run_resumes(
    tmp_path, tiny_bert_dir, tiny_csv, one_torch_thread, monkeypatch
):
    """ENOSPC while round 2's checkpoint is written: exit 1 with one line naming the file and
    the resume command (it was a long rich traceback); round 1 is intact and resumes."""
    import errno

    from fedexlora.run import lifecycle

    real = lifecycle.save_checkpoint

    def full(directory, server, *args, **kwargs):
        if server.round == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return real(directory, server, *args, **kwargs)

    monkeypatch.setattr(lifecycle, "save_checkpoint", full)
    out = tmp_path / "run"
    args = ("--model", tiny_bert_dir, "--task", tiny_csv, "--min-partition-size", "5",
            "--rounds", "2", "--local-steps", "1", "--max-length", "16", "--method", "fedex",
            "--no-progress")  # fmt: skip
    res = _run("run", *args, "--out", out)
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in res.output and "No space left on device" in text
    assert f"then continue with: fedexlora run --resume {out}" in text.replace("\n", "")
    monkeypatch.setattr(lifecycle, "save_checkpoint", real)
    res = _run("run", "--resume", out, "--no-progress")
    assert res.exit_code == 0, res.output
    rounds = [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2]


def test_a_worker_group_that_cannot_start_says_to_fix_it_before_resuming(
    tmp_path, tiny_bert_dir, tiny_csv, one_torch_thread, monkeypatch
):
    """A launcher that dies at start: the run exits 1 with one line that names it and says to
    fix it before ``--resume`` (the same start would fail again), not a bare resume hint."""
    from fedexlora.run import workers

    monkeypatch.setenv("FEDEXLORA_WORKERS_DIR", str(tmp_path / "workers"))
    monkeypatch.setattr(
        workers, "launch_command", lambda *_: [sys.executable, "-c", "import sys; sys.exit(3)"]
    )
    out = tmp_path / "run"
    args = ("--model", tiny_bert_dir, "--task", tiny_csv, "--min-partition-size", "5",
            "--rounds", "1", "--local-steps", "1", "--max-length", "16", "--method", "fedex",
            "--nproc-per-client", "2", "--no-progress")  # fmt: skip
    res = _run("run", *args, "--out", out)
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in res.output and "worker group" in text
    assert f"fix that, then continue the run with: fedexlora run --resume {out}" in text
