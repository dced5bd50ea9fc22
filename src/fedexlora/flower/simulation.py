"""``fedexlora run --engine flower``: the same job through Flower's simulation runtime.

:func:`run_flower_experiment` runs the ServerApp and ClientApp of this package in
process with ``flwr.simulation.run_simulation`` (the Ray backend): one virtual SuperNode
per client, each holding its own model. With the same seeds and configuration it reaches
the in-process engine's global model (to float rounding) and writes the same run
directory.

Client resources on Ray come from ``client_cpus`` / ``client_gpus`` (or the environment
variables ``FEDEXLORA_CLIENT_CPUS`` / ``FEDEXLORA_CLIENT_GPUS``): Ray runs as many
ClientApp actors at once as the machine's CPUs and GPUs allow at that size.

Ray is started for this machine alone (:data:`RAY_ENV`, where the environment does not
already say otherwise): bound to 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's
single-machine mode), and with its usage statistics off (``RAY_USAGE_STATS_ENABLED=0``;
``1`` turns them back on). For a multi-machine Ray cluster set
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` and pass a full ``backend_config``, e.g.
``{"init_args": {"address": "auto"}, "client_resources": ...}``.

With the statistics off, Ray is started here (:func:`start_ray`) rather than by Flower,
so that its daemons find a local-provider ``ray_bootstrap_config.yaml`` in their home
directory: without one, Ray's dashboard process asks the cloud metadata address
169.254.169.254 which cloud it runs on, whatever the statistics setting. Ray's workers,
the ClientApps, get the caller's own ``HOME`` back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .records import to_run_config

__all__ = ["RAY_ENV", "client_resources", "run_flower_experiment", "start_ray"]

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's single-machine mode (its default on macOS and Windows): every Ray process on
    # 127.0.0.1, and no probe of the network for the machine's address
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
"""Environment the Ray simulation starts with, where the caller's does not say otherwise."""


def start_ray(init_args: dict[str, Any] | None = None) -> Path | None:
    """Starts Ray for the simulation, its daemons never probing the cloud metadata address.

    Ray's dashboard process (started even without the dashboard, for usage statistics)
    reads ``~/ray_bootstrap_config.yaml`` and, when there is none, asks 169.254.169.254
    and ``metadata.google.internal`` which cloud it is on, before it looks at whether
    statistics are on. Here Ray's daemons start with ``HOME`` set to a private directory
    that holds a one-line local-provider config, and every worker gets the caller's
    ``HOME`` (and ``sys.path``, as Flower passes it) back through the job's runtime env.

    Nothing is done when Ray is already running, or when the caller turned statistics on
    (``RAY_USAGE_STATS_ENABLED=1``: the probe is part of what they report): Flower then
    starts Ray as it always does.

    Returns:
        The private directory (remove it after ``ray.shutdown()``), or None.
    """
    import ray

    if ray.is_initialized() or os.environ.get("RAY_USAGE_STATS_ENABLED", "0") != "0":
        return None
    args = {"include_dashboard": False, **(init_args or {})}
    runtime_env = dict(args.pop("runtime_env", None) or {})
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    home = os.environ.get("HOME")
    env_vars = {"PYTHONPATH": pythonpath, **({"HOME": home} if home else {})}
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    private = Path(tempfile.mkdtemp(prefix="fedexlora-ray-home-"))
    (private / "ray_bootstrap_config.yaml").write_text("provider:\n  type: local\n")
    os.environ["PYTHONPATH"] = pythonpath  # as Flower's own Ray start does
    os.environ["HOME"] = str(private)
    try:
        ray.init(runtime_env=runtime_env, **args)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    finally:
        if home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = home
    return private


@contextlib.contextmanager
def _environment(defaults: dict[str, str]):
    """Sets each variable the environment does not set already; restores afterwards."""
    added = [k for k in defaults if k not in os.environ]
    os.environ.update({k: defaults[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


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

    Defaults: the machine's CPUs shared among the clients (at least one each); on CUDA
    (``device`` cuda, or auto with a GPU) the GPUs shared among the clients, else none.
    """
    import torch

    from ..engine import resolve_device

    cpus = client_cpus if client_cpus is not None else _env_float("FEDEXLORA_CLIENT_CPUS")
    gpus = client_gpus if client_gpus is not None else _env_float("FEDEXLORA_CLIENT_GPUS")
    if cpus is None:
        cpus = max(1, (os.cpu_count() or 1) // cfg.num_clients)
    if gpus is None:
        cuda = resolve_device(cfg.device).type == "cuda"
        gpus = min(1.0, torch.cuda.device_count() / cfg.num_clients) if cuda else 0.0
    if cpus <= 0:
        raise ValueError(f"client CPUs must be > 0, got {cpus}")
    return {"num_cpus": cpus, "num_gpus": gpus}


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
        console: A ``rich`` console for messages (plain ``print`` when ``None``).
        client_cpus: Ray CPUs per ClientApp actor (see :func:`client_resources`).
        client_gpus: Ray GPUs per ClientApp actor (fractions share a GPU).
        backend_config: A full Flower backend config, replacing the above.
        resume: Continue the run in ``out_dir`` from each method's last intact
            checkpoint. Clients find their state in ``out_dir/client-state`` (every
            client writes it there each round); one that cannot is re-synced from W0.

    Returns:
        All metrics rows, as written to ``metrics.jsonl``.

    Raises:
        ValueError: For a configuration the Flower engine cannot run (``centralized``),
            a run directory that holds a run already (without ``resume``), or none to
            resume.
    """
    del progress
    from ..pipeline import RunError
    from ..report import read_metrics
    from .client_app import make_client_app
    from .server_app import make_server_app

    cfg = cfg.replace(engine="flower").validate()
    out = Path(out_dir).resolve()
    held = (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0
    if held and not resume:
        raise RunError(
            f"--out {str(out)!r} already holds a run; pass --resume to continue it or "
            "choose another directory"
        )
    if resume and not (out / "config.toml").is_file():
        raise RunError(f"--resume: {str(out)!r} holds no run (no config.toml)")
    run_config = to_run_config(
        cfg,
        run_dir=str(out),
        min_train_nodes=1,
        min_available_nodes=cfg.num_clients,
        resume=str(out) if resume else "",
        client_state_dir=str(out / "client-state"),
    )
    say = console.print if console is not None else print
    backend = backend_config or {
        "client_resources": client_resources(cfg, client_cpus, client_gpus),
        "init_args": {"include_dashboard": False},
    }
    with _environment(RAY_ENV):
        from flwr.simulation import run_simulation  # Ray reads RAY_ENV when first imported

        private = start_ray(backend.get("init_args"))
        try:
            run_simulation(
                server_app=make_server_app(run_config, say=say),
                client_app=make_client_app(run_config),
                num_supernodes=cfg.num_clients,
                backend_config=backend,
            )
        finally:
            if private is not None:
                import ray

                ray.shutdown()  # Flower shuts Ray down too; this covers a failed start
                shutil.rmtree(private, ignore_errors=True)
    rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    want = cfg.rounds * len(cfg.methods)
    if len(rows) != want:
        raise RuntimeError(
            f"the Flower simulation wrote {len(rows)} of {want} metrics rows; see its log above"
        )
    return rows
