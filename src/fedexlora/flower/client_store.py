"""A Flower client's store: its node state (``Context.state``) over its state directory.

:class:`ContextStore` is the :class:`fedexlora.run.client_store.ClientStore` of a
ClientApp: what its :class:`fedexlora.run.client.Client` keeps between rounds goes to
the ``Context`` (which a deployment keeps per node and a simulation per partition), and
to the node's state directory where it has one (:class:`fedexlora.run.client_store.DiskStore`),
so that a resumed run (a new Flower run, a new Context) finds its clients where they
were. It keeps one base version in the Context (with a token naming it, which the
process's model cache checks) and the last two on disk, under the run's token.
"""

from __future__ import annotations

import json
import uuid

import torch
from flwr.app import ConfigRecord, Context

from fedexlora.flower.records import from_array_record, to_array_record
from fedexlora.run.client_store import DiskStore

__all__ = ["ContextStore", "held_versions"]

META = "fedexlora.meta"  # ConfigRecord: method, version (of the base held), token, run token
BASE = "fedexlora.client"  # ArrayRecord: the client's state (OwnModel.state)
DP = "fedexlora.dp"  # ConfigRecord: DP-SGD record per method, and the run token


class ContextStore:
    """One Flower client's store for one method of one run (see the module docstring).

    Args:
        context: The ClientApp's context.
        method: The method.
        run_token: The run's token (a state of another run is not this one's).
        disk: The node's state directory for this run and method, if it has one.
    """

    def __init__(self, context: Context, method: str, run_token: str, disk: DiskStore | None):
        self.context, self.method, self.run_token, self.disk = context, method, run_token, disk

    def held(self) -> int | None:
        """The base version its Context holds for this method and run, if any."""
        meta = self.context.state.get(META)
        if not isinstance(meta, ConfigRecord) or meta.get("method") != self.method:
            return None
        if meta.get("run-token", "") != self.run_token:
            return None
        return int(meta["version"])

    @property
    def token(self) -> str | None:
        """The token of the state its Context holds (the model cache's key)."""
        meta = self.context.state.get(META)
        return str(meta["token"]) if isinstance(meta, ConfigRecord) else None

    def load(self, client: int, version: int) -> dict[str, torch.Tensor] | None:
        """Its state after base ``version``: from the Context, else the state directory."""
        if self.held() == version:
            return from_array_record(self.context.state[BASE])
        return None if self.disk is None else self.disk.load(client, version)

    def save(self, client: int, version: int, flat: dict[str, torch.Tensor]) -> None:
        """Keeps its state in the Context (under a new token) and the state directory."""
        self.context.state[BASE] = to_array_record(flat)
        self.context.state[META] = ConfigRecord(
            {
                "method": self.method,
                "version": version,
                "token": uuid.uuid4().hex,
                "run-token": self.run_token,
            }
        )
        if self.disk is not None:
            self.disk.save(client, version, flat)

    def forget(self, client: int) -> None:
        """Drops its state from the Context and the state directory."""
        for key in (BASE, META):
            if key in self.context.state:
                del self.context.state[key]
        if self.disk is not None:
            self.disk.forget(client)

    def dp_record(self, client: int) -> dict:
        """Its DP-SGD record for this method and run: the Context's, else the disk's."""
        rec = self.context.state.get(DP)
        if (
            isinstance(rec, ConfigRecord)
            and rec.get("run-token", "") == self.run_token
            and self.method in rec
        ):
            return json.loads(str(rec[self.method]))
        return {} if self.disk is None else self.disk.dp_record(client)

    def save_dp_record(self, client: int, record: dict) -> None:
        """Keeps its DP-SGD record in the Context and the state directory."""
        rec = self.context.state.get(DP)
        if not isinstance(rec, ConfigRecord) or rec.get("run-token", "") != self.run_token:
            rec = ConfigRecord({"run-token": self.run_token})
        rec[self.method] = json.dumps(record)
        self.context.state[DP] = rec
        if self.disk is not None:
            self.disk.save_dp_record(client, record)


def held_versions(context: Context, root, token: str, pid: int) -> dict[str, list[int]]:
    """Method -> base versions a client can continue from (its Context and its disk).

    Args:
        context: Its context.
        root: Its state directory for the run ``token`` (``None``: none).
        token: The run's token.
        pid: Its partition.
    """
    out: dict[str, set[int]] = {}
    meta = context.state.get(META)
    if isinstance(meta, ConfigRecord) and meta.get("run-token", "") == token:
        out.setdefault(str(meta["method"]), set()).add(int(meta["version"]))
    if root is not None and root.is_dir():
        for folder in root.iterdir():
            versions = DiskStore(folder).versions(pid)
            if versions:
                out.setdefault(folder.name, set()).update(versions)
    return {m: sorted(v) for m, v in out.items()}
