"""A client that trains on several processes of its node: a worker group (torchrun, accelerate).

With ``nproc_per_client`` N > 1 a client's process (the in-process engine's, or Flower's
ClientApp's: the *coordinator*) does not train itself. It hands each round to a group of
N worker processes started by the standard launchers::

    torchrun --nproc-per-node N -m fedexlora.run.worker_main JOBDIR
    accelerate launch --num_processes N [--config_file F] -m fedexlora.run.worker_main JOBDIR

(gloo on CPU, NCCL on GPU, each rank on its ``LOCAL_RANK`` device; a free master port).
The group loads the model once and stays up across rounds. Per round the coordinator
writes a job into ``JOBDIR`` (the client's state, :func:`fedexlora.bridge.steps.client_state`,
as safetensors; its examples; the method, round, client and steps as JSON), every rank
runs it (:mod:`fedexlora.training.distributed`: DDP or FSDP), and rank 0 writes the
result (the trained adapter state, the example count and the loss); the coordinator
loads it into its own model and builds the upload exactly as one process does
(:func:`fedexlora.run.client_step.trained_upload`). Every file is written atomically.

The group is found again by a later process of the same node (a Flower deployment runs
each message in a fresh ClientApp process): it lives in its own session, ``JOBDIR`` is
named after the configuration and method, and ``group.json`` holds the launcher's pid
and the configuration's fingerprint; rank 0 keeps a heartbeat. A group that is dead, or
of another configuration, is replaced. It exits when idle for ``FEDEXLORA_WORKER_IDLE``
seconds (600 by default), when its coordinator says stop, or when the process it
belongs to is gone: the in-process engine's, or a Flower ClientApp's parent (the
SuperNode's runtime, or Ray's worker), since each message may be a new ClientApp process.

A rank that dies makes the launcher tear the group down; the coordinator notices (the
launcher's exit, or a stale heartbeat), makes sure no rank outlives it, and raises
:class:`WorkerGroupError`: the in-process run stops with it (``--resume`` continues),
and under Flower the client's reply is an error, a dropout for that round. The next
round starts a fresh group.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload
from fedexlora.run.layout import write_atomic

__all__ = [
    "WorkerGroup",
    "WorkerGroupError",
    "devices_error",
    "group_dir",
    "stop_groups",
    "update_for",
]

ENTRY = "fedexlora.run.worker_main"
HEARTBEAT_S = 1.0  # how often rank 0 writes its heartbeat
STALE_S = 60.0  # a heartbeat older than this: the group is hung or gone
START_TIMEOUT_S = float(os.environ.get("FEDEXLORA_WORKER_START_TIMEOUT", "600"))
IDLE_S = float(os.environ.get("FEDEXLORA_WORKER_IDLE", "600"))
POLL_S = 0.05

_STARTED: dict[Path, WorkerGroup] = {}  # groups this process launched (stopped at exit)


class WorkerGroupError(RuntimeError):
    """The worker group failed: a rank died, it hung, or it could not start.

    ``at_start`` says it never got ready (its launcher, the devices, a rank's set-up):
    running again does not help until that is fixed.
    """

    def __init__(self, message: str, *, at_start: bool = False):
        super().__init__(message)
        self.at_start = at_start


def workers_root() -> Path:
    """Where this node's worker groups live: ``FEDEXLORA_WORKERS_DIR``, or a temp folder."""
    env = os.environ.get("FEDEXLORA_WORKERS_DIR")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"fedexlora-workers-{os.getuid()}"


# settings that neither build a rank's model nor train it (each job carries the whole
# configuration): runs that differ only in them share a group
_NOT_FOR_RANKS = (
    "rounds", "secure_aggregation", "engine", "fraction", "weighting", "max_update_norm",
    "save_client_adapters", "keep_checkpoints", "report_to", "export", "export_format",
    "export_dtype", "allow_inexact", "eval_batch_size", "max_new_tokens", "num_beams",
)  # fmt: skip


def group_key(cfg: RunConfig, method: str) -> str:
    """The fingerprint a group serves: the configuration (not :data:`_NOT_FOR_RANKS`), method."""
    kept = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_FOR_RANKS}
    # as it acts: unset on a run, resolved in the config.toml its resume reads
    kept["fp32_side_branch"] = cfg.fp32_side_branch_resolved
    text = json.dumps({"cfg": kept, "method": method}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def group_dir(cfg: RunConfig, method: str) -> Path:
    """The ``JOBDIR`` of the group that serves ``cfg`` and ``method`` on this node."""
    return workers_root() / group_key(cfg, method)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg: RunConfig, jobdir: Path, port: int) -> list[str]:
    """The launcher's command line that starts the group's ``cfg.nproc_per_client`` ranks."""
    n = str(cfg.nproc_per_client)
    if cfg.launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", n]
        cmd += ["--num_machines", "1", "--main_process_port", str(port)]
        if cfg.accelerate_config is not None:  # the file says how (multi-GPU, its env)
            cmd += ["--config_file", str(Path(cfg.accelerate_config).expanduser())]
        else:  # accelerate's torchrun path (its --cpu would start one process); gloo on CPU
            cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
        return [*cmd, "--module", ENTRY, str(jobdir)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", n,
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
        "--monitor-interval", "0.5", "-m", ENTRY, str(jobdir),
    ]  # fmt: skip


def devices_error(cfg: RunConfig) -> str | None:
    """Why this node cannot give each of ``nproc_per_client`` ranks a device of its own.

    One rank per GPU (``--device cuda``, or ``auto`` with CUDA), or per CPU core this
    process may run on. More ranks than that do not train faster; each loads the model
    (a 200-rank group on a 2-core machine filled its memory).
    """
    n = cfg.nproc_per_client
    if n <= 1:
        return None
    import torch

    gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if gpu:
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        have, what = int(have or 1), "CPU cores"
    if n <= have:
        return None
    return (
        f"--nproc-per-client {n}: this machine has {have} {what}, one per process; use "
        f"--nproc-per-client {have} or less"
    )


class WorkerGroup:
    """The worker group of one configuration and method on this node (see the module).

    Args:
        cfg: The run configuration (``nproc_per_client`` ranks, ``distributed`` mode,
            ``launcher``).
        method: The method the group's model is built for.
        jobdir: Its folder (default :func:`group_dir`).
        owned: Whether a group it starts ends with this process (else with this process's
            parent, or its idle time).
    """

    def __init__(
        self, cfg: RunConfig, method: str, jobdir: Path | None = None, *, owned: bool = True
    ):
        self.cfg, self.method, self.owned = cfg, method, owned
        self.key = group_key(cfg, method)
        self.dir = Path(jobdir) if jobdir is not None else group_dir(cfg, method)
        self.proc: subprocess.Popen | None = None

    # -- what is on disk ------------------------------------------------------------
    def info(self) -> dict | None:
        """``group.json``: the launcher's pid, the fingerprint, who started it; or None."""
        try:
            return json.loads((self.dir / "group.json").read_text())
        except (OSError, ValueError):
            return None

    def rank_pids(self) -> list[int]:
        """The ranks' pids, as each rank wrote it."""
        out = []
        for p in sorted(self.dir.glob("rank-*.pid")):
            with contextlib.suppress(OSError, ValueError):
                out.append(int(p.read_text()))
        return out

    def launcher_pid(self) -> int | None:
        """The launcher's pid (``group.json``), or None."""
        info = self.info()
        return None if info is None else int(info["launcher_pid"])

    def problem(self) -> str | None:
        """Why the group cannot take a job (dead, stopped, stale, another config); or None."""
        info = self.info()
        if info is None:
            return "no group"
        if info.get("key") != self.key:
            return "a group of another configuration"
        pid = int(info["launcher_pid"])
        if self.proc is not None and self.proc.pid == pid:
            rc = self.proc.poll()
            if rc is not None:
                return f"its launcher exited with code {rc}"
        elif not _alive(pid):
            return "its launcher is gone"
        if (self.dir / "stop").exists():
            return "it was told to stop"
        beat = self.dir / "heartbeat"
        if (self.dir / "ready").exists() and beat.exists():
            age = time.time() - beat.stat().st_mtime
            if age > STALE_S:
                return f"its heartbeat is {age:.0f} s old"
        return None

    # -- life -----------------------------------------------------------------------
    def start(self) -> None:
        """Launches a fresh group in its own session and waits until its model is loaded.

        Raises:
            WorkerGroupError: If the launcher cannot be found, or the group dies or does
                not get ready within ``FEDEXLORA_WORKER_START_TIMEOUT`` seconds.
        """
        problem = devices_error(self.cfg)  # a node's own devices (checked before a run too)
        if problem is not None:
            raise WorkerGroupError(problem, at_start=True)
        for other in [g for d, g in _STARTED.items() if d != self.dir]:
            other.stop()  # one group per process: the previous method's is done
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "jobs").mkdir(parents=True)
        (self.dir / "results").mkdir()
        (self.dir / "data").mkdir()
        # in process: this process; a ClientApp (one process per message in a deployment):
        # its parent, the SuperNode's runtime (or Ray's worker in a simulation)
        owner = os.getpid() if self.owned else os.getppid()
        conf = {"cfg": self.cfg.to_dict(), "method": self.method, "owner_pid": owner}
        conf["idle_s"] = IDLE_S
        write_atomic(self.dir / "config.json", json.dumps(conf).encode())
        cmd = launch_command(self.cfg, self.dir, _free_port())
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        src = str(Path(__file__).resolve().parents[2])  # this very fedexlora, for the ranks
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        if self.cfg.device == "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        log = open(self.dir / "log", "ab")  # noqa: SIM115 (the launcher's, kept open)
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env, cwd=str(self.dir),
            )  # fmt: skip
        except OSError as exc:
            msg = f"cannot start the worker group ({cmd[2]}): {exc}"
            raise WorkerGroupError(msg, at_start=True) from exc
        finally:
            log.close()
        info = {"key": self.key, "launcher_pid": self.proc.pid, "nproc": self.cfg.nproc_per_client}
        info.update(launcher=self.cfg.launcher, started=time.time(), owner_pid=owner)
        write_atomic(self.dir / "group.json", json.dumps(info).encode())
        _STARTED[self.dir] = self
        if self.owned:
            _stop_on_sigterm()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.dir / "ready").exists():
            why = self.problem()
            if why is not None:
                self._fail(f"could not start: {why}", at_start=True)
            if time.monotonic() > deadline:
                self._fail(f"not ready after {START_TIMEOUT_S:.0f} s", at_start=True)
            time.sleep(POLL_S)

    def ensure(self) -> None:
        """Reuses this node's group if it is alive and of this configuration; else starts one."""
        if self.problem() is None and (self.dir / "ready").exists():
            return
        self.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Tells the group to stop, waits for its ranks to leave, and kills whatever is left.

        The launcher is not waited for once its ranks are gone: it has nothing left to do
        but its own interpreter's teardown (1.5 s measured on the 2-core dev machine).
        """
        if self.dir.exists() and self.info() is not None:
            with contextlib.suppress(OSError):
                write_atomic(self.dir / "stop", b"")
            deadline = time.monotonic() + timeout
            pid, ranks = self.launcher_pid(), self.rank_pids()
            while pid is not None and time.monotonic() < deadline:
                if self.proc is not None and self.proc.pid == pid:
                    if self.proc.poll() is not None:
                        break
                elif not _alive(pid):
                    break
                if ranks and not any(_alive(p) for p in ranks):
                    break
                time.sleep(POLL_S)
        self.kill()
        _STARTED.pop(self.dir, None)

    def kill(self) -> None:
        """SIGKILLs the launcher's process group and every rank (each has a session of its own)."""
        pids = self.rank_pids()
        launcher = self.launcher_pid() if self.dir.exists() else None
        if launcher is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(launcher, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        # SIGKILL is delivered, not yet acted on, when kill() returns: wait until the
        # launcher and every rank are gone (a zombie counts as gone)
        gone = [*pids, *([launcher] if launcher is not None else [])]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in gone) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _fail(self, why: str, *, at_start: bool = False):
        """Kills what is left of the group and raises :class:`WorkerGroupError`."""
        tail = ""
        errors = sorted(self.dir.glob("error-rank*.txt"))
        if errors:
            tail = errors[0].read_text().strip().splitlines()[-1]
        else:
            with contextlib.suppress(OSError):
                lines = (self.dir / "log").read_text(errors="replace").strip().splitlines()
                tail = next((ln for ln in reversed(lines) if ln.strip()), "")
        self.kill()
        _STARTED.pop(self.dir, None)
        n, how = self.cfg.nproc_per_client, self.cfg.launcher
        msg = f"the worker group ({how}, {n} processes, {self.dir}) {why}"
        raise WorkerGroupError(msg + (f"; last: {tail}" if tail else ""), at_start=at_start)

    # -- a round --------------------------------------------------------------------
    def run_job(self, job: dict, state: dict, data) -> tuple[dict, dict]:
        """Runs one job on every rank; ``(trained flat state, result)`` from rank 0.

        Raises:
            WorkerGroupError: If the group dies, hangs or reports an error.
        """
        from safetensors.torch import load_file, save_file

        with self._locked():
            self.ensure()
            jobs = self.dir / "jobs"
            seq = 1 + max((int(p.stem) for p in jobs.glob("*.json")), default=0)
            data_name = _write_data(self.dir, data)
            flat = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            tmp = jobs / f".{seq}.safetensors.tmp"
            save_file(flat, str(tmp))
            os.replace(tmp, jobs / f"{seq}.safetensors")
            write_atomic(jobs / f"{seq}.json", json.dumps({**job, "data": data_name}).encode())
            done = self.dir / "results" / f"{seq}.json"
            while not done.exists():
                why = self.problem()
                if why is not None:
                    r, c = job.get("round"), job.get("client")
                    self._fail(f"failed in round {r} (client {c}): {why}")
                time.sleep(POLL_S)
            result = json.loads(done.read_text())
            out = load_file(str(self.dir / "results" / f"{seq}.safetensors"))
            for p in (jobs / f"{seq}.safetensors", self.dir / "results" / f"{seq}.safetensors"):
                p.unlink(missing_ok=True)  # the JSON files stay: the sequence goes on
            return out, result

    @contextlib.contextmanager
    def _locked(self):
        """One job at a time per group (clients of one node share it)."""
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.dir.parent / f"{self.key}.lock", "w") as f:
            import fcntl  # POSIX: the group's lock (not imported with the package)

            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _write_data(jobdir: Path, data) -> str:
    """Writes a client's examples (once per content) beside the jobs; returns the file name."""
    fields = {"input_ids": data.input_ids, "labels": data.labels, "kind": data.kind}
    fields["pad_id"] = data.pad_id
    text = json.dumps(fields).encode()
    name = f"data-{hashlib.sha256(text).hexdigest()[:16]}.json"
    if not (jobdir / "data" / name).exists():
        write_atomic(jobdir / "data" / name, text)
    return name


def update_for(cfg: RunConfig, *, owned: bool = True) -> Callable[..., ClientUpload]:
    """A client's training step for ``cfg``, as :func:`fedexlora.run.client_step.local_update`.

    That function itself with ``nproc_per_client`` 1; else a step that hands the round to
    this node's worker group (started on first use, then kept across rounds).

    Args:
        cfg: The run configuration.
        owned: Whether the groups end with this process (the in-process engine); a Flower
            ClientApp passes False (each message may be a new process): its group ends
            with the ClientApp's parent, or its idle time.
    """
    from fedexlora.run.client_step import local_update

    if cfg.nproc_per_client == 1:
        return local_update
    return functools.partial(group_update, owned=owned)


def group_update(
    cfg: RunConfig,
    method: str,
    model,
    data,
    rnd: int,
    client: int,
    *,
    steps: int | None = None,
    progress: bool = False,
    dp=None,
    tokenizer=None,
    owned: bool = True,
) -> ClientUpload:
    """:func:`fedexlora.run.client_step.local_update`, trained by this node's worker group.

    The model (the coordinator's) is sent as :func:`fedexlora.bridge.steps.client_state`,
    trained on every rank, and loaded back from rank 0's result; the upload is built
    from it as one process builds it.

    Raises:
        WorkerGroupError: If the group fails (a rank died, it hung).
        ValueError: With a DP-SGD budget (a group trains without DP-SGD).
    """
    from fedexlora.bridge.adapters import set_state
    from fedexlora.bridge.steps import client_state
    from fedexlora.core.state import AdapterState
    from fedexlora.run.client_step import trained_upload

    del progress, tokenizer  # the ranks show no bars, and load their own tokenizer
    if dp is not None:
        raise ValueError("`nproc_per_client` > 1 cannot train with DP-SGD (a budget was given)")
    group = _STARTED.get(group_dir(cfg, method)) or WorkerGroup(cfg, method, owned=owned)
    job = {"method": method, "round": rnd, "client": client, "steps": steps}
    job["cfg"] = cfg.to_dict()  # the run's own settings (the group's may differ in a few)
    out, result = group.run_job(job, client_state(model), data)
    set_state(model, AdapterState.from_flat(out))
    return trained_upload(
        method, model, rnd, client, int(result["num_examples"]), float(result["loss"])
    )


def _stop_on_sigterm() -> None:
    """Makes SIGTERM end this process through its exit handlers, which stop its groups.

    By default SIGTERM ends Python at once, its ``atexit`` unrun: the group, in a session
    of its own, trained on orphaned until its job ended (21 s measured on a tiny model; a
    round on a large one). Only in the main thread, and where no handler is set.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def stop_groups(*, owned_only: bool = False) -> None:
    """Stops the groups this process started (``owned_only``: those that end with it)."""
    for group in list(_STARTED.values()):
        if group.owned or not owned_only:
            with contextlib.suppress(Exception):
                group.stop()


# a ClientApp's group outlives the message's process: the next message finds it
atexit.register(stop_groups, owned_only=True)
