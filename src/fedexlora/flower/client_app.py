"""The Flower ClientApp: one client's local step, over the shared training code.

Every client really holds its own model. It applies each payload to it with
:func:`fedexlora.steps.apply_payload` (the residual folded into its own base, or its side
branch, then the global factors loaded), trains with
:func:`fedexlora.engine.local_update` (seeded by :func:`fedexlora.engine.client_seed`
exactly as in-process) and replies with its upload.

What a client must remember between rounds (what was folded into its base: the fp32
weights of its adapted layers, or their side branches for a half-precision or quantized
base, and its adapter) lives in the Flower ``Context`` (``context.state``): in a
deployment each message runs in a fresh ClientApp process, and in a simulation a partition
may land on another Ray actor. A small per-process cache skips rebuilding the model when
the same process serves the same partition again.

Configuration comes from the run config (``context.run_config``); the partition comes
from the node config (``partition-id``, ``num-partitions``).
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .records import from_array_record, resolve_run_config, to_array_record

__all__ = ["app", "make_client_app"]

_META = "fedexlora.meta"  # ConfigRecord: method, version (of the base held), token
_BASE = "fedexlora.client"  # ArrayRecord: fedexlora.steps.client_state(model)

_DATA: dict[str, tuple] = {}  # config fingerprint -> (task, Prepared), one entry
_MODELS: OrderedDict[tuple, tuple] = OrderedDict()  # (run, partition) -> (token, model)
# Models kept per process (FEDEXLORA_CLIENT_MODEL_CACHE; 0 rebuilds every round from the
# Context, as a deployment's fresh ClientApp process does).
_MAX_MODELS = int(os.environ.get("FEDEXLORA_CLIENT_MODEL_CACHE", "4"))


def _resolve(defaults: Mapping[str, Any], context: Context):
    from ..checkpoint import config_fingerprint

    cfg, _ = resolve_run_config({**defaults, **dict(context.run_config)})
    return cfg, config_fingerprint(cfg.to_dict())


def _partition(context: Context, num_clients: int) -> int:
    conf = context.node_config
    if "partition-id" not in conf or "num-partitions" not in conf:
        raise ValueError(
            "this SuperNode has no partition: start it with --node-config "
            f"'partition-id=<i> num-partitions={num_clients}'"
        )
    pid, parts = int(conf["partition-id"]), int(conf["num-partitions"])
    if parts != num_clients:
        raise ValueError(f"node config num-partitions={parts} but the run has {num_clients}")
    if not 0 <= pid < parts:
        raise ValueError(f"node config partition-id={pid} is not in [0, {parts})")
    return pid


def _task_and_data(cfg, fingerprint: str, method: str):
    """The task and prepared data (cached per process); a fresh model when just loaded."""
    from ..engine import new_model, prepare
    from ..pipeline import load_task_for

    hit = _DATA.get(fingerprint)
    if hit is not None:
        return hit[0], hit[1], None
    task = load_task_for(cfg)
    model, tokenizer = new_model(cfg, task, method)
    prep = prepare(cfg, tokenizer, task)
    _DATA.clear()
    _DATA[fingerprint] = (task, prep)
    return task, prep, model


def _held(context: Context, method: str) -> int | None:
    meta = context.state.get(_META)
    if not isinstance(meta, ConfigRecord) or meta.get("method") != method:
        return None
    return int(meta["version"])


def _client_model(cfg, task, method: str, context: Context, pid: int, since: int, spare):
    """The client's model holding base version ``since`` (``-1``: the pretrained W0)."""
    from ..engine import new_model
    from ..steps import load_client_state

    if since < 0:  # a new (or re-synced) client starts from the pretrained weights
        return spare if spare is not None else new_model(cfg, task, method)[0]
    held = _held(context, method)
    if held != since:
        raise ValueError(
            f"partition {pid} holds base version {held} for {method}, but the payload "
            f"is relative to version {since}; the server re-syncs this client from W0 "
            "next time it is sampled"
        )
    token = context.state[_META]["token"]
    key = (context.run_id, pid)
    cached = _MODELS.pop(key, None)  # taken: if training fails, it is not reused
    if cached is not None and cached[0] == token:
        return cached[1]
    model = spare if spare is not None else new_model(cfg, task, method)[0]
    load_client_state(model, from_array_record(context.state[_BASE]))
    return model


def _remember(context: Context, model, method: str, version: int, pid: int) -> None:
    from ..steps import client_state

    token = uuid.uuid4().hex
    context.state[_BASE] = to_array_record(client_state(model))
    context.state[_META] = ConfigRecord({"method": method, "version": version, "token": token})
    key = (context.run_id, pid)
    _MODELS[key] = (token, model)
    _MODELS.move_to_end(key)
    while len(_MODELS) > max(_MAX_MODELS, 0):
        _MODELS.popitem(last=False)


def train_step(msg: Message, context: Context, defaults: Mapping[str, Any]) -> Message:
    """Applies the payload of ``msg`` to this client's model, trains, and replies.

    Raises:
        ValueError: If the client's configuration or partition does not match the
            server's, or it does not hold the base version the payload builds on.
    """
    from ..engine import local_update
    from ..server import Payload
    from ..steps import apply_payload

    cfg, fingerprint = _resolve(defaults, context)
    conf = msg.content["config"]
    theirs = str(conf.get("fingerprint", ""))
    if theirs and theirs != fingerprint:
        raise ValueError(
            f"this ClientApp resolved another configuration (fingerprint {fingerprint!r}) "
            f"than the server ({theirs!r}); both must share one run config"
        )
    pid = _partition(context, cfg.num_clients)
    if int(conf["partition-id"]) != pid:
        raise ValueError(f"payload for partition {conf['partition-id']}, this node holds {pid}")
    method, rnd = str(conf["method"]), int(conf["server-round"])
    version, since = int(conf["version"]), int(conf["base-version"])
    task, prep, spare = _task_and_data(cfg, fingerprint, method)
    model = _client_model(cfg, task, method, context, pid, since, spare)
    payload = Payload.from_flat(
        from_array_record(msg.content["arrays"]), round=rnd, version=version
    )
    apply_payload(model, payload, side_rank=cfg.side_rank)
    up = local_update(cfg, method, model, prep.train.subset(prep.parts[pid]), rnd, pid)
    _remember(context, model, method, version, pid)
    content = RecordDict(
        {
            "arrays": to_array_record(up.state.to_flat()),
            "metrics": MetricRecord(
                {"num-examples": int(up.num_examples), "train-loss": float(up.train_loss)}
            ),
            "config": ConfigRecord({"partition-id": pid, "server-round": rnd, "method": method}),
        }
    )
    return Message(content, reply_to=msg)


def make_client_app(defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """A ClientApp; ``defaults`` fill in run-config keys the context does not set.

    ``flwr run`` gives the app its run config; ``flwr.simulation.run_simulation`` gives
    none, so :func:`fedexlora.flower.simulation.run_flower_experiment` bakes it in here.
    """
    base = dict(defaults or {})
    client = ClientApp()

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        """Tells the server this node's partition and config fingerprint, or what is wrong.

        Problems are reported, not raised, so that the server can stop the run at once
        with a message naming this node.
        """
        conf = context.node_config
        record = ConfigRecord(
            {
                "partition-id": int(conf.get("partition-id", -1)),
                "num-partitions": int(conf.get("num-partitions", -1)),
                "fingerprint": "",
                "error": "",
            }
        )
        try:
            cfg, record["fingerprint"] = _resolve(base, context)
            _partition(context, cfg.num_clients)
        except ValueError as exc:  # ConfigError included
            record["error"] = str(exc)
        return Message(RecordDict({"config": record}), reply_to=msg)

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        """One round of local training on this node's partition."""
        return train_step(msg, context, base)

    return client


app = make_client_app()
