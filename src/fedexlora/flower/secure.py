"""Secure aggregation under Flower: SecAgg+'s stages as messages of the strategy's round.

:class:`fedexlora.flower.strategy.FedExLoRA` calls these when ``secure`` is on: stages 0
and 1 before its training messages go out (:func:`secure_keys`), stage 3 and the server's
round from the sums after the masked vectors are back (:func:`aggregate_secure`). The
protocol itself is :mod:`fedexlora.secagg`; this module only moves its messages. The
client's side is :class:`fedexlora.run.secure_client.SecureClient`, the in-process
engine's too.
Each function takes the strategy (``FedExLoRA``) and its round's ``RoundRecord``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedexlora.core.messages import RoundOutcome
from fedexlora.run.secure_client import clipped_warning

__all__ = ["aggregate_secure", "secure_exchange", "secure_keys"]


def secure_keys(strategy, grid: Grid, rec: Any, messages: list[Message]) -> list[Message]:
    """SecAgg+ stages 0 and 1; the payload messages, with stage 2's shares added."""
    from fedexlora.secagg.rounds import SecAggError, SecureRound

    by_pid = {int(m.content["config"]["partition-id"]): m for m in messages}
    strategy.received = []  # this round's only: a masked vector is large
    try:
        rec.secure = SecureRound(
            strategy.server.upload_template(rec.round),
            strategy.method,
            sorted(by_pid),
            seed=strategy.server.seed * 100_003 + rec.round,
            uniform=strategy.server.weighting == "uniform",
        )
        rec.secure.keys(lambda stage, msgs: secure_exchange(strategy, grid, rec, stage, msgs))
    except SecAggError as exc:
        rec.secure_error = str(exc)
        return []
    out = []
    for c, fields in rec.secure.collect().items():
        conf = by_pid[c].content["config"]
        conf["secagg-stage"] = "collect"
        for k, v in fields.items():
            conf[f"secagg.{k}"] = v
        out.append(by_pid[c])
    return out


def secure_exchange(
    strategy, grid: Grid, rec: Any, stage: str, msgs: Mapping[int, Mapping]
) -> dict[int, dict]:
    """One SecAgg+ stage: a message to each client, its reply's ``secagg.`` fields."""
    from fedexlora.secagg.traffic import protocol_nbytes

    by_partition = strategy.nodes.refresh(grid)
    out_msgs = []
    for c, fields in msgs.items():
        node = by_partition.get(c)
        if node is None:
            continue
        conf = ConfigRecord(
            {
                "secagg-stage": stage,
                "server-round": rec.round,
                "method": strategy.method,
                "partition-id": c,
                "fingerprint": strategy.fingerprint,
                "run-token": strategy.nodes.run_token,
                **{f"secagg.{k}": v for k, v in fields.items()},
            }
        )
        out_msgs.append(
            Message(
                RecordDict({"config": conf}),
                message_type=MessageType.TRAIN,
                dst_node_id=node,
                group_id=f"{rec.round}-{stage}",
            )
        )
    replies = {}
    for reply in grid.send_and_receive(out_msgs, timeout=strategy._timeout):
        c = strategy.nodes.partition_of.get(reply.metadata.src_node_id)
        if c is None or reply.has_error():
            if c is not None:
                rec.errors[c] = f"{stage}: {reply.error.reason}"
            continue
        conf = reply.content["config"]
        got = {k[len("secagg.") :]: v for k, v in conf.items() if k.startswith("secagg.")}
        strategy.received.append((stage, c, got))
        rec.bytes_up_protocol += protocol_nbytes(got)  # its keys and shares, as received
        replies[c] = got
    return replies


def aggregate_secure(strategy, replies: Iterable[Message], rec: Any) -> RoundOutcome:
    """Stage 2's masked vectors, then stage 3, then the server's round from the sums."""
    from fedexlora.secagg.rounds import SecAggError

    valid, failed = strategy._check_and_log_replies(replies, is_train=True, validate=False)
    for msg in failed:
        c = strategy.nodes.partition_of.get(msg.metadata.src_node_id)
        if c is not None:
            rec.errors[c] = msg.error.reason
    masked: dict[int, bytes] = {}
    for msg in valid:
        strategy._stop_on_check_failure(msg, rec)
        if strategy._dp_report(msg, rec):
            continue  # refused by its own budget: its masks are removed as a dropout's
        c = strategy.nodes.partition_of.get(msg.metadata.src_node_id)
        data = msg.content["config"].get("secagg.masked")
        if c in rec.sent and isinstance(data, bytes):
            masked[c] = data
            strategy.received.append(("collect", c, data))
    rec.bytes_up = sum(len(v) for v in masked.values())
    sums = None
    if rec.secure is not None and rec.secure_error is None:
        try:
            sums = rec.secure.finish(
                masked,
                lambda stage, msgs: secure_exchange(strategy, strategy._grid, rec, stage, msgs),
            )
        except SecAggError as exc:
            rec.secure_error = str(exc)
    survivors = sorted(rec.secure.session.survivors) if sums is not None else []
    reasons = rec.secure.dropped_reasons() if rec.secure is not None else {}
    for c in rec.sent:
        if c in survivors or c in rec.refused:
            continue
        rec.dropped.append(c)
        rec.errors.setdefault(c, reasons.get(c) or f"secure aggregation: {rec.secure_error}")
        # its base is unknown (it may never have got its payload): re-sync it from W0
        strategy.server.forget_client(c)
    rec.dropped.sort()
    for c, why in sorted(rec.errors.items()):
        warnings.warn(
            f"{strategy.method} round {rec.round}: client {c} dropped: {why}", stacklevel=1
        )
    if sums is not None and sums.clipped:
        warnings.warn(
            clipped_warning(strategy.method, rec.round, sums.clipped, rec.secure.quant.clip),
            stacklevel=1,
        )
    rejected = {c: rec.errors.get(c, "not in the secure sum") for c in rec.dropped}
    seconds = rec.secure.seconds if rec.secure is not None else 0.0
    return strategy.server.aggregate_secure(
        sums, survivors, rejected=rejected, protocol_seconds=seconds
    )
