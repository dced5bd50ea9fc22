"""``fedexlora run --engine flower``: the same job through Flower's simulation runtime.

:func:`run_flower_experiment` runs the ServerApp and ClientApp of this package the way
``flwr run`` does, Flower's supported entry point: it starts a private SuperLink in
simulation mode (``flower-superlink --simulation --isolation process``) and a SuperExec
(``flower-superexec``) on a free port of 127.0.0.1, writes a one-file app whose run
config is the run's settings, submits it with ``flwr run APP --stream``, and stops both
when the run ends. The SuperExec starts ``flwr-simulation``, which runs the ServerApp and
one virtual SuperNode per client on Ray. Every one of these processes is a child of the
caller, in its process group, so a kill of the group leaves none behind; Flower's own
state (``FLWR_HOME``) lives in a temporary directory and is removed afterwards. With the
same seeds and configuration the run reaches the in-process engine's global model (to
float rounding) and writes the same run directory.

Client resources on Ray come from ``client_cpus`` / ``client_gpus`` (or the environment
variables ``FEDEXLORA_CLIENT_CPUS`` / ``FEDEXLORA_CLIENT_GPUS``): Ray runs as many
ClientApp actors at once as the machine's CPUs and GPUs allow at that size, or as
``FEDEXLORA_RAY_CPUS`` (Ray's total CPUs) allows. By default one at a time per device
(:func:`client_resources`), each actor holding one model for the clients it serves.

Nothing leaves the machine (:data:`RAY_ENV`, :data:`FLOWER_ENV`, where the environment
does not already say otherwise): Ray binds to 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's single-machine mode) with its usage
statistics off (``RAY_USAGE_STATS_ENABLED=0``; ``1`` turns them back on), and Flower's
telemetry and update check are off. For a multi-machine Ray cluster set
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` and ``RAY_ADDRESS`` (Ray's own variable, which
its ``ray.init`` reads) to the cluster's address.

With the statistics off, Ray's daemons start with ``HOME`` pointing to a private
directory that holds a local-provider ``ray_bootstrap_config.yaml``: without one, Ray's
dashboard process asks the cloud metadata address 169.254.169.254 which cloud it runs on,
whatever the statistics setting. The ClientApps get the caller's ``HOME`` back
(:func:`restore_user_home`), and Hugging Face's cache stays the caller's (``HF_HOME``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from fedexlora.flower.records import to_run_config

__all__ = [
    "FLOWER_ENV",
    "RAY_ENV",
    "SEEDED_DP_CONSENT",
    "LocalSimulation",
    "client_resources",
    "federation_config",
    "restore_user_home",
    "run_flower_experiment",
    "simulation_backend",
]

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's single-machine mode (its default on macOS and Windows): every Ray process on
    # 127.0.0.1, and no probe of the network for the machine's address
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
"""Environment the Ray simulation starts with, where the caller's does not say otherwise."""

FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
"""Flower's own network calls, off where the caller's environment does not say otherwise."""

USER_HOME_VAR = "FEDEXLORA_USER_HOME"
"""Holds the caller's ``HOME`` while Ray's daemons run with a private one."""

APP_NAME = "fedexlora-simulation"
_CONNECTION = "fedexlora-simulation"
_BOOTSTRAP = "provider:\n  type: local\n"
SEEDED_DP_CONSENT = "FEDEXLORA_CLIENT_ALLOWS_SEEDED_DP"
"""The environment variable by which a node's operator consents to ``dp-reproducible``
(as the node config ``dp-reproducible=true`` does); ``fedexlora run --engine flower``
sets it for its own simulated clients."""


_START_TIMEOUT = float(os.environ.get("FEDEXLORA_SUPERLINK_START_TIMEOUT", "120"))


def restore_user_home() -> None:
    """Gives this process the caller's ``HOME`` back (a ClientApp under Ray; idempotent)."""
    home = os.environ.pop(USER_HOME_VAR, None)
    if home:
        os.environ["HOME"] = home


def _executable(name: str) -> str:
    """A Flower command from this interpreter's environment, else from PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        from fedexlora.run.layout import RunError

        raise RunError(
            f"{name!r} was not found next to {sys.executable} or on PATH; "
            "install Flower with: pip install 'fedex-lora[flower]'"
        )
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(procs: list[subprocess.Popen], wait: float = 15.0) -> None:
    """SIGTERM each process and everything below it, then SIGKILL what is left."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid, *_descendants(p.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        if sig == signal.SIGTERM:
            alive = []
            for pid in pids:
                try:
                    os.kill(pid, 0)
                    alive.append(pid)
                except OSError:
                    pass
            if not alive:
                return
            pids = alive


def _child_env(root: Path) -> dict[str, str]:
    """The environment of the SuperLink, the SuperExec and ``flwr run``."""
    env = dict(os.environ)
    for key, value in {**RAY_ENV, **FLOWER_ENV}.items():
        env.setdefault(key, value)
    env["FLWR_HOME"] = str(root / "flwr-home")
    # the generated app declares no dependencies; never run `uv sync` for it
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    # every process imports fedex-lora from where this one does
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        env.setdefault("HF_HOME", constants.HF_HOME)  # resolved against the real HOME
    return env


def _write_app(app_dir: Path, run_config: dict[str, Any]) -> None:
    """A Flower app of one ``pyproject.toml``: our ServerApp and ClientApp, this run's config."""
    import tomli_w

    app_dir.mkdir(parents=True)
    doc = {
        "project": {
            "name": APP_NAME,
            "version": "1.0.0",
            "description": "One fedexlora run --engine flower",
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "fedexlora",
                    "components": {
                        "serverapp": "fedexlora.flower.server_app:app",
                        "clientapp": "fedexlora.flower.client_app:app",
                    },
                    "config": run_config,
                }
            }
        },
    }
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(doc))


_BACKEND_KEYS = {
    "client_resources": {"num_cpus": "client-resources-num-cpus",
                         "num_gpus": "client-resources-num-gpus"},
    "init_args": {"num_cpus": "init-args-num-cpus", "num_gpus": "init-args-num-gpus",
                  "logging_level": "init-args-logging-level",
                  "log_to_driver": "init-args-log-to-driver"},
}  # fmt: skip


def federation_config(num_supernodes: int, backend: dict[str, Any]) -> str:
    """``flwr run --federation-config`` for a backend config Flower's runtime accepts.

    Raises:
        ValueError: For a key the simulation runtime cannot take (naming it).
    """
    pairs = [f"num-supernodes={int(num_supernodes)}"]
    for section, values in backend.items():
        known = _BACKEND_KEYS.get(section)
        if known is None:
            raise ValueError(
                f"backend_config: unknown section {section!r}; known: {sorted(_BACKEND_KEYS)}"
            )
        for key, value in (values or {}).items():
            if section == "init_args" and key == "include_dashboard":
                continue  # Flower's runtime never starts Ray's dashboard UI
            if key not in known:
                raise ValueError(
                    f"backend_config[{section!r}]: {key!r} cannot be passed to Flower's "
                    f"simulation runtime; it takes {sorted(known)} (a Ray cluster's "
                    "address goes in the RAY_ADDRESS environment variable)"
                )
            if key == "num_cpus":  # whole CPUs: an integer in Flower's federation config
                if isinstance(value, bool) or float(value) != int(float(value)) or value < 1:
                    raise ValueError(
                        f"backend_config[{section!r}]['num_cpus'] must be a whole number "
                        f">= 1 (Flower's simulation runtime takes whole CPUs), got {value!r}"
                    )
                value = int(value)
            text = ("true" if value else "false") if isinstance(value, bool) else value
            if isinstance(text, str) and section == "init_args" and key == "logging_level":
                text = f'"{text}"'
            pairs.append(f"{known[key]}={text}")
    return " ".join(pairs)


class LocalSimulation:
    """A private SuperLink (simulation mode) and SuperExec on 127.0.0.1, for one run.

    Both are children of this process and share its process group; :meth:`close` stops
    them and everything they started (``flwr-simulation`` and Ray).
    """

    def __init__(self, root: Path, private_home: Path | None):
        self.root = root
        self.port = _free_port()
        self.env = _child_env(root)
        (root / "flwr-home").mkdir(parents=True, exist_ok=True)
        (root / "flwr-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "{_CONNECTION}"\n\n[superlink.{_CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.exec_env = dict(self.env)
        if private_home is not None:  # Ray's daemons start below the SuperExec
            self.exec_env[USER_HOME_VAR] = os.environ.get("HOME", "")
            self.exec_env["HOME"] = str(private_home)
        self.procs: list[subprocess.Popen] = []

    def log(self, name: str) -> Path:
        """Where the process ``name`` (superlink, superexec) writes its output."""
        return self.root / f"{name}.log"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log(name), "wb") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root
            )
        self.procs.append(proc)
        return proc

    def start(self) -> LocalSimulation:
        """Starts the SuperLink, waits until it answers, then starts the SuperExec."""
        import httpx

        from fedexlora.run.layout import RunError

        address = f"127.0.0.1:{self.port}"
        superlink = self._spawn(
            "superlink",
            [_executable("flower-superlink"), "--insecure", "--simulation",
             "--isolation", "process", "--host", "127.0.0.1", "--port", str(self.port)],
            self.env,
        )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if superlink.poll() is not None:
                raise RunError(
                    f"the Flower SuperLink exited with code {superlink.returncode} at start: "
                    + _tail(self.log("superlink"))
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{address}/health", timeout=2).is_success:
                    break
            if time.monotonic() > deadline:
                raise RunError(
                    f"the Flower SuperLink did not answer on {address} within "
                    f"{_START_TIMEOUT:.0f} s (FEDEXLORA_SUPERLINK_START_TIMEOUT): "
                    + _tail(self.log("superlink"))
                )
            time.sleep(0.3)
        self._spawn(
            "superexec",
            [_executable("flower-superexec"), "--insecure", "--runtime-api-address", address,
             "--parent-pid", str(os.getpid())],
            self.exec_env,
        )  # fmt: skip
        return self

    def run(self, app_dir: Path, federation: str, write=None) -> tuple[int, list[str]]:
        """``flwr run APP --stream``; its output goes to ``write`` line by line."""
        write = write or sys.stdout.write
        tail: deque[str] = deque(maxlen=200)
        proc = subprocess.Popen(
            [_executable("flwr"), "run", str(app_dir), _CONNECTION, "--stream",
             "--federation-config", federation],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
            text=True, errors="replace", bufsize=1,
        )  # fmt: skip
        self.procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if not _expected(line):
                write(line)
        return proc.wait(), list(tail)

    def close(self) -> None:
        """Stops every process started here, and what they started."""
        _stop(list(reversed(self.procs)))


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    return " | ".join(text[-lines:]) if text else f"(empty log {path})"


# What Flower prints about choices made here on purpose (it prints each on every run)
_EXPECTED = (
    "Since flwr 1.32, default simulated SuperNodes",  # the count is always given
    "To change federation size",
    "flwr federation simulation-config",
    f"Successfully installed {APP_NAME} to",  # the generated app, in a temporary home
    "Manually terminating ClientAppActor",  # Ray's actors, stopped at the end of a run
)


def _expected(line: str) -> bool:
    return any(text in line for text in _EXPECTED)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _last_error(lines: list[str]) -> str:
    """The last line that names an exception or an error, without colour codes."""
    for line in reversed(lines):
        plain = _ANSI.sub("", line).strip()
        if re.search(r"(Error|Exception)\b.*:|\bERROR\b", plain):
            return plain
    return ""


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"environment variable {name} must be >= 0, got {raw!r}")
    return value


def client_resources(
    cfg, client_cpus: float | None = None, client_gpus: float | None = None
) -> dict[str, float]:
    """Ray resources of one ClientApp actor.

    Defaults: one ClientApp at a time per device, as the in-process engine trains its
    clients: on CPU one actor with every CPU Ray has (``FEDEXLORA_RAY_CPUS``, else the
    machine's), training with that many threads; on CUDA (``device`` cuda, or auto with a
    GPU) one actor per GPU, with the CPUs shared among the GPUs. Each concurrent actor
    holds its own model and training working set, about the in-process engine's whole
    memory (docs/BENCHMARKS.md, "Where a round's time goes"): give a smaller share
    (``client_cpus``, ``FEDEXLORA_CLIENT_CPUS``; ``client_gpus``,
    ``FEDEXLORA_CLIENT_GPUS``) to train several clients at once.
    """
    import torch

    from fedexlora.run.build import resolve_device

    cpus = client_cpus if client_cpus is not None else _env_float("FEDEXLORA_CLIENT_CPUS")
    gpus = client_gpus if client_gpus is not None else _env_float("FEDEXLORA_CLIENT_GPUS")
    cuda = resolve_device(cfg.device).type == "cuda"
    if gpus is None:
        gpus = 1.0 if cuda and torch.cuda.device_count() > 0 else 0.0
    if cpus is None:
        total = _ray_cpus() or os.cpu_count() or 1
        cpus = max(1, total // max(1, torch.cuda.device_count())) if gpus > 0 else total
    if cpus <= 0:
        raise ValueError(f"client CPUs must be > 0, got {cpus}")
    return {"num_cpus": cpus, "num_gpus": gpus}


def _ray_cpus() -> int | None:
    """``FEDEXLORA_RAY_CPUS``: the CPUs Ray may use (``None``: not set).

    Raises:
        ValueError: If it is not a whole number >= 1.
    """
    raw = os.environ.get("FEDEXLORA_RAY_CPUS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"environment variable FEDEXLORA_RAY_CPUS must be a whole number >= 1 "
            f"(the CPUs Ray may use), got {raw!r}"
        )
    return int(raw)


def simulation_backend(
    cfg, client_cpus: float | None = None, client_gpus: float | None = None
) -> dict[str, dict]:
    """The default backend config: :func:`client_resources`, and Ray's total CPUs.

    Ray takes every CPU of the machine unless ``FEDEXLORA_RAY_CPUS`` (whole CPUs, at
    least 1) caps it, for example on a shared machine: with ``FEDEXLORA_RAY_CPUS=1`` and
    one CPU per client, one ClientApp actor trains every client in turn.

    Raises:
        ValueError: If ``FEDEXLORA_RAY_CPUS`` is not a whole number >= 1.
    """
    backend: dict[str, dict] = {"client_resources": client_resources(cfg, client_cpus, client_gpus)}
    ray_cpus = _ray_cpus()
    if ray_cpus is not None:
        backend["init_args"] = {"num_cpus": ray_cpus}
    return backend


def run_flower_experiment(
    cfg,
    out_dir: str | Path,
    *,
    progress: bool = True,
    console=None,
    client_cpus: float | None = None,
    client_gpus: float | None = None,
    backend_config: dict[str, Any] | None = None,
    resume: bool = False,
) -> list[dict]:
    """Runs every method of ``cfg`` through Flower's simulation runtime.

    Args:
        cfg: A validated configuration (``engine`` is ignored).
        out_dir: The run directory (same layout as the in-process engine's).
        progress: Unused (clients train without progress bars); kept for the CLI.
        console: Unused: ``flwr run --stream`` writes the run's log to standard output.
        client_cpus: Ray CPUs per ClientApp actor (see :func:`client_resources`; Ray's
            total comes from ``FEDEXLORA_RAY_CPUS``, see :func:`simulation_backend`).
        client_gpus: Ray GPUs per ClientApp actor (fractions share a GPU).
        backend_config: Flower backend settings, replacing the above: what Flower's
            simulation runtime takes (``client_resources``: ``num_cpus``, ``num_gpus``;
            ``init_args``: ``num_cpus``, ``num_gpus``, ``logging_level``,
            ``log_to_driver``), see :func:`federation_config`.
        resume: Continue the run in ``out_dir`` from each method's last intact
            checkpoint. Clients find their state in ``out_dir/client-state`` (every
            client writes it there each round); one that cannot is re-synced from W0.

    Returns:
        All metrics rows, as written to ``metrics.jsonl``.

    Raises:
        ValueError: For a configuration the Flower engine cannot run (``centralized``)
            or a backend setting Flower's runtime cannot take.
        RunError: For a run directory that holds a run already (without ``resume``),
            none to resume, Flower that cannot start, or a run that wrote fewer rows
            than planned (its SuperLink and SuperExec logs are then kept in
            ``out_dir/flower-logs``).
    """
    del progress, console
    from fedexlora.run.layout import RunError, RunLayout
    from fedexlora.run.report import read_metrics
    from fedexlora.run.stopping import cell_done

    cfg = cfg.replace(engine="flower").validate()
    layout = RunLayout(Path(out_dir).resolve())
    out = layout.root
    if layout.holds_run() and not resume:
        raise RunError(
            f"--out {str(out)!r} already holds a run; pass --resume to continue it or "
            "choose another directory"
        )
    if resume and not layout.config.is_file():
        raise RunError(f"--resume: {str(out)!r} holds no run (no config.toml)")
    run_config = to_run_config(
        cfg,
        run_dir=str(out),
        min_train_nodes=1,
        min_available_nodes=cfg.num_clients,
        resume=str(out) if resume else "",
        client_state_dir=str(layout.client_state),
    )
    backend = backend_config or simulation_backend(cfg, client_cpus, client_gpus)
    federation = federation_config(cfg.num_clients, backend)
    root = Path(tempfile.mkdtemp(prefix="fedexlora-flower-"))
    private_home = None
    if os.environ.get("RAY_USAGE_STATS_ENABLED", RAY_ENV["RAY_USAGE_STATS_ENABLED"]) == "0":
        private_home = root / "ray-home"
        private_home.mkdir()
        (private_home / "ray_bootstrap_config.yaml").write_text(_BOOTSTRAP)
    _write_app(root / "app", run_config)
    sim = LocalSimulation(root, private_home)
    # the simulated clients are this user's own: their consent to seeded DP is the flag
    consent = {SEEDED_DP_CONSENT: "1"} if cfg.dp and cfg.dp_reproducible else {}
    saved = {k: os.environ.get(k) for k in consent}
    os.environ.update(consent)
    try:
        sim.start()
        code, tail = sim.run(root / "app", federation)
        rows = read_metrics(layout.metrics) if layout.metrics.is_file() else []
        want = cfg.rounds * len(cfg.methods)
        # every method's rounds, or fewer where the stopping rule stopped it
        if not cell_done(cfg, [r for r in rows if r["method"] in cfg.methods]):
            kept = layout.flower_logs
            kept.mkdir(parents=True, exist_ok=True)
            for name in ("superlink", "superexec"):
                with contextlib.suppress(OSError):
                    shutil.copy(sim.log(name), kept / f"{name}.log")
            error = _last_error(tail)
            raise RunError(
                f"the Flower simulation wrote {len(rows)} of {want} metrics rows, and not "
                "every method finished "
                f"(flwr run exited with {code})"
                + (f"; last error: {error}" if error else "")
                + f"; see the log above and {kept}"
            )
        _record_local_settings(cfg, layout)
        return rows
    finally:
        sim.close()  # every process below the SuperLink and SuperExec has stopped
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


def _record_local_settings(cfg, layout) -> None:
    """Writes into the run's ``config.toml`` what never travels to the ServerApp.

    The export settings concern the caller only (:data:`fedexlora.flower.records._LOCAL_ONLY`),
    so the ServerApp's ``config.toml`` lacks them; the run records them as the in-process
    engine's does, so that ``fedexlora export RUN DEST`` exports as the run asked.
    """
    from fedexlora.config import load_run_config
    from fedexlora.run.layout import write_atomic

    stored = load_run_config(layout.config)
    keys = ("export", "export_format", "export_dtype", "allow_inexact")
    write_atomic(layout.config, stored.replace(**{k: getattr(cfg, k) for k in keys}).to_toml())
