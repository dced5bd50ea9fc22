"""A client on several processes: what is refused before training, and how a group is
launched, found and given up, without starting one (the group itself:
``test_worker_group.py``)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app
from fedexlora.config import ConfigError, RunConfig
from fedexlora.run import workers


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp_epsilon": 8.0}, r"`nproc_per_client` 2: .*--dp-epsilon"),
        ({"client_ranks": [4, 2, 3], "lora_r": 4}, r"`nproc_per_client` 2: .*--client-ranks"),
        ({"distributed": "fsdp", "dora": True}, r"--dora under --distributed fsdp"),
        ({"distributed": "fsdp", "trainer": "trl"}, r"--trainer trl under --distributed fsdp"),
        (
            {"distributed": "fsdp", "fp32_side_branch": False},
            r"--no-fp32-side-branch under --distributed fsdp",
        ),
        (  # each refused only after the group had loaded its model, with a --resume hint
            {"distributed": "fsdp", "methods": ["fedex", "rolora", "fedsb"], "fedsb_rank": 4},
            r"--method rolora,fedsb under --distributed fsdp",
        ),
        ({"distributed": "mpi"}, r"`distributed`.*'mpi'"),
        ({"launcher": "mpirun"}, r"`launcher`.*'mpirun'"),
        ({"nproc_per_client": 0}, r"`nproc_per_client`"),
        ({"accelerate_config": "x.yaml"}, r"`accelerate_config` is read by `accelerate launch`"),
        (
            {"launcher": "accelerate", "accelerate_config": "/nonexistent/acc.yaml"},
            r"`accelerate_config` '/nonexistent/acc.yaml' is not a file",
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_the_flag(tiny_cfg, changes, message):
    cfg = tiny_cfg.replace(**{"nproc_per_client": 2, **changes})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_fsdp_takes_every_method_that_trains_the_same_factors_each_round(tiny_cfg):
    from fedexlora.core.methods import REGISTRY

    sharded = [n for n, s in REGISTRY.items() if s.shards_under_fsdp and n != "centralized"]
    assert "rolora" not in sharded and "fedsb" not in sharded and "fedex" in sharded
    tiny_cfg.replace(nproc_per_client=2, distributed="fsdp", methods=sharded).validate()


def test_ddp_and_fsdp_with_secure_aggregation_are_accepted(tiny_cfg):
    for mode in ("ddp", "fsdp"):
        tiny_cfg.replace(nproc_per_client=2, distributed=mode, secure_aggregation=True).validate()


def test_trl_on_two_processes_under_ddp_is_accepted(tiny_cfg):
    tiny_cfg.replace(nproc_per_client=2, distributed="ddp", trainer="trl").validate()


def test_the_cli_refuses_dp_on_two_processes_in_one_line_before_loading(
    tiny_bert_dir, tiny_csv, tmp_path, model_never_loads
):
    res = CliRunner().invoke(
        app,
        ["run", "--model", tiny_bert_dir, "--task", tiny_csv, "--nproc-per-client", "2",
         "--dp-epsilon", "8", "--out", str(tmp_path / "run"), "--no-progress"],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "nproc_per_client" in res.output.replace("\n", "") or "--nproc-per-client" in res.output
    assert not (tmp_path / "run").exists()


def test_more_processes_than_the_machine_has_devices_are_refused_before_any_starts(
    tiny_bert_dir, tiny_csv, tmp_path, model_never_loads, monkeypatch
):
    """One rank per CPU core (or GPU): 200 ranks on a 2-core machine each loaded the model
    until the memory was full. Refused before the run, and by the group itself (a Flower
    node has devices of its own)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    res = CliRunner().invoke(
        app,
        ["run", "--model", tiny_bert_dir, "--task", tiny_csv, "--nproc-per-client", "3",
         "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"],
    )  # fmt: skip
    out = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "--nproc-per-client 3: this machine has 2 CPU cores, one per process; use " in out
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()
    cfg = RunConfig(nproc_per_client=3, device="cpu")
    group = workers.WorkerGroup(cfg, "fedex", tmp_path / "group")
    with pytest.raises(workers.WorkerGroupError, match="this machine has 2 CPU cores"):
        group.start()
    assert not (tmp_path / "group").exists()  # nothing launched
    assert workers.devices_error(cfg.replace(nproc_per_client=2)) is None


def test_the_launchers_command_lines(tmp_path):
    cfg = RunConfig(nproc_per_client=4)
    cmd = workers.launch_command(cfg, tmp_path, 29500)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--max-restarts") + 1] == "0"  # a dead rank ends the group
    assert cmd[-3:] == ["-m", workers.ENTRY, str(tmp_path)]
    acc = workers.launch_command(cfg.replace(launcher="accelerate"), tmp_path, 29500)
    assert acc[1:3] == ["-m", "accelerate.commands.launch"]
    assert acc[acc.index("--num_processes") + 1] == "4" and "--multi_gpu" in acc
    conf = tmp_path / "acc.yaml"
    conf.write_text("distributed_type: MULTI_GPU\n")
    acc = workers.launch_command(
        cfg.replace(launcher="accelerate", accelerate_config=str(conf)), tmp_path, 29500
    )
    assert acc[acc.index("--config_file") + 1] == str(conf) and "--multi_gpu" not in acc
    assert acc[-3:] == ["--module", workers.ENTRY, str(tmp_path)]


def test_one_process_trains_in_place():
    from fedexlora.run.client_step import local_update

    assert workers.update_for(RunConfig()) is local_update
    assert workers.update_for(RunConfig(nproc_per_client=2)).func is workers.group_update


def test_a_launcher_that_dies_at_start_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDEXLORA_WORKERS_DIR", str(tmp_path))
    monkeypatch.setattr(
        workers, "launch_command", lambda *_: [sys.executable, "-c", "import sys; sys.exit(3)"]
    )
    group = workers.WorkerGroup(RunConfig(nproc_per_client=2), "fedex")
    with pytest.raises(workers.WorkerGroupError, match="could not start: its launcher exited"):
        group.start()
    assert group.dir not in workers._STARTED


def test_a_group_of_another_configuration_or_gone_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDEXLORA_WORKERS_DIR", str(tmp_path))
    cfg = RunConfig(nproc_per_client=2)
    group = workers.WorkerGroup(cfg, "fedex")
    assert group.problem() == "no group"
    group.dir.mkdir(parents=True)
    (group.dir / "group.json").write_text(json.dumps({"key": "other", "launcher_pid": 1}))
    assert group.problem() == "a group of another configuration"
    dead = workers.subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (group.dir / "group.json").write_text(json.dumps({"key": group.key, "launcher_pid": dead.pid}))
    assert group.problem() == "its launcher is gone"
    # settings that neither build nor train a rank's model share a group; the others not
    assert workers.group_key(cfg.replace(rounds=9, secure_aggregation=True), "fedex") == group.key
    assert workers.group_key(cfg.replace(lr=0.5), "fedex") != group.key
    assert workers.group_key(cfg, "fedit") != group.key


def test_a_resume_finds_the_group_its_run_started():
    """config.toml holds fp32_side_branch resolved; the run had it unset: one group."""
    cfg = RunConfig(nproc_per_client=2)
    assert cfg.fp32_side_branch is None
    resumed = cfg.replace(fp32_side_branch=cfg.fp32_side_branch_resolved)
    assert workers.group_key(cfg, "fedex") == workers.group_key(resumed, "fedex")
    flipped = cfg.replace(fp32_side_branch=not cfg.fp32_side_branch_resolved)
    assert workers.group_key(cfg, "fedex") != workers.group_key(flipped, "fedex")


_OWNER = r"""
import sys, time
from pathlib import Path
from fedexlora.config import RunConfig
from fedexlora.run import workers
# a launcher that only says it is ready, then waits as a training group would
fake = ("import os, time; open('rank-0.pid', 'w').write(str(os.getpid())); "
        "open('ready', 'w'); time.sleep(600)")
workers.launch_command = lambda cfg, jobdir, port: [sys.executable, "-c", fake]
workers.devices_error = lambda cfg: None
group = workers.WorkerGroup(RunConfig(nproc_per_client=2, device="cpu"), "fedex", Path(sys.argv[1]))
group.start()
print(group.proc.pid, flush=True)
time.sleep(600)
"""


def test_sigterm_to_the_client_stops_its_group(tmp_path):
    """The group runs in a session of its own: a SIGTERM to the client's process group
    does not reach it, and Python's default SIGTERM skips atexit. The client now exits
    through its exit handlers, which stop the group."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "group")],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        launcher = int(proc.stdout.readline())
        assert workers._alive(launcher)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while workers._alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not workers._alive(launcher), "the group outlived its client"
    finally:
        proc.kill()
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(launcher, signal.SIGKILL)
