"""Crash and resume: a run killed with SIGKILL mid-round resumes to the identical result."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from fedexlora.checkpoint import CheckpointError, latest_checkpoint
from fedexlora.pipeline import run_experiment
from fedexlora.report import read_metrics


def _cfg_file(tmp_path, tiny_bert_dir, tiny_csv):
    p = tmp_path / "cfg.toml"
    p.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nmethods = ["fedex"]\nrounds = 4\n'
        "local_steps = 30\nbatch_size = 8\nnum_clients = 3\nmin_partition_size = 5\n"
        "max_length = 16\nlora_r = 4\nlora_dropout = 0.1\n"
        'target_modules = ["query", "value"]\nkeep_checkpoints = 2\n'
    )
    return p


def _cmd(*args):
    return [sys.executable, "-m", "fedexlora", "run", "--no-progress", *args]


def _rows_without_timing(path):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(path)]


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
    proc = subprocess.Popen(
        _cmd("--config", str(cfg), "--out", str(crashed)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = crashed / "metrics.jsonl"
    deadline = time.monotonic() + 600
    ckpts = crashed / "checkpoints" / "fedex"
    while time.monotonic() < deadline and proc.poll() is None:
        done = latest_checkpoint(ckpts) if ckpts.is_dir() else None
        if done is not None and done.name == "round-0002":
            break  # round 2 fully written: round 3 (90 local steps) starts now
        time.sleep(0.02)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) == 2, "the kill must land during round 3"
    assert latest_checkpoint(crashed / "checkpoints" / "fedex").name == "round-0002"

    res = subprocess.run(_cmd("--resume", str(crashed)), env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming fedex after round 2" in res.stdout

    clean = tmp_path / "clean"
    res = subprocess.run(
        _cmd("--config", str(cfg), "--out", str(clean)), env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]

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
    import fedexlora.checkpoint as checkpoint
    from fedexlora.pipeline import restore_model

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
    from fedexlora.checkpoint import config_fingerprint
    from fedexlora.pipeline import load_task_for

    task = load_task_for(cfg)
    server = restore_model(cfg, task, "fedex", ckpt, config_fingerprint(cfg.to_dict()))[2]
    assert server.round == 1
    rows = run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2]
