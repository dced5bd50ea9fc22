"""Crash and resume: a run killed with SIGKILL mid-round resumes to the identical result."""

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import launch
from fedexlora.run.checkpoint import CheckpointError, latest_checkpoint
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.report import read_metrics

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=65)


def _cfg_file(tmp_path, tiny_bert_dir, tiny_csv):
    p = tmp_path / "cfg.toml"
    p.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nmethods = ["fedex"]\nrounds = 4\n'
        "local_steps = 15\nbatch_size = 8\nnum_clients = 3\nmin_partition_size = 5\n"
        "max_length = 16\nlora_r = 4\nlora_dropout = 0.1\n"
        'target_modules = ["query", "value"]\nkeep_checkpoints = 2\n'
    )
    return p


def _args(*args):
    return ["run", "--no-progress", *args]


def _cmd(*args):
    """``python -m fedexlora run ...``: the real console entry point, imports and all."""
    return [sys.executable, "-m", "fedexlora", *_args(*args)]


def _rows_without_timing(path):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in read_metrics(path)]


def _final_tensors(run_dir):
    ckpt = latest_checkpoint(run_dir / "checkpoints" / "fedex")
    out = load_file(str(ckpt / "tensors.safetensors"))
    out.update(
        {f"delta.{k}": v for k, v in load_file(str(ckpt / "base_deltas.safetensors")).items()}
    )
    return ckpt, out


@pytest.mark.integration
def test_sigkill_in_round_3_then_resume_is_identical(tmp_path, tiny_bert_dir, tiny_csv):
    cfg = _cfg_file(tmp_path, tiny_bert_dir, tiny_csv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    crashed = tmp_path / "crashed"
    proc = launch.start(*_args("--config", str(cfg), "--out", str(crashed)), env=env)
    metrics = crashed / "metrics.jsonl"
    deadline = time.monotonic() + 600
    ckpts = crashed / "checkpoints" / "fedex"
    while time.monotonic() < deadline and proc.poll() is None:
        done = latest_checkpoint(ckpts) if ckpts.is_dir() else None
        # round 2 fully written (its checkpoint, then its row): round 3 (45 local steps)
        # starts now
        if done is not None and done.name == "round-0002" and metrics.is_file():
            if len(metrics.read_text().splitlines()) == 2:
                break
        time.sleep(0.02)
    time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its kill: " + proc.output()[-2000:]
    proc.kill()
    proc.wait()
    assert len(metrics.read_text().splitlines()) == 2, "the kill must land during round 3"
    assert latest_checkpoint(crashed / "checkpoints" / "fedex").name == "round-0002"

    code, out = launch.run(*_args("--resume", str(crashed)), env=env)
    assert code == 0, out[-2000:]
    assert "resuming fedex after round 2" in out

    clean = tmp_path / "clean"
    code, out = launch.run(*_args("--config", str(cfg), "--out", str(clean)), env=env)
    assert code == 0, out[-2000:]

    assert _rows_without_timing(crashed / "metrics.jsonl") == _rows_without_timing(
        clean / "metrics.jsonl"
    )
    ck_a, a = _final_tensors(crashed)
    ck_b, b = _final_tensors(clean)
    assert ck_a.name == ck_b.name == "round-0004"
    assert set(a) == set(b)
    for k in a:
        assert (a[k] == b[k]).all(), k
    # only the last keep_checkpoints=2 remain
    assert sorted(p.name for p in (crashed / "checkpoints" / "fedex").glob("round-*")) == [
        "round-0003",
        "round-0004",
    ]


def test_corrupt_or_mismatched_checkpoint_is_refused_and_kept(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    ckpt = latest_checkpoint(tmp_path / "checkpoints" / "fedex")
    bad = ckpt / "tensors.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable or corrupt"):
        run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    assert bad.read_bytes() == b"not a safetensors file"  # never overwritten
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_checkpoint_from_other_config_is_refused(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    meta_path = latest_checkpoint(tmp_path / "checkpoints" / "fedex") / "meta.json"
    before = meta_path.read_text()
    with pytest.raises(CheckpointError, match="another configuration or model"):
        run_experiment(cfg.replace(lora_r=2, rounds=2), tmp_path, resume=True, progress=False)
    assert meta_path.read_text() == before
    assert json.loads(before)["round"] == 1


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tiny_cfg, tmp_path, monkeypatch):
    """Everything of a checkpoint lands before it is renamed into place and older ones pruned."""
    import fedexlora.run.checkpoint as checkpoint
    from fedexlora.run.restore import restore_model

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, keep_checkpoints=1)
    run_experiment(cfg, tmp_path, progress=False)
    real = checkpoint.save_file

    def crash_on_base(tensors, path, *a, **kw):
        if path.endswith("base_deltas.safetensors"):
            raise KeyboardInterrupt("killed while writing the base deltas")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(checkpoint, "save_file", crash_on_base)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    monkeypatch.setattr(checkpoint, "save_file", real)
    ckpt = latest_checkpoint(tmp_path / "checkpoints" / "fedex")
    assert ckpt.name == "round-0001"
    from fedexlora.run.checkpoint import config_fingerprint
    from fedexlora.run.restore import load_task_for

    task = load_task_for(cfg)
    server = restore_model(cfg, task, "fedex", ckpt, config_fingerprint(cfg))[2]
    assert server.round == 1
    rows = run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2]


class _Crash(BaseException):
    """Stands for a SIGKILL: nothing after it runs, no ``except Exception`` catches it."""


SAVE_STEPS = ["tensors", "base", "meta", "fsync", "rename", "prune"]


def _crash_in_second_save(monkeypatch, step):
    """Round 2's save_checkpoint dies, as under SIGKILL, right after ``step``.

    ``tensors``/``base``: that file written; ``meta``: meta.json written, nothing flushed;
    ``fsync``: everything flushed, not renamed; ``rename``: renamed into place and the
    directory flushed; ``prune``: the first older checkpoint removed.
    """
    import fedexlora.run.checkpoint as checkpoint

    saves = []  # tensors files written so far: one per save
    real_save, real_fsync_all = checkpoint.save_file, checkpoint._fsync_all
    real_fsync_dir, real_rmtree = checkpoint._fsync_dir, checkpoint.shutil.rmtree

    def crash_if(now):
        if now == step and len(saves) == 2:
            raise _Crash(step)

    def save_file(tensors, path, *args, **kwargs):
        real_save(tensors, path, *args, **kwargs)
        if path.endswith("tensors.safetensors"):
            saves.append(path)
            crash_if("tensors")
        elif path.endswith("base_deltas.safetensors"):
            crash_if("base")

    def fsync_all(directory):
        crash_if("meta")
        real_fsync_all(directory)
        crash_if("fsync")

    def fsync_dir(path):
        real_fsync_dir(path)
        if not Path(path).name.startswith(".tmp-"):  # the checkpoints directory
            crash_if("rename")

    def rmtree(path, *args, **kwargs):
        real_rmtree(path, *args, **kwargs)
        if Path(path).name.startswith("round-"):
            crash_if("prune")

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    monkeypatch.setattr(checkpoint, "_fsync_all", fsync_all)
    monkeypatch.setattr(checkpoint, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(checkpoint, "shutil", SimpleNamespace(rmtree=rmtree))


def _tensors_of(ckpt):
    out = load_file(str(ckpt / "tensors.safetensors"))
    out.update(
        {f"delta.{k}": v for k, v in load_file(str(ckpt / "base_deltas.safetensors")).items()}
    )
    return out


@pytest.fixture()
def clean_run(tiny_cfg, tmp_path_factory):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=3, keep_checkpoints=1)
    out = tmp_path_factory.mktemp("clean")
    run_experiment(cfg, out, progress=False)
    return cfg, out


@pytest.mark.parametrize("step", SAVE_STEPS)
def test_crash_at_each_step_of_a_save_resumes_identically(clean_run, tmp_path, monkeypatch, step):
    """keep_checkpoints=1: a crash anywhere in round 2's save loses nothing."""
    import fedexlora.run.checkpoint as checkpoint

    cfg, clean = clean_run
    _crash_in_second_save(monkeypatch, step)
    with pytest.raises(_Crash) as crashed:
        run_experiment(cfg, tmp_path, progress=False)
    assert crashed.value.args == (step,)
    monkeypatch.undo()
    left = checkpoint.latest_checkpoint(tmp_path / "checkpoints" / "fedex")
    # before the rename the round-1 checkpoint is the newest complete one; after, round 2's
    assert left.name == ("round-0002" if step in ("rename", "prune") else "round-0001")
    rows = run_experiment(cfg, tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert _rows_without_timing(tmp_path / "metrics.jsonl") == _rows_without_timing(
        clean / "metrics.jsonl"
    )
    ours = checkpoint.checkpoints(tmp_path / "checkpoints" / "fedex")
    assert [p.name for p in ours] == ["round-0003"]  # keep_checkpoints=1, strays pruned
    a, b = _tensors_of(ours[0]), _tensors_of(clean / "checkpoints" / "fedex" / "round-0003")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tiny_cfg, tmp_path):
    """A truncated file in the newest checkpoint: resume warns, uses the previous one."""
    from fedexlora.run.checkpoint import checkpoints

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, keep_checkpoints=2)
    run_experiment(cfg, tmp_path, progress=False)
    ck = tmp_path / "checkpoints" / "fedex"
    newest = ck / "round-0002" / "base_deltas.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # a disk error, a half-copied backup
    assert [p.name for p in checkpoints(ck)] == ["round-0001"]
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        rows = run_experiment(cfg.replace(rounds=3), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2, 3]

    # the same damage that keeps the sizes (bit rot): found when loading, then the fallback
    bad = ck / "round-0003" / "tensors.safetensors"
    bad.write_bytes(b"\0" * bad.stat().st_size)
    with pytest.warns(UserWarning, match="falling back"):
        rows = run_experiment(cfg.replace(rounds=4), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]

    # one flipped bit inside a tensor keeps the header valid: the file loaded, and the
    # resumed model was silently another (a base delta: applied onto the weights)
    for name in ("tensors.safetensors", "base_deltas.safetensors"):
        newest = checkpoints(ck)[-1]
        data = bytearray((newest / name).read_bytes())
        data[-3] ^= 0x40  # an exponent bit of the last value
        (newest / name).write_bytes(bytes(data))
        more = int(newest.name.split("-")[1]) + 1
        with pytest.warns(UserWarning, match="does not hold the bytes written.*falling back"):
            rows = run_experiment(cfg.replace(rounds=more), tmp_path, resume=True,
                                  progress=False)  # fmt: skip
        assert [r["round"] for r in rows] == list(range(1, more + 1))
    run_experiment(cfg.replace(rounds=6), tmp_path / "straight", progress=False)
    assert _rows_without_timing(tmp_path / "metrics.jsonl") == _rows_without_timing(
        tmp_path / "straight" / "metrics.jsonl"
    )


def test_load_checkpoint_restores_all_or_nothing(tiny_cfg, tmp_path):
    """A checkpoint missing one of its parts raises CheckpointError; the server is untouched."""
    from fedexlora.run.build import new_model, new_server
    from fedexlora.run.checkpoint import load_checkpoint
    from fedexlora.run.restore import load_task_for

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    ckpt = latest_checkpoint(tmp_path / "checkpoints" / "fedex")
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["client_version"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    task = load_task_for(cfg)
    server = new_server(cfg, "fedex", new_model(cfg, task, "fedex")[0])
    before = {k: v.clone() for k, v in server.state.to_flat().items()}
    with pytest.raises(CheckpointError, match="lacks \\['client_version'\\]") as err:
        load_checkpoint(ckpt, server)
    assert err.value.corrupt
    assert server.round == 0 and server.version == 0 and not server.base_delta
    assert all(torch.equal(before[k], v) for k, v in server.state.to_flat().items())


@pytest.mark.integration
def test_random_sigkills_then_resume_each_time_is_identical(tmp_path, tiny_bert_dir, tiny_csv):
    """SIGKILL a run at random moments (seeded) many times, resume each time: same result."""
    import random

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nmethods = ["fedex"]\nrounds = 8\n'
        "local_steps = 6\nbatch_size = 8\nnum_clients = 3\nmin_partition_size = 5\n"
        'max_length = 16\nlora_r = 4\ntarget_modules = ["query", "value"]\n'
        "keep_checkpoints = 1\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    clean = tmp_path / "clean"
    code, out = launch.run(*_args("--config", str(cfg), "--out", str(clean)), env=env)
    assert code == 0, out[-2000:]

    # Kill moments are drawn from the run's progress, not the clock (shared machines are
    # noisy): during start-up, or a random instant after the next round's row appears
    # (while its checkpoint is written, or the round after trains).
    rng = random.Random(1234)
    run = tmp_path / "killed"
    metrics = run / "metrics.jsonl"
    progress = []
    for _ in range(8):
        started = (run / "config.toml").is_file()
        args = ("--resume", str(run)) if started else ("--config", str(cfg), "--out", str(run))
        now = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        target = now + (rng.choice([0, 1, 1, 2]) if now < 6 else 0)
        proc = launch.start(*_args(*args), env=env)
        t0 = time.monotonic()
        if target == now:
            while proc.poll() is None and time.monotonic() - t0 < rng.uniform(0.2, 4.0):
                time.sleep(0.01)
        else:
            while proc.poll() is None and (
                not metrics.is_file() or len(metrics.read_text().splitlines()) < target
            ):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))
        assert proc.poll() is None, "the run ended before its kill: " + proc.output()[-2000:]
        proc.kill()
        proc.wait()
        done = latest_checkpoint(run / "checkpoints" / "fedex")
        progress.append(done.name if done else None)
    code, out = launch.run(*_args("--resume", str(run)), env=env)
    assert code == 0, out[-2000:]
    assert len({p for p in progress if p}) >= 3, f"kills landed in too few rounds: {progress}"
    assert _rows_without_timing(run / "metrics.jsonl") == _rows_without_timing(
        clean / "metrics.jsonl"
    )
    a, b = _final_tensors(run), _final_tensors(clean)
    assert a[0].name == b[0].name == "round-0008"
    assert set(a[1]) == set(b[1])
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def test_resumed_metrics_keep_every_methods_rows_in_order(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(rounds=1)
    first = run_experiment(cfg, tmp_path, progress=False)
    rows = run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    want = [("fedex", 1), ("fedex", 2), ("fedit", 1), ("fedit", 2)]
    assert [(r["method"], r["round"]) for r in rows] == want
    assert read_metrics(tmp_path / "metrics.jsonl") == rows
    # the rows written before are kept as they were, seconds and all: a checkpoint's copy
    # of its own round's row was taken before the checkpoint's seconds were known
    assert first[0]["split_seconds"]["checkpoint"] > 0
    assert [r for r in rows if r["round"] == 1] == first


def test_a_finished_method_is_kept_from_its_rows_and_a_torn_line_is_skipped(tiny_cfg, tmp_path):
    """A resume keeps a finished method's rows without loading it, when its newest
    checkpoint is of its last row's round (or it has none); a row beyond its checkpoint
    (a round that failed the exactness check keeps its row and no checkpoint) runs again.
    A line a crash tore is skipped."""
    import shutil

    cfg = tiny_cfg.replace(rounds=2, keep_checkpoints=2)
    rows = run_experiment(cfg, tmp_path, progress=False)
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"method": "fedex", "rou')  # torn by a crash
    said = []
    console = type("Console", (), {"print": staticmethod(lambda *a, **k: said.append(str(a[0])))})
    again = run_experiment(cfg, tmp_path, resume=True, progress=False, console=console)
    assert again == rows and read_metrics(metrics) == rows
    assert "fedex finished before (2 rounds): its rows are kept" in said
    assert not any(s.startswith("resuming") for s in said)  # nothing loaded
    # kept rows are of config.toml's settings: a resume with others is refused
    with pytest.raises(CheckpointError, match=r"ran with other settings than this resume \(lr"):
        run_experiment(cfg.replace(lr=0.5), tmp_path, resume=True, progress=False, console=console)
    assert read_metrics(metrics) == rows

    # fedex's round-2 row without its checkpoint: round 2 runs again, from round 1's
    shutil.rmtree(tmp_path / "checkpoints" / "fedex" / "round-0002")
    said.clear()
    again = run_experiment(cfg, tmp_path, resume=True, progress=False, console=console)
    assert "resuming fedex after round 1" in said and "fedit finished before" in " ".join(said)
    strip = [{k: v for k, v in r.items() if "seconds" not in k} for r in again]
    assert strip == [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]
    assert (tmp_path / "checkpoints" / "fedex" / "round-0002").is_dir()


def test_a_resume_that_adds_rounds_records_them_and_a_plain_resume_then_succeeds(
    tiny_bert_dir, tiny_csv, tmp_path
):
    """config.toml says how the run goes on: after ``--resume --rounds 3`` it says 3, so a
    later plain ``--resume`` has nothing left to do, rather than failing on --rounds 2."""
    from typer.testing import CliRunner

    from fedexlora.cli import app
    from fedexlora.config import load_run_config

    out = tmp_path / "run"

    def run(*args):
        res = CliRunner().invoke(app, ["run", *map(str, args), "--no-progress"])
        assert res.exit_code == 0, res.output
        return res

    run("--model", tiny_bert_dir, "--task", tiny_csv, "--rounds", "2", "--local-steps", "1",
        "--min-partition-size", "5", "--max-length", "16", "--out", out)  # fmt: skip
    before = load_run_config(out / "config.toml")
    run("--resume", out, "--rounds", "3")
    after = load_run_config(out / "config.toml")
    assert after.rounds == 3 and after.replace(rounds=2) == before
    assert max(r["round"] for r in read_metrics(out / "metrics.jsonl")) == 3
    run("--resume", out)
    assert len(read_metrics(out / "metrics.jsonl")) == 3
