"""Where a :class:`fedexlora.run.client.Client` keeps what it needs between rounds.

A store keeps, per client, two things: its *state* after a base version (flat tensors:
what its holder says it must keep, :meth:`fedexlora.run.client.SharedModel.state` or
:meth:`fedexlora.run.client.OwnModel.state`) and its own DP-SGD *record* (its plan and
the steps it has taken). Three stores, one protocol (:class:`ClientStore`):

- :class:`MemoryStore`: dicts in this process (the in-process engine); the run
  checkpoints it (``MethodRun.clients``, :meth:`MemoryStore.to_flat`).
- :class:`DiskStore`: a state directory, one folder per client: ``v<version>.safetensors``
  (the last two versions, written atomically) and ``dp.json``; a client finds it again
  after its process (or the whole run) died.
- Flower's node state (``Context.state``): :class:`fedexlora.flower.client_app.ContextStore`,
  over a :class:`DiskStore` where the node has a state directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["ClientStore", "DiskStore", "MemoryStore"]

KEEP_ON_DISK = 2  # base versions a client keeps on disk: a crash loses at most one round


class ClientStore(Protocol):
    """What a client keeps between rounds: its state per base version, its DP record."""

    def load(self, client: int, version: int) -> dict[str, torch.Tensor] | None:
        """Its state after base ``version``, or ``None`` when it holds none."""

    def save(self, client: int, version: int, flat: dict[str, torch.Tensor]) -> None:
        """Keeps its state after base ``version``."""

    def forget(self, client: int) -> None:
        """Drops its state (its next payload starts from W0)."""

    def dp_record(self, client: int) -> dict:
        """Its DP-SGD plan and steps taken (``{}``: none)."""

    def save_dp_record(self, client: int, record: dict) -> None:
        """Keeps its DP-SGD plan and steps taken."""


class MemoryStore:
    """In this process: client -> state, and client -> DP record.

    The in-process engine's holder keeps the same model for every client, so what a
    client keeps does not depend on the base version: :meth:`load` returns its last
    state whatever ``version`` asks (the shared model's base is the server's own).

    Args:
        states: Client -> its state as flat tensors (filled in; a resume passes it back).
        records: Client -> its DP-SGD record (filled in; a resume passes it back).
    """

    def __init__(self, states: dict | None = None, records: dict | None = None):
        self.states = {} if states is None else states
        self.records = {} if records is None else records

    def load(self, client: int, version: int) -> dict[str, torch.Tensor] | None:
        """Its last state (whatever ``version``: see the class)."""
        return self.states.get(client)

    def save(self, client: int, version: int, flat: dict[str, torch.Tensor]) -> None:
        """Keeps its state."""
        self.states[client] = flat

    def forget(self, client: int) -> None:
        """Drops its state."""
        self.states.pop(client, None)

    def dp_record(self, client: int) -> dict:
        """Its DP-SGD record, or ``{}``."""
        return dict(self.records.get(client, {}))

    def save_dp_record(self, client: int, record: dict) -> None:
        """Keeps its DP-SGD record."""
        self.records[client] = dict(record)

    def to_flat(self) -> dict[str, torch.Tensor]:
        """Every client's state and record as flat tensors (a checkpoint's ``clients``).

        ``<client>.<key>``: its state; ``<client>.dp.<field>``: its DP-SGD record (fp64).
        """
        from fedexlora.run.checkpoint import DP_PREFIX

        return {
            **{f"{c}.{k}": t for c, own in self.states.items() for k, t in own.items()},
            **{
                f"{c}.{DP_PREFIX}{k}": torch.tensor(v, dtype=torch.float64)
                for c, rec in self.records.items()
                for k, v in rec.items()
            },
        }

    @classmethod
    def from_flat(cls, flat: dict[str, torch.Tensor]) -> MemoryStore:
        """Back from :meth:`to_flat` (a resume)."""
        from fedexlora.run.checkpoint import DP_PREFIX

        store = cls()
        for key, t in flat.items():
            c, _, flat_key = key.partition(".")
            if flat_key.startswith(DP_PREFIX):  # its DP-SGD plan and steps
                store.records.setdefault(int(c), {})[flat_key.removeprefix(DP_PREFIX)] = t.item()
            else:
                store.states.setdefault(int(c), {})[flat_key] = t
        return store


class DiskStore:
    """A state directory: ``<root>/partition-<client>/v<version>.safetensors`` and ``dp.json``.

    Each state is written atomically (a temporary file, fsynced, renamed); the last
    :data:`KEEP_ON_DISK` versions are kept, so a crash while writing loses one round at
    most.

    Args:
        root: The directory (for a Flower client: its state directory, the run's token
            and the method).
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def folder(self, client: int) -> Path:
        """The client's own folder."""
        return self.root / f"partition-{client}"

    def versions(self, client: int) -> list[int]:
        """The base versions the client has a state for, oldest first."""
        folder = self.folder(client)
        if not folder.is_dir():
            return []
        return sorted(
            int(p.stem[1:]) for p in folder.glob("v*.safetensors") if p.stem[1:].isdigit()
        )

    def load(self, client: int, version: int) -> dict[str, torch.Tensor] | None:
        """Its state after base ``version``, or ``None``."""
        from safetensors.torch import load_file

        if version not in self.versions(client):
            return None
        return load_file(str(self.folder(client) / f"v{version}.safetensors"))

    def save(self, client: int, version: int, flat: dict[str, torch.Tensor]) -> None:
        """Writes its state for base ``version`` atomically; keeps the last ones."""
        from safetensors.torch import save_file

        folder = self.folder(client)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".v{version}.tmp"
        save_file({k: v.detach().contiguous().cpu() for k, v in flat.items()}, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"v{version}.safetensors")
        for old in self.versions(client)[:-KEEP_ON_DISK]:
            (folder / f"v{old}.safetensors").unlink(missing_ok=True)

    def forget(self, client: int) -> None:
        """Deletes its states (its DP record stays: a budget is never spent twice)."""
        for v in self.versions(client):
            (self.folder(client) / f"v{v}.safetensors").unlink(missing_ok=True)

    def dp_record(self, client: int) -> dict:
        """Its ``dp.json``, or ``{}``."""
        path = self.folder(client) / "dp.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def save_dp_record(self, client: int, record: dict) -> None:
        """Writes its ``dp.json`` atomically."""
        folder = self.folder(client)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".dp.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / "dp.json")
