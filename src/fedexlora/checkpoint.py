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

from .aggregation import residuals_from_flat, residuals_to_flat
from .server import Server
from .state import AdapterState

__all__ = [
    "CheckpointError",
    "config_fingerprint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_FORMAT = 1
_BASE = "base_deltas.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run."""


def config_fingerprint(cfg_dict: dict) -> str:
    """Hash of the settings that must not change across a resume."""
    volatile = {
        "rounds",
        "export",
        "export_format",
        "export_dtype",
        "allow_inexact",
        "keep_checkpoints",
        "save_client_adapters",
    }
    stable = {k: v for k, v in sorted(cfg_dict.items()) if k not in volatile}
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
    model, see :func:`fedexlora.pipeline.base_deltas`), is written into a temporary
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
    save_file(flat, str(tmp / "tensors.safetensors"))
    if base is not None:
        save_file({k: v.detach().contiguous() for k, v in base.items()}, str(tmp / _BASE))
    info = {
        "format": _FORMAT,
        "round": server.round,
        "version": server.version,
        "method": server.method,
        "client_version": {str(k): v for k, v in server.client_version.items()},
        "history_versions": sorted(server.history),
        "remainder_clients": sorted(server.remainder),
        **meta,
    }
    (tmp / "meta.json").write_text(json.dumps(info, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    done = sorted(p for p in root.glob("round-*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete ``round-XXXX`` checkpoint in ``directory``, or ``None``."""
    root = Path(directory)
    done = sorted(p for p in root.glob("round-*") if (p / "meta.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: str | Path, server: Server, *, fingerprint: str | None = None) -> dict:
    """Restores ``server`` from a checkpoint directory and returns its ``meta``.

    Raises:
        CheckpointError: If the checkpoint is unreadable, from another configuration, or
            does not match the server's modules and shapes. ``server`` is then untouched.
    """
    p = Path(path)
    try:
        info = json.loads((p / "meta.json").read_text())
        flat = load_file(str(p / "tensors.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(p)!r} is unreadable or corrupt: {exc}") from None
    if info.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {str(p)!r} has unknown format {info.get('format')!r}")
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
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {str(p)!r}: {exc}") from None
    want = server.state.to_flat()
    got = state.to_flat()
    if set(want) != set(got) or any(tuple(want[k].shape) != tuple(got[k].shape) for k in want):
        raise CheckpointError(
            f"checkpoint {str(p)!r} does not match the model: its modules or shapes differ"
        )
    base_delta = residuals_from_flat("base_delta", flat)
    if set(base_delta) - set(server.layers):
        raise CheckpointError(f"checkpoint {str(p)!r} has base deltas for unknown modules")
    server.state = state
    server.base_delta = base_delta
    server.feedback = residuals_from_flat("feedback", flat)
    server.history = {
        int(v): residuals_from_flat(f"history{v}", flat) for v in info["history_versions"]
    }
    server.remainder = {
        int(c): residuals_from_flat(f"remainder{c}", flat)
        for c in info.get("remainder_clients", [])
    }
    server.round = int(info["round"])
    server.version = int(info["version"])
    server.client_version = {int(k): int(v) for k, v in info["client_version"].items()}
    return info
