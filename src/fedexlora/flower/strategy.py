"""The Flower strategy: transport only, over the shared :class:`fedexlora.server.Server`.

:class:`FedExLoRA` subclasses Flower's message-API ``FedAvg``. It overrides

- ``configure_train``: finds which node holds which partition (one ``query`` message per
  new node), samples partitions with ``Server.sample`` (seeded exactly as in-process)
  and sends every sampled client *its own* payload (``Server.payload_for``: global
  factors, head, and the residual since the base version that client holds);
- ``aggregate_train``: unpacks the replies into :class:`fedexlora.server.ClientUpload`
  and calls ``Server.aggregate``. No aggregation logic lives here.

Records, both ways: ``arrays`` (an ``ArrayRecord`` of ``Payload.to_flat()`` down,
``AdapterState.to_flat()`` up), ``config`` (a ``ConfigRecord``) and, up, ``metrics`` (a
``MetricRecord`` with ``num-examples`` and ``train-loss``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedexlora.core.messages import ClientUpload, RoundOutcome
from fedexlora.core.methods import method_names
from fedexlora.core.state import AdapterState
from fedexlora.flower.nodes import NodeDirectory
from fedexlora.flower.records import from_array_record, to_array_record
from fedexlora.server.server import Server

__all__ = ["FedExLoRA", "RoundRecord"]


# What Flower logs about choices this strategy makes on purpose: the server evaluates the
# global model itself, so there is no federated evaluation and no initial evaluation.
_EXPECTED = (
    "fraction_evaluate is set to 0.0",
    "Initial global evaluation results: None",
)


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_EXPECTED)


@contextlib.contextmanager
def _quiet_expected():
    """Drops :data:`_EXPECTED` from Flower's log while this strategy is in charge."""
    logger, flt = logging.getLogger("flwr"), _DropExpected()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@dataclass
class RoundRecord:
    """What one Flower round did, for the metrics row.

    Attributes:
        round: The round.
        sampled: Partitions sampled by the server.
        sent: Partitions that were sent a payload (sampled and connected).
        dropped: Sampled partitions whose upload never arrived (not connected, an error
            reply, or no reply within the timeout).
        uploads: The uploads received, sorted by client id.
        outcome: What ``Server.aggregate`` returned.
        bytes_down: Bytes of every payload tensor sent.
        bytes_down_max: Bytes of the largest payload one client received.
        bytes_up: Bytes of every upload tensor received.
        bytes_up_protocol: Bytes of the clients' SecAgg+ keys and shares (stages 0, 1, 3).
        started: ``time.perf_counter()`` when the round was configured.
        errors: Partition -> why its upload is missing.
        refused: Partitions that did not train: their DP budget would be exceeded (their
            own accounting says so).
        secure: The round's secure aggregation (:class:`fedexlora.secagg.rounds.SecureRound`),
            with secure aggregation on.
        secure_error: Why the round could not be aggregated securely, if it could not.
        client_seconds: Partition -> the seconds its reply says it spent
            (``{"train": ..., "setup": ...}``; none under DP-SGD or secure aggregation).
    """

    round: int
    sampled: list[int]
    sent: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    uploads: list[ClientUpload] = field(default_factory=list)
    outcome: RoundOutcome | None = None
    bytes_down: int = 0
    bytes_down_max: int = 0
    bytes_up_protocol: int = 0
    bytes_up: int = 0
    started: float = 0.0
    errors: dict[int, str] = field(default_factory=dict)
    refused: list[int] = field(default_factory=list)
    secure: Any = None
    secure_error: str | None = None
    client_seconds: dict[int, dict[str, float]] = field(default_factory=dict)

    def traffic(self, privacy: dict | None = None):
        """The round as every engine's loop reads it (:class:`fedexlora.run.rounds.RoundTraffic`).

        Args:
            privacy: The round's ``privacy`` report with DP-SGD (``None``: no DP).
        """
        from fedexlora.run.rounds import RoundTraffic

        return RoundTraffic(
            self.round, self.sampled, self.uploads, self.outcome, self.started, self.bytes_up,
            self.bytes_down, self.bytes_down_max, dropped=self.dropped, refused=self.refused,
            privacy=privacy, bytes_up_protocol=self.bytes_up_protocol,
        )  # fmt: skip


class FedExLoRA(FedAvg):
    """Flower strategy for FedEx-LoRA and its baselines over the shared server logic.

    Sampling, payloads, validation and aggregation are ``server``'s: this class only moves
    records. It supports every method of the registry whose spec runs on Flower
    (``method_names(flower=True)`` in :mod:`fedexlora.core.methods`); the centralized
    baseline has no clients and runs in-process only (``fedexlora run --engine local``).

    Args:
        server: The shared server (global state, residual history, client versions).
        nodes: The node directory (partition of each Flower node).
        fraction_train: Fraction of partitions sampled per round (``Server.sample``,
            seeded by round, identical to the in-process engine).
        min_train_nodes: The fewest uploads a round needs to be aggregated. With fewer,
            the round leaves the global model unchanged.
        min_available_nodes: Nodes to wait for before the first round (default: every
            partition).
        wait_timeout: Seconds to wait for ``min_available_nodes``; after that the run
            goes on if at least ``min_train_nodes`` nodes are there, else fails.
        fingerprint: Configuration fingerprint sent along; clients check it.
        weighted_by_key: The ``MetricRecord`` key holding each upload's example count.
        effective: Have the server compute each round's effective deviation from the new
            factors (``Server.aggregate``'s ``effective``). fedex-lora's ServerApp turns it
            off: it measures the deviation on the global model it folds into.
        secure: Secure aggregation (SecAgg+, :mod:`fedexlora.secagg`): every round runs
            its four stages, the uploads arrive masked, and the server aggregates their
            sum alone (``Server.aggregate_secure``). The replies the server receives in
            the round's stages are kept in :attr:`received` (stage, partition, content)
            until the next round.
        adapters_dir: Where each client saves the adapter it trained
            (``save_client_adapters``), sent along as ``adapters-dir``; ``""``: nowhere.

    A ``server`` restored from a checkpoint continues after its round: Flower's round 1
    is then the server's round ``server.round + 1``. Before its first round the strategy
    re-syncs from W0 every client that does not hold the base version the server
    expects (a client that lost its state with the run that crashed).
    """

    def __init__(
        self,
        server: Server,
        nodes: NodeDirectory,
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 1,
        min_available_nodes: int | None = None,
        wait_timeout: float = 600.0,
        fingerprint: str = "",
        weighted_by_key: str = "num-examples",
        effective: bool = True,
        secure: bool = False,
        adapters_dir: str = "",
    ) -> None:
        if not server.spec.flower:  # asked of the registry now: a method added later counts
            raise ValueError(
                f"the Flower engine supports methods {method_names(flower=True)}, got "
                f"{server.method!r}; the centralized baseline runs in-process only "
                "(--engine local)"
            )
        if min_train_nodes < 1:
            raise ValueError(f"`min_train_nodes` must be >= 1, got {min_train_nodes}")
        available = server.num_clients if min_available_nodes in (None, 0) else min_available_nodes
        with _quiet_expected():
            super().__init__(
                fraction_train=fraction_train,
                fraction_evaluate=0.0,  # the server evaluates the global model itself
                min_train_nodes=min_train_nodes,
                min_evaluate_nodes=0,
                min_available_nodes=available,
                weighted_by_key=weighted_by_key,
            )
        server.fraction = fraction_train
        self.server = server
        self.nodes = nodes
        self.wait_timeout = wait_timeout
        self.fingerprint = fingerprint
        self.effective = effective
        self.secure = secure
        self.adapters_dir = adapters_dir
        self.received: list[tuple[str, int, Any]] = []
        self._timeout: float | None = None
        self._grid: Grid | None = None
        self.current: RoundRecord | None = None
        self.offset = server.round  # rounds done before this strategy started
        self._waited = False
        # DP: each client's latest report of its own accounting (fedexlora.training.privacy.report)
        self.dp_reports: dict[int, dict] = {}
        # the partitions whose upload reached the server in this run (they have trained)
        self.trained: set[int] = set()

    @property
    def method(self) -> str:
        """The method this strategy runs."""
        return self.server.method

    def start(self, *args, **kwargs):
        """Flower's ``start``, without its notes on what this strategy does on purpose."""
        self._timeout = kwargs.get("timeout")
        with _quiet_expected():
            return super().start(*args, **kwargs)

    def train_round(self, grid: Grid, timeout: float | None = None) -> RoundRecord:
        """Carries the server's next round over ``grid``: sends, receives, aggregates.

        Flower's own loop (:meth:`start`) runs this strategy the same way, round by
        round; fedex-lora's ServerApp runs its rounds through the loop every engine shares
        (:func:`fedexlora.run.loop.run_rounds`), which calls this.

        Returns:
            What the round did (:attr:`current`).
        """
        self._timeout = timeout
        server_round = self.server.round + 1 - self.offset
        log(INFO, "")
        log(INFO, "[ROUND %s] %s", self.server.round + 1, self.method)
        with _quiet_expected():
            messages = self.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
            replies = grid.send_and_receive(messages, timeout=3600 if timeout is None else timeout)
            _, metrics = self.aggregate_train(server_round, replies)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
        return self.current

    def summary(self) -> None:
        """Logs the strategy's settings."""
        log(INFO, "\t├──> FedEx-LoRA strategy, method %s", self.method)
        log(INFO, "\t│\t├──Fraction of partitions per round: %.2f", self.fraction_train)
        log(INFO, "\t│\t├──Minimum uploads per round: %d", self.min_train_nodes)
        log(INFO, "\t│\t└──Nodes awaited before round 1: %d", self.min_available_nodes)
        log(INFO, "\t└──> Weighted by: '%s'", self.weighted_by_key)

    # -- configure ---------------------------------------------------------------
    def _wait_for_nodes(self, grid: Grid) -> dict[int, int]:
        deadline = time.monotonic() + self.wait_timeout
        while True:
            by_partition = self.nodes.refresh(grid)
            if len(by_partition) >= self.min_available_nodes:
                return by_partition
            if time.monotonic() > deadline:
                if len(by_partition) >= self.min_train_nodes:
                    log(
                        WARNING,
                        "only %d of %d nodes after %.0fs; going on",
                        len(by_partition),
                        self.min_available_nodes,
                        self.wait_timeout,
                    )
                    return by_partition
                refused = "; ".join(f"node {n}: {r}" for n, r in self.nodes.refused.items())
                raise RuntimeError(
                    f"only {len(by_partition)} of min_available_nodes="
                    f"{self.min_available_nodes} SuperNodes answered within "
                    f"{self.wait_timeout:.0f}s" + (f" ({refused})" if refused else "")
                )
            time.sleep(1.0)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled, connected partition, each with its own payload."""
        started = time.perf_counter()
        rnd = self.server.round + 1
        if server_round + self.offset != rnd:
            raise RuntimeError(f"Flower round {server_round} but server round {rnd}")
        if not self._waited:
            by_partition = self._wait_for_nodes(grid)
            self._waited = True
            for p in by_partition:
                expected = self.server.client_version.get(p)
                if expected is not None and expected not in self.nodes.held.get(p, {}).get(
                    self.method, []
                ):
                    log(INFO, "partition %s lost base version %s: re-sync from W0", p, expected)
                    self.server.forget_client(p)
        else:
            by_partition = self.nodes.refresh(grid)
        for p in self.nodes.changed:  # a new node (fresh state) now holds partition p
            self.server.forget_client(p)
        rec = RoundRecord(round=rnd, sampled=self.server.sample(rnd), started=started)
        messages = []
        for c in rec.sampled:
            node = by_partition.get(c)
            if node is None:
                rec.dropped.append(c)
                rec.errors[c] = "no connected SuperNode holds this partition"
                continue
            since = self.server.client_version.get(c)
            payload = self.server.payload_for(c)
            if payload.reset:
                since = None  # the client starts again from W0
            rec.bytes_down += payload.nbytes
            rec.bytes_down_max = max(rec.bytes_down_max, payload.nbytes)
            rec.sent.append(c)
            conf = ConfigRecord(
                {
                    "server-round": rnd,
                    "method": self.method,
                    "partition-id": c,
                    "version": payload.version,
                    "base-version": -1 if since is None else since,
                    "keep-state": payload.keep,
                    "fingerprint": self.fingerprint,
                    "run-token": self.nodes.run_token,
                    "adapters-dir": self.adapters_dir,
                    **self._dp_echo(c),
                }
            )
            content = RecordDict(
                {self.arrayrecord_key: to_array_record(payload.to_flat()), "config": conf}
            )
            messages.append(
                Message(
                    content, message_type=MessageType.TRAIN, dst_node_id=node, group_id=str(rnd)
                )
            )
        self.current = rec
        if self.secure:
            from fedexlora.flower.secure import secure_keys

            self._grid = grid
            messages = secure_keys(self, grid, rec, messages)
        log(
            INFO,
            "configure_train: %d of %d sampled partitions sent",
            len(rec.sent),
            len(rec.sampled),
        )
        return messages

    # -- personalized evaluation -------------------------------------------------
    def evaluate_personal(
        self, grid: Grid, clients: Iterable[int], timeout: float | None = None
    ) -> dict[int, tuple[dict[str, float], int]]:
        """Each client's own model on its own test split (a personalized method).

        Sends the global A and extras to every client in ``clients`` that a connected
        node holds; the client evaluates them with its own B and replies with its
        metrics and test-split size. A client that does not answer is left out.
        """
        state = self.server.upload_template(self.server.round)  # Ā and extras, no B
        by_partition = self.nodes.refresh(grid)
        messages = []
        for c in clients:
            node = by_partition.get(c)
            since = self.server.client_version.get(c)
            if node is None or since is None:
                continue
            conf = ConfigRecord(
                {
                    "server-round": self.server.round,
                    "method": self.method,
                    "partition-id": c,
                    "base-version": since,
                    "fingerprint": self.fingerprint,
                    "run-token": self.nodes.run_token,
                }
            )
            content = RecordDict(
                {self.arrayrecord_key: to_array_record(state.to_flat()), "config": conf}
            )
            messages.append(
                Message(
                    content,
                    message_type=MessageType.EVALUATE,
                    dst_node_id=node,
                    group_id=f"{self.server.round}-personal",
                )
            )
        out = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            c = self.nodes.partition_of.get(reply.metadata.src_node_id)
            conf = None if reply.has_error() else reply.content.get("config")
            if c is None or conf is None or "metrics" not in conf:
                why = reply.error.reason if reply.has_error() else "no metrics"
                warnings.warn(
                    f"{self.method}: no personal evaluation from client {c}: {why}", stacklevel=2
                )
                continue
            # JSON keeps the metrics' order (the headline metric first)
            metrics = {k: float(v) for k, v in json.loads(str(conf["metrics"])).items()}
            out[c] = (metrics, int(conf["test-examples"]))
        return out

    # -- aggregate ---------------------------------------------------------------
    def _upload(self, msg: Message) -> ClientUpload:
        node = msg.metadata.src_node_id
        c = self.nodes.partition_of.get(node)
        if c is None:
            raise ValueError(f"reply from unknown node {node}")
        content = msg.content
        claimed = int(content["config"]["partition-id"])
        if claimed != c:
            raise ValueError(f"node {node} holds partition {c} but replied as {claimed}")
        metrics = content["metrics"]
        num = metrics[self.weighted_by_key]
        state = AdapterState.from_flat(from_array_record(content[self.arrayrecord_key]))
        return ClientUpload(
            c,
            state,
            int(num) if float(num).is_integer() else num,
            float(metrics.get("train-loss", float("nan"))),
        )

    def _dp_echo(self, c: int) -> dict:
        """What client ``c`` last reported of its plan and steps, sent back to it.

        A client that lost its state continues from there, never from a new plan or zero.
        Under secure aggregation the server has no figures to send back: it says only
        whether ``c`` has trained in this run (:attr:`trained`), and a client that has
        but lost its record refuses to train.
        """
        if self.secure:  # no client's figures reach the server: it keeps its own record
            return {"dp-trained-before": 1} if c in self.trained else {}
        rep = self.dp_reports.get(c)
        if not rep:
            return {}
        return {
            "dp-steps": int(rep["steps"]),
            "dp-noise-multiplier": float(rep["noise_multiplier"]),
            "dp-sample-rate": float(rep["sample_rate"]),
            "dp-planned-steps": int(rep["planned_steps"]),
        }

    def _stop_on_check_failure(self, msg: Message, rec: RoundRecord) -> None:
        """Stops the run when a client reports a failed training check: never a silent round.

        (A DP-SGD round whose first step left a trainable parameter without per-sample
        gradients or unmoved would have trained nothing.)

        Raises:
            DPCheckError: With the client's own message.
        """
        conf = msg.content.get("config") if msg.has_content() else None
        error = str(conf.get("error", "")) if conf is not None else ""
        if error:
            from fedexlora.training.privacy import DPCheckError

            c = self.nodes.partition_of.get(msg.metadata.src_node_id)
            raise DPCheckError(
                f"{self.method} round {rec.round}: client {c} stopped the run: {error}"
            )

    def _dp_report(self, msg: Message, rec: RoundRecord) -> bool:
        """Records a reply's DP accounting; True when the client refused to train."""
        c = self.nodes.partition_of.get(msg.metadata.src_node_id)
        metrics = msg.content.get("metrics") if msg.has_content() else None
        if c is None or metrics is None:
            return False
        if "dp-epsilon" not in metrics:  # under secure aggregation: a refusal, no figures
            if int(metrics.get("dp-refused", 0)):
                rec.refused.append(c)
                return True
            return False
        keys = ("epsilon", "noise_multiplier", "sample_rate", "steps", "planned_steps")
        try:
            report = {k: float(metrics[f"dp-{k.replace('_', '-')}"]) for k in keys}
            report["max_grad_norm"] = float(metrics["dp-max-grad-norm"])
        except (KeyError, TypeError, ValueError) as exc:
            rec.errors[c] = f"malformed privacy report: {exc}"
            return True
        for k in ("steps", "planned_steps"):
            report[k] = int(report[k])
        self.dp_reports[c] = report
        if int(metrics.get("dp-refused", 0)):
            rec.refused.append(c)
            return True
        return False

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unpacks the replies and calls ``Server.aggregate``; returns the global state."""
        rec = self.current
        if rec is None or rec.round != server_round + self.offset:
            raise RuntimeError(f"aggregate_train for round {server_round} was not configured")
        if self.secure:
            from fedexlora.flower.secure import aggregate_secure

            rec.outcome = outcome = aggregate_secure(self, replies, rec)
            secure = outcome.secure or {}
            # uniform weighting hides the examples too: the sums hold no count (None)
            examples, loss = secure.get("num_examples"), secure.get("train_loss")
            metrics = MetricRecord(
                {
                    self.weighted_by_key: int(examples or 0),
                    "train-loss": float("nan") if loss is None else float(loss),
                    "dropped": len(rec.dropped),
                }
            )
            return to_array_record(self.server.state.to_flat()), metrics
        valid, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        uploads: dict[int, ClientUpload] = {}
        unmatched = []  # errors made by the SuperLink (e.g. node unavailable) name no node
        for msg in failed:
            c = self.nodes.partition_of.get(msg.metadata.src_node_id)
            if c is None:
                unmatched.append(msg.error.reason)
            else:
                rec.errors[c] = msg.error.reason
        for msg in valid:
            self._stop_on_check_failure(msg, rec)
            if self._dp_report(msg, rec):
                continue  # refused by its own budget: nothing to aggregate
            try:
                up = self._upload(msg)
            except (KeyError, TypeError, ValueError) as exc:
                c = self.nodes.partition_of.get(msg.metadata.src_node_id)
                if c is not None:
                    rec.errors[c] = f"malformed reply: {exc}"
                continue
            if up.client_id in rec.sent and up.client_id not in uploads:
                uploads[up.client_id] = up
                rec.client_seconds[up.client_id] = _client_seconds(msg.content["metrics"])
        ups = [uploads[c] for c in sorted(uploads)]  # the in-process engine's order
        rec.uploads = ups
        rec.bytes_up = sum(u.nbytes for u in ups)
        for c in rec.sent:
            if c not in uploads and c not in rec.refused:
                rec.dropped.append(c)
                why = unmatched.pop(0) if unmatched else "no reply within the round timeout"
                rec.errors.setdefault(c, why)
                self.server.forget_client(c)  # its base is unknown: re-sync it from W0
        rec.dropped.sort()
        for c, why in sorted(rec.errors.items()):
            warnings.warn(
                f"{self.method} round {rec.round}: client {c} dropped: {why}", stacklevel=1
            )
        if len(ups) < self.min_train_nodes:
            outcome = self.server.aggregate([], effective=self.effective)
            for u in ups:
                outcome.rejected[u.client_id] = (
                    f"round not aggregated: {len(ups)} upload(s), min_train_nodes="
                    f"{self.min_train_nodes}"
                )
        else:
            outcome = self.server.aggregate(ups, effective=self.effective)
        rec.outcome = outcome
        from fedexlora.run.rounds import train_loss

        accepted = [u for u in ups if u.client_id in outcome.accepted]
        metrics = MetricRecord(
            {
                self.weighted_by_key: sum(int(u.num_examples) for u in accepted),
                "train-loss": train_loss(ups, outcome),  # weighted as the rows' is
                "dropped": len(rec.dropped),
            }
        )
        return to_array_record(self.server.state.to_flat()), metrics


def _client_seconds(metrics) -> dict[str, float]:
    """A reply's ``seconds-*`` figures (training steps, set-up, when), bad ones dropped."""
    out = {}
    for part in ("train", "setup", "train-began", "train-ended"):
        value = metrics.get(f"seconds-{part}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[part] = float(value)
    return out
