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

from fedexlora.core.aggregation import residuals_from_flat, residuals_to_flat
from fedexlora.core.state import AdapterState
from fedexlora.server.server import Server

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


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run.

    ``corrupt`` is true when the checkpoint itself is damaged (unreadable, incomplete),
    as opposed to intact but from another configuration: only then may a resume fall
    back to an older checkpoint.
    """

    def __init__(self, message: str, *, corrupt: bool = False):
        super().__init__(message)
        self.corrupt = corrupt


def _crash_point(step: str) -> None:
    """Called between the steps of :func:`save_checkpoint`; tests inject failures here."""


def config_fingerprint(cfg_dict: dict) -> str:
    """Hash of the settings that must not change across a resume."""
    from fedexlora.config import RESUME_SAFE

    stable = {k: v for k, v in sorted(cfg_dict.items()) if k not in RESUME_SAFE}
    if stable.get("double_quant") is False:  # added later: runs from before still resume
        del stable["double_quant"]
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: str | Path,
    server: Server,
    *,
    meta: dict,
    keep: int = 2,
    base: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes ``directory/round-XXXX`` atomically and keeps the last ``keep`` of them.

    Everything, ``base`` included (``base_deltas.safetensors``: what was folded into the
    model, see :func:`fedexlora.run.pipeline.base_deltas`), is written into a temporary
    directory that is renamed into place only when complete, and older checkpoints are
    pruned only after that, so a crash at any moment leaves the previous one intact.

    The tensors hold the global state, the accumulated base-weight deltas of the adapted
    layers (never a full model), the residual history and the lossy-mode feedback.
    ``meta`` (JSON) carries whatever the engine needs to resume: metrics so far, the
    partition assignment, the config fingerprint.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{server.round:04d}"
    tmp = root / f".tmp-round-{server.round:04d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    flat = {f"state.{k}": v for k, v in server.state.to_flat().items()}
    flat.update(residuals_to_flat("base_delta", server.base_delta))
    flat.update(residuals_to_flat("feedback", server.feedback))
    for v, res in server.history.items():
        flat.update(residuals_to_flat(f"history{v}", res))
    for c, res in server.remainder.items():  # heterogeneous ranks: T_c each client holds
        flat.update(residuals_to_flat(f"remainder{c}", res))
    flat = {k: t.detach().contiguous().clone() for k, t in flat.items()}
    save_file(flat, str(tmp / _TENSORS))
    _crash_point("tensors")
    if base is not None:
        save_file({k: v.detach().contiguous() for k, v in base.items()}, str(tmp / _BASE))
        _crash_point("base")
    info = {
        "format": _FORMAT,
        "round": server.round,
        "version": server.version,
        "method": server.method,
        "client_version": {str(k): v for k, v in server.client_version.items()},
        "history_versions": sorted(server.history),
        "remainder_clients": sorted(server.remainder),
        "last_sizes": {k: list(v) for k, v in server.last_sizes.items()},
        # what a complete checkpoint holds: checked by latest_checkpoint and the loader
        "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
        **meta,
    }
    (tmp / "meta.json").write_text(json.dumps(info, indent=1))
    _crash_point("meta")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    _crash_point("fsync")
    if final.exists():  # only an incomplete one: resume always continues the newest
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _crash_point("rename")
    done = [p for p in checkpoints(root) if p != final]
    for old in done[: max(len(done) - (keep - 1), 0)]:
        shutil.rmtree(old)
        _crash_point("prune")
    return final


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
    completely or not at all.

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
    if fingerprint is not None and info.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {str(p)!r} was written with another configuration or model "
            f"(fingerprint {info.get('fingerprint')!r}, this run {fingerprint!r})"
        )
    if info.get("method") != server.method:
        raise CheckpointError(
            f"checkpoint {str(p)!r} is for method {info.get('method')!r}, not {server.method!r}"
        )
    try:
        state = AdapterState.from_flat(
            {k[6:]: v for k, v in flat.items() if k.startswith("state.")}
        )
        restored = {
            "base_delta": residuals_from_flat("base_delta", flat),
            "feedback": residuals_from_flat("feedback", flat),
            "history": {
                int(v): residuals_from_flat(f"history{v}", flat) for v in info["history_versions"]
            },
            "remainder": {
                int(c): residuals_from_flat(f"remainder{c}", flat)
                for c in info.get("remainder_clients", [])
            },
            "round": int(info["round"]),
            "version": int(info["version"]),
            "client_version": {int(k): int(v) for k, v in info["client_version"].items()},
            # older checkpoints lack it: until the next round, payloads say keep
            "last_sizes": {k: (int(a), int(b)) for k, (a, b) in info.get("last_sizes", {}).items()},
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise corrupt(f"{type(exc).__name__}: {exc}") from None
    want = server.state.to_flat()
    got = state.to_flat()
    if set(want) != set(got) or any(tuple(want[k].shape) != tuple(got[k].shape) for k in want):
        raise CheckpointError(
            f"checkpoint {str(p)!r} does not match the model: its modules or shapes differ"
        )
    if set(restored["base_delta"]) - set(server.layers):
        raise CheckpointError(f"checkpoint {str(p)!r} has base deltas for unknown modules")
    server.state = state
    for key, value in restored.items():
        setattr(server, key, value)
    return info
