"""``fedexlora run --engine flower`` through Flower's simulation runtime, against the
in-process engine: the same rows and the same bits, a SIGKILL of the whole process group
mid-round resumed to the identical run, and every connection on loopback.

One killed run and its resume serve all three checks. Each ``--engine flower`` run starts
a SuperLink, a SuperExec, Ray and a ClientApp actor, each importing torch, transformers
and peft; on the 2-core CI machine that is about a minute per run, so the checks share
one: four methods, killed in FedEx's round 2, resumed under strace (a whole run, Ray's
daemons included), against the same job in-process at one thread.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import launch
from fedexlora.run.checkpoint import latest_checkpoint
from fedexlora.run.report import read_metrics
from test_flower import ROW_FIELDS, VENV_BIN
from test_flower_deploy import _descendants
from test_resume import _args, _tensors_of
from test_resume import _rows_without_timing as _rows

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=175)

METHODS = ["fedex", "fedit", "ffa", "flora"]
ROUNDS = 2  # round 2 is where the kill lands and where the resume picks up


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _strace_prefix(log: Path) -> list[str]:
    """``strace`` of every connect() in the process tree, or [] where it cannot run."""
    strace = shutil.which("strace")
    if strace is None:
        return []
    probe = subprocess.run([strace, "-qq", "-e", "trace=connect", "true"], capture_output=True)
    if probe.returncode != 0:  # no ptrace here (a container without the capability)
        return []
    return [
        strace,
        "-f",
        "--seccomp-bpf",  # only connect() stops a process: a fraction of the overhead
        "-qq",
        "-e",
        "trace=connect",
        "-e",
        "signal=none",
        "-o",
        str(log),
    ]


def _client_state(run: Path) -> dict[str, int]:
    """Every file under ``run/client-state`` and its modification time (ns)."""
    root = run / "client-state"
    out = {}
    for p in root.rglob("*") if root.is_dir() else []:
        try:
            out[str(p)] = p.stat().st_mtime_ns
        except OSError:  # replaced while listed
            pass
    return out


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, tiny_bert_dir, tiny_csv):
    """``--engine flower`` SIGKILLed (its whole process group) in round 2, then resumed
    with the installed ``fedexlora`` command under strace; and the same job in-process."""
    tmp_path = tmp_path_factory.mktemp("flower-crash")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\n'
        f"methods = {json.dumps(METHODS)}\nrounds = {ROUNDS}\n"
        'engine = "flower"\nlocal_steps = 20\nbatch_size = 8\nnum_clients = 2\n'
        'min_partition_size = 5\nmax_length = 16\nlora_r = 4\ntarget_modules = ["query", "value"]\n'
        'keep_checkpoints = 1\nreport_to = ["tensorboard"]\n'
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FEDEXLORA_CLIENT_CPUS": "1",
        "FEDEXLORA_RAY_CPUS": "1",  # one ClientApp actor: one import of torch and peft
        "HF_HUB_OFFLINE": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    env.pop("RAY_USAGE_STATS_ENABLED", None)  # fedex-lora's default: off
    run = tmp_path / "killed"
    # its own process group (launch.start), Ray included
    proc = launch.start(*_args("--config", str(cfg), "--out", str(run)), env=env)
    deadline = time.monotonic() + 900
    ckpts = run / "checkpoints" / "fedex"
    while time.monotonic() < deadline and proc.poll() is None:
        done = latest_checkpoint(ckpts) if ckpts.is_dir() else None
        if done is not None and done.name == "round-0001":
            break
        time.sleep(0.05)
    # Into round 2 by its progress, not the clock: the one ClientApp actor trains the two
    # clients in turn, and the first one's round-2 state lands in client-state/ while the
    # second one trains (a kill on a timer needed 80 local steps to land in any phase).
    before = _client_state(run)
    while time.monotonic() < deadline and proc.poll() is None and _client_state(run) == before:
        time.sleep(0.005)
    tree = set(_descendants(proc.pid))
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.output()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL reaped: none may be left after 5 s
    survivors = sorted(p for p in tree if _alive(p))
    rows_when_killed = len(read_metrics(run / "metrics.jsonl"))

    strace_log = tmp_path / "strace.out"
    prefix = _strace_prefix(strace_log)
    resumed = subprocess.run(
        [*prefix, str(VENV_BIN / "fedexlora"), "run", "--no-progress", "--resume", str(run),
         "--export", str(tmp_path / "exp-killed")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )  # fmt: skip

    # The uninterrupted run, in-process at one thread: the Flower engine's ClientApp trains
    # at one thread (FEDEXLORA_CLIENT_CPUS=1, one actor) and gives the same bits as such a
    # run (test_simulation_engine_matches_local_engine, below), so the resumed run
    # must equal it; one flwr run fewer than running the clean run on Flower again.
    clean = tmp_path / "clean"
    code, out = launch.run(
        *_args("--config", str(cfg), "--engine", "local", "--out", str(clean),
               "--export", str(tmp_path / "exp-clean")),
        env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert code == 0, out[-3000:]
    return {
        "tmp": tmp_path,
        "run": run,
        "clean": clean,
        "survivors": survivors,
        "rows_when_killed": rows_when_killed,
        "resumed": resumed,
        "strace": strace_log if prefix else None,
    }


def _checkpoint_tensors(run_dir: Path, method: str) -> dict:
    ckpt = latest_checkpoint(run_dir / "checkpoints" / method)
    assert ckpt is not None and ckpt.name == f"round-{ROUNDS:04d}", (method, ckpt)
    return _tensors_of(ckpt)


@pytest.mark.integration
def test_engine_flower_sigkilled_mid_round_resumes_identically(killed_and_resumed):
    k = killed_and_resumed
    assert not k["survivors"], f"processes outlived the killed run: {k['survivors']}"
    assert k["rows_when_killed"] == 1, "the kill must land in FedEx's round 2"
    assert (k["run"] / "client-state").is_dir()
    res = k["resumed"]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "resuming fedex after round 1" in res.stdout
    files = sorted(p.name for p in (k["tmp"] / "exp-clean").glob("*.safetensors"))
    assert files
    for name in files:  # the export of the resumed run: FedEx's global model, bit for bit
        a = load_file(str(k["tmp"] / "exp-killed" / name))
        b = load_file(str(k["tmp"] / "exp-clean" / name))
        assert set(a) == set(b)
        for key in a:
            assert (a[key] == b[key]).all(), (name, key)


@pytest.mark.integration
def test_simulation_engine_matches_local_engine(killed_and_resumed):
    """Every method's rows and final global model under Flower equal the in-process
    engine's at one thread (the ClientApp's threads), bit for bit: Flower is transport."""
    k = killed_and_resumed
    assert k["resumed"].returncode == 0, k["resumed"].stderr[-3000:]
    flower, local = k["run"], k["clean"]
    for name in ("config.toml", "metrics.jsonl", "summary.md", "metrics.png", "deviation.png"):
        assert (flower / name).is_file(), name
    got, want = _rows(flower / "metrics.jsonl"), _rows(local / "metrics.jsonl")
    assert len(got) == len(want) == ROUNDS * len(METHODS)
    assert [(r["method"], r["round"]) for r in got] == [(r["method"], r["round"]) for r in want]
    for a, b in zip(got, want):
        assert set(a) == set(b) and ROW_FIELDS - {"seconds", "server_seconds"} <= set(
            a
        )  # timings dropped
        for key in ("method", "round", "sampled", "accepted", "rejected", "dropped",
                    "num_examples", "bytes_up", "bytes_down", "residual_rank"):  # fmt: skip
            assert a[key] == b[key], (a["method"], a["round"], key)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-6, abs=1e-9)
    for method in METHODS:
        a, b = _checkpoint_tensors(flower, method), _checkpoint_tensors(local, method)
        assert set(a) == set(b), method
        for key in a:
            assert torch.equal(a[key], b[key]), (method, key)
    # the ServerApps (the killed one, then the resumed one) logged every round to TensorBoard
    from test_trackers import tensorboard_scalars

    tb = tensorboard_scalars(flower)
    for r in read_metrics(local / "metrics.jsonl"):
        assert tb[f"{r['method']}/accuracy"][r["round"]] == pytest.approx(
            r["metrics"]["accuracy"], abs=1e-6
        )


@pytest.mark.integration
def test_ray_simulation_connects_to_loopback_only(killed_and_resumed):
    """Every connect() of a whole ``--engine flower`` run (the resume: start-up, Ray and
    its daemons, every round, the export)."""
    res = killed_and_resumed["resumed"]
    if killed_and_resumed["strace"] is None:
        pytest.skip("strace is not installed or cannot trace here")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(read_metrics(killed_and_resumed["run"] / "metrics.jsonl")) == ROUNDS * len(METHODS)
    text = killed_and_resumed["strace"].read_text()
    v4 = re.findall(r'sin_addr=inet_addr\("([^"]+)"\)', text)
    v6 = re.findall(r'inet_pton\(AF_INET6, "([^"]+)"', text)
    assert v4, "strace saw no TCP connect at all: the check would be empty"
    outside = [a for a in v4 if not a.startswith("127.")]
    outside += [a for a in v6 if a not in ("::1",) and not a.startswith("::ffff:127.")]
    assert not outside, f"connections outside loopback: {sorted(set(outside))}"
