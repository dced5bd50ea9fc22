"""A Flower simulation killed mid-round, whole process group, resumes to the identical run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fedexlora.run.checkpoint import latest_checkpoint
from fedexlora.run.report import read_metrics
from test_flower_deploy import _descendants
from test_resume import _cmd
from test_resume import _rows_without_timing as _rows


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.integration
def test_engine_flower_sigkilled_mid_round_resumes_identically(tmp_path, tiny_bert_dir, tiny_csv):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nmethods = ["fedex"]\nrounds = 4\n'
        'engine = "flower"\nlocal_steps = 200\nbatch_size = 8\nnum_clients = 2\n'
        'min_partition_size = 5\nmax_length = 16\nlora_r = 4\ntarget_modules = ["query", "value"]\n'
        "keep_checkpoints = 1\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FEDEXLORA_CLIENT_CPUS": "1",
    }
    run = tmp_path / "killed"
    log = tmp_path / "killed.log"
    proc = subprocess.Popen(
        _cmd("--config", str(cfg), "--out", str(run)),
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, Ray included
    )
    deadline = time.monotonic() + 900
    ckpts = run / "checkpoints" / "fedex"
    while time.monotonic() < deadline and proc.poll() is None:
        done = latest_checkpoint(ckpts) if ckpts.is_dir() else None
        if done is not None and done.name == "round-0002":
            break
        time.sleep(0.05)
    time.sleep(0.3)  # into round 3: its clients are training
    tree = set(_descendants(proc.pid))
    assert proc.poll() is None, (
        "the run ended before it could be killed: " + log.read_text()[-3000:]
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(5)
    survivors = sorted(p for p in tree if _alive(p))
    assert not survivors, f"processes outlived the killed run: {survivors}"
    assert len(read_metrics(run / "metrics.jsonl")) == 2, "the kill must land in round 3"
    assert (run / "client-state").is_dir()

    res = subprocess.run(
        _cmd("--resume", str(run), "--export", str(tmp_path / "exp-killed")),
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "resuming fedex after round 2" in res.stdout

    # The uninterrupted run, in-process at one thread: the Flower engine's ClientApps train
    # at one thread (FEDEXLORA_CLIENT_CPUS=1) and give the same bits as such a run
    # (test_flower.py::test_simulation_engine_matches_local_engine), so the resumed run
    # must equal it; one flwr run fewer than running the clean run on Flower again.
    clean = tmp_path / "clean"
    code = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from fedexlora.cli import app\n"
        "sys.exit(app(sys.argv[1:]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "run", "--no-progress", "--config", str(cfg),
         "--engine", "local", "--out", str(clean), "--export", str(tmp_path / "exp-clean")],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got, want = _rows(run / "metrics.jsonl"), _rows(clean / "metrics.jsonl")
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert set(a) == set(b)
        for key in ("method", "round", "sampled", "accepted", "rejected", "dropped",
                    "num_examples", "bytes_up", "bytes_down", "residual_rank"):  # fmt: skip
            assert a[key] == b[key], (a["round"], key)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-6, abs=1e-9)
    files = sorted(p.name for p in (tmp_path / "exp-clean").glob("*.safetensors"))
    assert files
    for name in files:
        a = load_file(str(tmp_path / "exp-killed" / name))
        b = load_file(str(tmp_path / "exp-clean" / name))
        assert set(a) == set(b)
        for k in a:
            assert (a[k] == b[k]).all(), (name, k)
