"""Checkpoints of the server state: safetensors + JSON, written atomically. No pickle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fedexlora.config import ADDED_LATER, RESUME_SAFE, RunConfig
from fedexlora.server.server import Server
from fedexlora.server.snapshot import STATE_KEYS, ServerStateMismatch

__all__ = [
    "CheckpointError",
    "config_fingerprint",
    "checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_FORMAT = 1
BASE_DELTAS = "base_deltas.safetensors"  # a checkpoint's accumulated residuals
_BASE = BASE_DELTAS
_TENSORS = "tensors.safetensors"
# In-process runs of a method whose clients keep something of their own (FedSA-LoRA's
# B), or with DP-SGD: the simulated clients' state, "<client>.<module>" -> tensor, and
# "<client>.dp.<field>" -> their own accounting (plan and steps)
CLIENTS = "clients.safetensors"
DP_PREFIX = "dp."
# What meta.json holds of Server.state_dict() (its tensors are in _TENSORS), and what
# stands for a key in checkpoints written before it existed (without last_sizes,
# payloads say keep until the next round; without sent_clients, heterogeneous views are
# rebuilt when each client is next sampled).
_SERVER_KEYS = tuple(k for k in STATE_KEYS if k != "tensors")
_SERVER_DEFAULTS = {
    "remainder_clients": [],
    "last_sizes": {},
    "sent_clients": [],
    "client_rank": {},
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run.

    ``corrupt`` is true when the checkpoint itself is damaged (unreadable, incomplete),
    as opposed to intact but from another configuration: only then may a resume fall
    back to an older checkpoint.
    """

    def __init__(self, message: str, *, corrupt: bool = False):
        super().__init__(message)
        self.corrupt = corrupt


def config_fingerprint(cfg: RunConfig | dict) -> str:
    """Hash of the settings that must not change across a resume.

    Args:
        cfg: A run config, hashed as it runs (:meth:`RunConfig.resolved`), or the dict of
            one as a checkpoint stored it.
    """
    cfg_dict = cfg.resolved().to_dict() if isinstance(cfg, RunConfig) else cfg
    # methods: each has its own checkpoints, and its rounds do not depend on the others
    # (``fedexlora compare`` adds a method to a cell by a resume)
    stable = {k: v for k, v in sorted(cfg_dict.items()) if k not in RESUME_SAFE and k != "methods"}
    for key, default in ADDED_LATER.items():  # at its default: runs from before still resume
        if key in stable and stable[key] == default:
            del stable[key]
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def _same_config(info: dict, fingerprint: str) -> bool:
    """Whether a checkpoint's meta is of this configuration.

    Its fingerprint, or that of the configuration it stored, hashed as today: a run from
    before a setting was added stored a fingerprint that still counted its default.
    """
    if info.get("fingerprint") == fingerprint:
        return True
    stored = info.get("config")
    return isinstance(stored, dict) and config_fingerprint(stored) == fingerprint


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(directory: Path) -> None:
    """Flushes every file in ``directory`` to disk, then the directory itself."""
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(directory)


def save_checkpoint(
    directory: str | Path,
    server: Server,
    *,
    meta: dict,
    keep: int = 2,
    base: dict[str, torch.Tensor] | None = None,
    clients: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes ``directory/round-XXXX`` atomically and keeps the last ``keep`` of them.

    Everything, ``base`` included (``base_deltas.safetensors``: what was folded into the
    model, see :func:`fedexlora.run.restore.base_deltas`), is written into a temporary
    directory that is renamed into place only when complete, and older checkpoints are
    pruned only after that, so a crash at any moment leaves the previous one intact.

    The server is saved through :meth:`~fedexlora.server.Server.state_dict`: its tensors
    (the global state, the accumulated base-weight deltas of the adapted layers, never a
    full model, the residual history, the lossy-mode feedback) go to
    ``tensors.safetensors``, the rest to ``meta.json``. ``meta`` (JSON, beside the
    server's keys) carries whatever the engine needs to resume: metrics so far, the
    partition assignment, the config fingerprint. ``clients`` (``clients.safetensors``)
    is what the in-process engine's simulated clients keep of their own, if anything.

    Raises:
        ValueError: If ``meta`` uses a key of the checkpoint's own.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{server.round:04d}"
    tmp = root / f".tmp-round-{server.round:04d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    server_state = server.state_dict()
    tensors = server_state.pop("tensors")
    clash = sorted(set(meta) & ({"format", "files", "digests"} | set(server_state)))
    if clash:
        raise ValueError(f"meta must not use the checkpoint's own keys {clash}")
    save_file(tensors, str(tmp / _TENSORS))
    if base is not None:
        save_file({k: v.detach().contiguous() for k, v in base.items()}, str(tmp / _BASE))
    if clients:
        save_file({k: v.detach().contiguous() for k, v in clients.items()}, str(tmp / CLIENTS))
    info = {
        "format": _FORMAT,
        **server_state,
        # what a complete checkpoint holds: checked by latest_checkpoint and the loader
        "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
        # and their bytes: bit rot keeps a file's size (checked when it is loaded)
        "digests": {f.name: _digest(f) for f in sorted(tmp.iterdir())},
        **meta,
    }
    (tmp / "meta.json").write_text(json.dumps(info, indent=1))
    _fsync_all(tmp)
    if final.exists():  # only an incomplete one: resume always continues the newest
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    done = [p for p in checkpoints(root) if p != final]
    for old in done[: max(len(done) - (keep - 1), 0)]:
        shutil.rmtree(old)
    return final


def _digest(path: Path) -> str:
    """BLAKE2b of a file's bytes (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def _rotten(path: Path, info: dict) -> str | None:
    """The first file whose bytes are not the ones written, or ``None``.

    Checkpoints written before digests existed have none to check.
    """
    digests = info.get("digests")
    if not isinstance(digests, dict):
        return None
    for name, want in digests.items():
        try:
            if _digest(path / name) != want:
                return name
        except OSError:
            return name
    return None


def checkpoints(directory: str | Path) -> list[Path]:
    """The complete ``round-XXXX`` checkpoints in ``directory``, oldest first.

    Complete means that ``meta.json`` parses and every file it lists is there with its
    size; a directory a crash or a disk error left half-written is skipped.
    """
    root = Path(directory)
    return sorted(p for p in root.glob("round-*") if p.is_dir() and _complete(p))


def _complete(path: Path) -> bool:
    try:
        info = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    files = info.get("files") if isinstance(info, dict) else None
    if not isinstance(files, dict):  # written before manifests: needs its tensors at least
        return (path / _TENSORS).is_file()
    try:
        return all((path / n).stat().st_size == size for n, size in files.items())
    except OSError:
        return False


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete ``round-XXXX`` checkpoint in ``directory``, or ``None``."""
    done = checkpoints(directory)
    return done[-1] if done else None


def load_checkpoint(path: str | Path, server: Server, *, fingerprint: str | None = None) -> dict:
    """Restores ``server`` from a checkpoint directory and returns its ``meta``.

    Everything is read and checked before the server is touched: it is restored
    completely or not at all, by :meth:`~fedexlora.server.Server.load_state_dict`.

    Raises:
        CheckpointError: If the checkpoint is unreadable or incomplete (``corrupt``), from
            another configuration, or does not match the server's modules and shapes.
            ``server`` is then untouched.
    """
    p = Path(path)

    def corrupt(why) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(p)!r} is unreadable or corrupt: {why}", corrupt=True
        )

    try:
        info = json.loads((p / "meta.json").read_text())
        flat = load_file(str(p / _TENSORS))
    except (OSError, json.JSONDecodeError, SafetensorError, UnicodeDecodeError) as exc:
        raise corrupt(exc) from None
    if not isinstance(info, dict) or info.get("format") != _FORMAT:
        got = info.get("format") if isinstance(info, dict) else info
        raise CheckpointError(f"checkpoint {str(p)!r} has unknown format {got!r}", corrupt=True)
    if not _complete(p):
        raise corrupt("a file it lists is missing or has the wrong size")
    rotten = _rotten(p, info)
    if rotten is not None:
        raise corrupt(f"{rotten} does not hold the bytes written (its digest differs)")
    if fingerprint is not None and not _same_config(info, fingerprint):
        raise CheckpointError(
            f"checkpoint {str(p)!r} was written with another configuration or model "
            f"(fingerprint {info.get('fingerprint')!r}, this run {fingerprint!r})"
        )
    if info.get("method") != server.method:
        raise CheckpointError(
            f"checkpoint {str(p)!r} is for method {info.get('method')!r}, not {server.method!r}"
        )
    server_state = {**_SERVER_DEFAULTS, **{k: info[k] for k in _SERVER_KEYS if k in info}}
    try:
        server.load_state_dict({**server_state, "tensors": flat}, assign=True)
    except ServerStateMismatch as exc:
        raise CheckpointError(f"checkpoint {str(p)!r} does not match the model: {exc}") from None
    except ValueError as exc:
        raise corrupt(exc) from None
    return info
