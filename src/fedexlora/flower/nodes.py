"""Which Flower node holds which partition: asked of each new node once, per run.

:class:`NodeDirectory` sends one ``query`` message to every node it has not seen, checks
the reply against the run's configuration fingerprint, and keeps the partition each node
holds and the base versions it can continue from. The strategies of one run share it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

__all__ = ["NodeDirectory"]

_LOG_NODES = 20  # past this many new nodes at once, log a summary line


class NodeDirectory:
    """Which Flower node holds which partition, learned by asking each new node once.

    Shared by the strategies of one run, so later methods need not ask again.

    Args:
        num_partitions: The partitions the run expects (``num_clients``).
        fingerprint: The server's configuration fingerprint; a node whose ClientApp
            resolved another configuration is refused.
        timeout: Seconds to wait for the replies to one round of questions.
        run_token: The run's token (kept across resumes); clients report which base
            versions they hold under it.
    """

    def __init__(
        self,
        num_partitions: int,
        fingerprint: str = "",
        timeout: float = 600.0,
        run_token: str = "",
    ):
        self.num_partitions = num_partitions
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.run_token = run_token
        self.held: dict[int, dict[str, list[int]]] = {}  # partition -> method -> versions
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.refused: dict[int, str] = {}  # node id -> why its ClientApp cannot take part
        self.assigned: dict[int, int] = {}  # partition -> the node last used for it
        self.changed: list[int] = []  # partitions now held by another node than before
        self.own: set[int] = set()  # partitions whose node trains on its own data file

    def node_of(self, online: Iterable[int]) -> dict[int, int]:
        """Partition -> node among ``online``.

        A partition stays with the node last used for it while that node is online;
        otherwise the first online node that holds it takes it.
        """
        online = list(online)
        out = {p: n for p, n in self.assigned.items() if n in online}
        for node in online:
            p = self.partition_of.get(node)
            if p is not None and p not in out:
                out[p] = node
        return out

    def refresh(self, grid: Grid) -> dict[int, int]:
        """Asks every new online node for its partition; returns partition -> node.

        Raises:
            ValueError: If a node reports a problem (no partition in its node config, a
                configuration its ClientApp cannot resolve) or its ``num-partitions`` or
                configuration differs from the server's: such a federation cannot
                produce the run that was asked for.
        """
        online = list(grid.get_node_ids())
        new = [n for n in online if n not in self.partition_of and n not in self.refused]
        if new:
            questions = [
                Message(
                    RecordDict(
                        {
                            "config": ConfigRecord(
                                {"fingerprint": self.fingerprint, "run-token": self.run_token}
                            )
                        }
                    ),
                    message_type=MessageType.QUERY,
                    dst_node_id=n,
                )
                for n in new
            ]
            found = []
            for reply in grid.send_and_receive(questions, timeout=self.timeout):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    if node in new:  # the node's ClientApp refused: a configuration error
                        self.refused[node] = reply.error.reason
                        log(WARNING, "node %s cannot take part: %s", node, reply.error.reason)
                    else:  # made by the SuperLink (node unavailable...): ask again later
                        log(WARNING, "a node did not answer: %s", reply.error.reason)
                    continue
                conf = reply.content["config"]
                if conf.get("error"):
                    raise ValueError(f"SuperNode {node} cannot take part: {conf['error']}")
                pid, parts = int(conf["partition-id"]), int(conf["num-partitions"])
                if parts != self.num_partitions:
                    raise ValueError(
                        f"node {node} has num-partitions={parts}, but the run has "
                        f"num_clients={self.num_partitions}; start every SuperNode with "
                        f"--node-config 'partition-id=<i> num-partitions={self.num_partitions}'"
                    )
                if not 0 <= pid < parts:
                    raise ValueError(f"node {node} has partition-id={pid}, not in [0, {parts})")
                theirs = str(conf.get("fingerprint", ""))
                if self.fingerprint and theirs != self.fingerprint:
                    raise ValueError(
                        f"node {node} (partition {pid}) resolved another configuration "
                        f"(fingerprint {theirs!r}, server {self.fingerprint!r}); the "
                        "ClientApp and the ServerApp must share one run config and one "
                        "fedex-lora version (another version may hash the same settings "
                        "differently)"
                    )
                self.partition_of[node] = pid
                try:
                    self.held[pid] = json.loads(str(conf.get("held", "{}")))
                except ValueError:
                    self.held[pid] = {}
                found.append((node, pid))
                if conf.get("own-data"):  # its --node-config data=PATH, never seen here
                    self.own.add(pid)
            if len(found) <= _LOG_NODES:
                for node, pid in found:
                    own = " and trains on its own data file" if pid in self.own else ""
                    log(INFO, "node %s holds partition %s%s", node, pid, own)
            else:  # many virtual SuperNodes: one line, not one per node
                log(
                    INFO,
                    "%d nodes answered, holding %d partitions",
                    len(found),
                    len({p for _, p in found}),
                )
        now = self.node_of(online)
        self.changed = [p for p, n in now.items() if p in self.assigned and self.assigned[p] != n]
        self.assigned.update(now)
        return now
