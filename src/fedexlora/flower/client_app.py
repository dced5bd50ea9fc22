"""The Flower ClientApp: one client's local step, over the shared training code.

Each message's client is a :class:`fedexlora.run.client.Client`, the in-process
engine's too: this module only turns messages into its calls and its results into
replies. Every client really holds its own model (:class:`fedexlora.run.client.OwnModel`):
it applies each payload to it with :func:`fedexlora.bridge.steps.apply_payload` (the
residual folded into its own base, or its side branch, then the global factors loaded),
trains with :func:`fedexlora.run.client_step.local_update` (seeded by
:func:`fedexlora.run.client_step.client_seed` exactly as in-process) and replies with its
upload, or its masked vector under secure aggregation.

What a client must remember between rounds (what was folded into its base: the fp32
weights of its adapted layers, or their side branches for a half-precision or quantized
base, and its adapter) lives in the Flower ``Context`` (``context.state``, through
:class:`fedexlora.flower.client_store.ContextStore`): in a
deployment each message runs in a fresh ClientApp process, and in a simulation a partition
may land on another Ray actor. A small per-process cache skips rebuilding the model when
the same process serves the same partition again.

A ``Context`` dies with its run. So that a resumed run (a new Flower run) finds its
clients where they were, a client also writes its state to disk when it has a state
directory: the node config's ``state-dir`` (a deployment's SuperNode) or the run config's
``client-state-dir`` (``fedexlora run --engine flower`` sets it inside the run
directory). It keeps the last two base versions, under the run's token, and tells the
server which it holds when asked; the server re-syncs from W0 a client that holds none
of what it expects.

Configuration comes from the run config (``context.run_config``), the server's word; the
partition comes from the node config (``partition-id``, ``num-partitions``), and so does
the node's own floor, which no run config lowers (``secure-aggregation``,
``max-dp-epsilon``, ``max-dp-delta``, ``dp-reproducible``).
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedexlora.flower import client_dp
from fedexlora.flower.client_store import ContextStore, held_versions
from fedexlora.flower.node_data import NodeDataError, adapters_dir, node_file, node_rows
from fedexlora.flower.records import from_array_record, resolve_run_config, to_array_record
from fedexlora.flower.simulation import SEEDED_DP_CONSENT, restore_user_home
from fedexlora.quiet import quiet_libraries
from fedexlora.run.client_store import DiskStore

if TYPE_CHECKING:
    from fedexlora.run.client import Client

__all__ = ["app", "make_client_app"]

_DATA: dict[str, tuple] = {}  # config fingerprint -> (task, Prepared), one entry
_TASK: dict[str, object] = {}  # config fingerprint -> task, loaded by a query, one entry
# The process's models: (run, partition) -> (token, model, method, fingerprint) for a
# client's model as it left it, (run, "spare", method, fingerprint, partition) -> (None,
# model, method, fingerprint) for a model of a client that kept nothing. A client without
# its own entry takes any model of its run, method and configuration (the oldest) and
# restores its state into it, as the in-process engine's clients share one model; so a
# ClientApp actor holds one model whichever partitions it serves.
_MODELS: OrderedDict[tuple, tuple] = OrderedDict()
# Models kept per process (FEDEXLORA_CLIENT_MODEL_CACHE, default 1; 0 rebuilds every
# round from the Context, as a deployment's fresh ClientApp process does). More than one
# saves a partition that comes back to the same process the restore of its state.
_MAX_MODELS = int(os.environ.get("FEDEXLORA_CLIENT_MODEL_CACHE", "1"))


def _node_says(node: Mapping[str, Any], key: str) -> bool:
    """Whether the node config sets ``key`` true (``true``, ``yes`` or ``1``)."""
    return str(node.get(key, "")).strip().lower() in ("1", "true", "yes")


def _allows_seeded_dp(context: Context) -> bool:
    """Whether this node itself (its node config or environment) allows seeded DP noise."""
    said = _node_says(context.node_config, "dp-reproducible")
    return said or os.environ.get(SEEDED_DP_CONSENT, "") == "1"


def _resolve(defaults: Mapping[str, Any], context: Context):
    from fedexlora.run.checkpoint import config_fingerprint

    cfg, settings = resolve_run_config({**defaults, **dict(context.run_config)})
    # the run config is the server's word: seeded noise, which whoever knows the seed can
    # replay, needs the node's own consent too
    if cfg.dp and cfg.dp_reproducible and not _allows_seeded_dp(context):
        raise ValueError(
            "the run asks for seeded DP-SGD noise (dp-reproducible = true), which anyone "
            "who knows the run's seed can replay; this node has not allowed it: set node "
            f"config 'dp-reproducible=true' or {SEEDED_DP_CONSENT}=1 to consent, or run "
            "without --dp-reproducible"
        )
    problem = _below_node_floor(cfg, context.node_config)
    if problem is not None:
        raise ValueError(problem)
    return cfg, config_fingerprint(cfg), settings


def _below_node_floor(cfg, node: Mapping[str, Any]) -> str | None:
    """Why the run's configuration falls short of this node's own floor, or ``None``.

    The run configuration is the server's word. A SuperNode's ``--node-config`` is its
    operator's, not the server's: ``secure-aggregation=true`` refuses a run that would
    upload in the clear, and ``max-dp-epsilon`` / ``max-dp-delta`` a run without DP-SGD
    or with a weaker budget.
    """
    if _node_says(node, "secure-aggregation") and not cfg.secure_aggregation:
        return (
            "this node requires secure aggregation (node config secure-aggregation=true) "
            "and the run is configured without it; the node does not train for this run"
        )
    for key, have in (("max-dp-epsilon", cfg.dp_epsilon), ("max-dp-delta", cfg.dp_delta)):
        cap = node.get(key, "")
        if str(cap).strip() == "":
            continue
        try:
            cap = float(cap)
        except ValueError:
            return f"node config {key}={node[key]!r} is not a number"
        if not cfg.dp or have is None or float(have) > cap:
            shown = "no DP-SGD" if not cfg.dp else f"{key.removeprefix('max-')} = {have:g}"
            return (
                f"this node allows at most {key.removeprefix('max-')} {cap:g} (node config "
                f"{key}) and the run asks for {shown}; the node does not train for this run"
            )
    return None


def _state_root(context: Context, settings, token: str) -> Path | None:
    """This node's state directory for the run ``token``, if it has one."""
    root = str(context.node_config.get("state-dir", "") or settings.client_state_dir)
    return Path(root) / token if root and token else None


def _store(context: Context, settings, token: str, method: str) -> ContextStore:
    """This client's store for this run and method: its Context, over its state directory."""
    root = _state_root(context, settings, token)
    return ContextStore(context, method, token, None if root is None else DiskStore(root / method))


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
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.restore import load_task_for

    hit = _DATA.get(fingerprint)
    if hit is not None:
        return hit[0], hit[1], None
    task = _TASK.pop(fingerprint, None) or load_task_for(cfg)
    model, tokenizer = new_model(cfg, task, method)
    prep = prepare(cfg, tokenizer, task)
    _DATA.clear()
    _DATA[fingerprint] = (task, prep)
    return task, prep, model


def _task_for(cfg, fingerprint: str):
    """The run's task, loaded once per process (a node's query checks its file against it)."""
    from fedexlora.run.restore import load_task_for

    if fingerprint in _DATA:
        return _DATA[fingerprint][0]
    if fingerprint not in _TASK:
        _TASK.clear()
        _TASK[fingerprint] = load_task_for(cfg)
    return _TASK[fingerprint]


def _client_model(cfg, task, method, context, pid: int, since: int, spare, store, fingerprint):
    """The client's model holding base version ``since`` (``-1``: the pretrained W0).

    Its own from the process cache, else any model of the run (a spare, another
    partition's, a new one) with its state restored from its store (its Context, else its
    state directory).
    """
    from fedexlora.run.build import new_model
    from fedexlora.run.client import OwnModel

    adapter = client_adapter_name(cfg, method, pid)
    cached = _MODELS.pop((context.run_id, pid), None)  # taken: a failed round drops it
    if cached is not None and (cached[2], cached[3]) != (method, fingerprint):
        cached = None  # another method's or configuration's model: never reused
    if since >= 0 and cached is not None and store.held() == since and cached[0] == store.token:
        return cached[1]
    model = spare if spare is not None else cached[1] if cached is not None else None
    if model is None:
        model = _reusable(context.run_id, method, fingerprint)
    if since < 0:  # a new (or re-synced) client starts from the pretrained weights:
        # any model of the run will do, since the reset payload drops what it folded
        model = model if model is not None else new_model(cfg, task, method)[0]
        _activate(model, adapter)
        return model
    flat = store.load(pid, since)
    if flat is None:
        if model is not None:  # still a model of the run: the next client's
            _spare(context, model, method, pid, fingerprint)
        raise ValueError(
            f"partition {pid} holds base version {store.held()} for {method}, but the "
            f"payload is relative to version {since}; the server re-syncs this client from "
            "W0 next time it is sampled"
        )
    model = model if model is not None else new_model(cfg, task, method)[0]
    _activate(model, adapter)
    # every folded layer rebuilt from W0, the adapter and head set: the client's model,
    # whichever client this model held before (load_side_state)
    OwnModel(model, adapter, cfg).restore(flat)
    return model


def _reusable(run_id, method: str, fingerprint: str):
    """Any cached model of this run, method and configuration, the oldest, or ``None``.

    It is taken out of the cache. A spare or another partition's model will do: a reset
    payload drops what it folded, and a restore rebuilds every folded layer from W0 and
    sets every trained parameter (:func:`fedexlora.bridge.steps.load_client_state`).
    """
    for key, held in list(_MODELS.items()):
        if key[0] == run_id and (held[2], held[3]) == (method, fingerprint):
            return _MODELS.pop(key)[1]
    return None


def _activate(model, adapter: str) -> None:
    """Makes ``adapter`` the one trained.

    peft's ``set_adapter`` also resets which of its factors train, so a model already on
    it (FFA-LoRA's frozen A) is left alone.
    """
    if model.active_adapter != adapter:
        model.set_adapter(adapter)


def client_adapter_name(cfg, method: str, pid: int) -> str:
    """The peft adapter partition ``pid`` trains (its own rank under ``client_ranks``)."""
    from fedexlora.run.build import client_adapter

    return client_adapter(cfg, method, pid) or "default"


def _cache(context, model, pid: int, store: ContextStore, method: str, fingerprint: str) -> None:
    """Keeps the model in the process cache, under the token of the state it just kept."""
    key = (context.run_id, pid)
    _MODELS[key] = (store.token, model, method, fingerprint)
    _trim(key)


def _spare(context, model, method: str, pid: int, fingerprint: str) -> None:
    """A client that kept nothing: its model stays cached as a spare."""
    _MODELS.pop((context.run_id, pid), None)
    # a spare serves only this configuration (another may adapt other modules)
    key = (context.run_id, "spare", method, fingerprint, pid)
    _MODELS[key] = (None, model, method, fingerprint)
    _trim(key)


def _trim(newest: tuple) -> None:
    _MODELS.move_to_end(newest)
    while len(_MODELS) > max(_MAX_MODELS, 0):
        _MODELS.popitem(last=False)


@dataclass
class _Request:
    """One message's client (see :func:`_client_for`)."""

    cfg: Any
    conf: ConfigRecord
    method: str
    since: int
    client: Client  # its model holding base version ``since``, over its store
    store: ContextStore
    fingerprint: str
    settings: Any = None


def _check_message(msg: Message, context: Context, cfg, fingerprint: str) -> int:
    """This node's partition, checked against the message's; and the configuration's.

    Raises:
        ValueError: If the message is for another partition or configuration.
    """
    conf = msg.content["config"]
    theirs = str(conf.get("fingerprint", ""))
    if theirs and theirs != fingerprint:
        raise ValueError(
            f"this ClientApp resolved another configuration (fingerprint {fingerprint!r}) "
            f"than the server ({theirs!r}); both must share one run config and one "
            "fedex-lora version (another version may hash the same settings differently)"
        )
    pid = _partition(context, cfg.num_clients)
    if int(conf["partition-id"]) != pid:
        raise ValueError(f"message for partition {conf['partition-id']}, this node holds {pid}")
    return pid


def _client_for(msg: Message, context: Context, defaults: Mapping[str, Any]) -> _Request:
    """The client a train or evaluate message is for, its model holding ``base-version``.

    Raises:
        ValueError: If the client's configuration or partition does not match the
            server's, or it does not hold the base version the message builds on.
    """
    from fedexlora.run.client import Client, OwnModel
    from fedexlora.run.workers import update_for

    cfg, fingerprint, settings = _resolve(defaults, context)
    conf, pid = msg.content["config"], _check_message(msg, context, cfg, fingerprint)
    method, since = str(conf["method"]), int(conf["base-version"])
    store = _store(context, settings, str(conf.get("run-token", "")), method)
    task, prep, spare = _task_and_data(cfg, fingerprint, method)
    model = _client_model(cfg, task, method, context, pid, since, spare, store, fingerprint)
    holder = OwnModel(model, client_adapter_name(cfg, method, pid), cfg)
    own = node_file(context.node_config, cfg)
    data = (
        prep.train.subset(prep.parts[pid])
        if own is None
        else node_rows(own, cfg, prep, fingerprint)
    )
    # nproc_per_client > 1: this node's worker group, which outlives this message's process
    update = update_for(cfg, owned=False)
    client = Client(cfg, method, pid, data, holder, store, prep=prep, update=update)
    return _Request(cfg, conf, method, since, client, store, fingerprint, settings)


def _answer(msg: Message, pid: int, rnd: int, method: str, error: str) -> Message:
    """A reply that carries only ``error`` (the server stops or drops on it)."""
    fields = {"partition-id": pid, "server-round": rnd, "method": method, "error": error}
    return Message(RecordDict({"config": ConfigRecord(fields)}), reply_to=msg)


def train_step(msg: Message, context: Context, defaults: Mapping[str, Any]) -> Message:
    """Applies the payload of ``msg`` to this client, trains it, and replies.

    The round is its :class:`fedexlora.run.client.Client`'s (the in-process engine's
    too): apply, refuse a spent DP budget, train, keep, reply in the clear or masked.
    A reply in the clear without DP-SGD also says where the client's seconds went
    (``seconds-train``: its training steps; ``seconds-setup``: the rest of its handling
    of the message, its model restored, the payload applied, the upload read back;
    ``seconds-train-began`` / ``-ended``: when its steps ran, on its machine's wall clock,
    which a simulation's server compares with its other clients'), timed by its own clock
    (:mod:`fedexlora.run.timing`); under DP-SGD or secure aggregation
    no such figure leaves the client (its training time follows its data).

    Raises:
        ValueError: If the client's configuration or partition does not match the
            server's, or it does not hold the base version the payload builds on.
    """
    from fedexlora.run.timing import RoundClock, running

    started, clock = time.perf_counter(), RoundClock()
    with running(clock):  # its own clock, never the server's (a grid in one thread)
        return _train_step(msg, context, defaults, started, clock)


def _train_step(msg: Message, context: Context, defaults, started: float, clock) -> Message:
    from fedexlora.core.messages import Payload
    from fedexlora.training.privacy import DPCheckError

    try:
        req = _client_for(msg, context, defaults)
    except NodeDataError as exc:  # the run stops with it: never a run without this node
        conf = msg.content["config"]
        pid = int(context.node_config.get("partition-id", -1))
        return _answer(msg, pid, int(conf["server-round"]), str(conf["method"]), str(exc))
    cfg, conf, method, client = req.cfg, req.conf, req.method, req.client
    pid, rnd, version = client.client, int(conf["server-round"]), int(conf["version"])
    secure = str(conf.get("secagg-stage", "")) == "collect"
    if cfg.secure_aggregation and not secure:
        # its own configuration says secure aggregation: never an upload in the clear,
        # whatever the server asks (it trains nothing, so nothing of its data is sent)
        return _answer(msg, pid, rnd, method, (
            f"partition {pid} is configured for secure aggregation and refuses to send its "
            "upload in the clear; the server asked for one (is the server's configuration "
            "the same?)"
        ))  # fmt: skip
    payload = Payload.from_flat(
        from_array_record(msg.content["arrays"]), round=rnd, version=version, reset=req.since < 0
    )
    client.apply(payload, req.since)
    if cfg.dp:  # the accounting is the client's own; the server records what it reports
        try:
            client.budget = client_dp.plan_budget(cfg, req.store, conf, pid, len(client.data))
        except ValueError as exc:
            if not cfg.secure_aggregation:
                raise
            # its reasons name its figures (its example count, its sampling rate), which
            # under secure aggregation stay on this node: its own log has them
            warnings.warn(f"partition {pid}: {exc}", stacklevel=2)
            raise ValueError(
                f"partition {pid} cannot train under the run's DP-SGD settings (--dp-epsilon, "
                "--dp-delta); under secure aggregation its reasons stay in its own log"
            ) from None
    refused, up = client.refuses(), None
    if not refused:
        try:
            up = client.train(rnd)
        except DPCheckError as exc:
            # a round that would train nothing: the server stops the run with this message
            return _answer(msg, pid, rnd, method, str(exc))
    if bool(conf.get("keep-state", True)):
        client.keep(version)
        _cache(context, client.model, pid, req.store, method, req.fingerprint)
    else:  # the server will reset this client next time: keep nothing of it
        client.keep(version, keep=False)
        _spare(context, client.model, method, pid, req.fingerprint)
    metrics = (
        {}
        if client.budget is None
        else client_dp.report_metrics(client.budget, cfg.dp_delta, secure=cfg.secure_aggregation)
    )
    content = RecordDict(
        {"config": ConfigRecord({"partition-id": pid, "server-round": rnd, "method": method})}
    )
    if refused:  # past its budget: not trained, nothing of its data sent
        metrics["dp-refused"] = 1
    else:
        # the client keeps its adapter as trained: where its node says, else (when the
        # server asks, save_client_adapters) in the run directory the server names
        where = adapters_dir(context.node_config, context.run_id, method, conf)
        _save_adapter(client, where, rnd, int(up.num_examples))
        if secure:  # masked: count and loss in the sum
            content["config"]["secagg.masked"] = _secure_upload(context, conf, up, client)
        else:
            up = client.reply(up)
            content["arrays"] = to_array_record(up.state.to_flat())
            metrics["num-examples"] = int(up.num_examples)
            if client.budget is None:  # under DP no loss is sent (outside DP-SGD's guarantee)
                metrics["train-loss"] = float(up.train_loss)
                train = clock.seconds["train"]
                metrics["seconds-train"] = train
                metrics["seconds-setup"] = max(time.perf_counter() - started - train, 0.0)
                span = clock.train_span()
                if span is not None:  # when it trained, on this machine's clock
                    metrics["seconds-train-began"], metrics["seconds-train-ended"] = span
    content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=msg)


def _save_adapter(client: Client, where: str, rnd: int, num_examples: int) -> None:
    """The adapter as trained, into ``where``.

    ``where`` is the node's own ``--node-config adapters-dir=DIR`` (its
    ``run-<run id>/<method>/`` folder, every round, whatever the run says: the adapter is
    the node's), else the server's run directory when the run
    asks (``save_client_adapters``), else ``""``: nowhere. A node that cannot write there
    (another machine's path) says so and goes on: its reply does not depend on it.
    """
    if not where:
        return
    try:
        client.save_adapter(Path(where), rnd, num_examples)
    except OSError as exc:
        print(f"partition {client.client}: could not save its adapter under {where}: {exc}")


_SECAGG = "fedexlora.secagg"


def secure_stage_step(msg: Message, context: Context, defaults: Mapping[str, Any]) -> Message:
    """One SecAgg+ stage other than the upload: ``setup``, ``share-keys`` or ``unmask``.

    The client's side (:class:`fedexlora.run.secure_client.SecureClient`, the in-process
    engine's too) lives in its Context between the stages' messages.

    Raises:
        ValueError: If the message is for another partition or configuration.
    """
    from fedexlora.run.secure_client import SecureClient

    cfg, fingerprint, _ = _resolve(defaults, context)
    conf, pid = msg.content["config"], _check_message(msg, context, cfg, fingerprint)
    stage = str(conf["secagg-stage"])
    fields = {k[len("secagg.") :]: v for k, v in conf.items() if k.startswith("secagg.")}
    secure = SecureClient(pid) if stage == "setup" else _load_secure(context, pid, stage)
    reply = secure.answer(stage, fields)
    context.state[_SECAGG] = ConfigRecord(secure.to_dict())
    record = {"partition-id": pid, **{f"secagg.{k}": v for k, v in reply.items()}}
    return Message(RecordDict({"config": ConfigRecord(record)}), reply_to=msg)


def _secure_upload(context: Context, conf, up, client: Client) -> bytes:
    """Stage 2: the client's masked vector (:meth:`Client.reply`); its SecAgg+ state kept."""
    secure = _load_secure(context, client.client, "collect")
    fields = {k[len("secagg.") :]: v for k, v in conf.items() if k.startswith("secagg.")}
    data = client.reply(up, secure, fields)
    context.state[_SECAGG] = ConfigRecord(secure.to_dict())
    return data


def _load_secure(context: Context, pid: int, stage: str):
    """This client's side of the round's SecAgg+ (a ``SecureClient``), from its Context."""
    from fedexlora.run.secure_client import SecureClient

    saved = context.state.get(_SECAGG)
    if not isinstance(saved, ConfigRecord):
        raise ValueError(f"secure aggregation stage {stage!r} before the round's key setup")
    return SecureClient.from_dict(pid, saved)


def evaluate_step(msg: Message, context: Context, defaults: Mapping[str, Any]) -> Message:
    """This client's own model (the global A of ``msg``, its own B) on its own test split.

    For a personalized method (one whose spec keeps client parts, such as FedSA-LoRA:
    :data:`fedexlora.core.methods.REGISTRY`); the client's state is left as it was. A client
    configured for secure aggregation refuses (a reply with ``error``, nothing measured):
    its metrics and test-split size would reach the server in the clear.

    Raises:
        ValueError: If the configuration or partition does not match the server's, or the
            client does not hold the base version the server expects.
    """
    from fedexlora.core.state import AdapterState

    cfg, _, _ = _resolve(defaults, context)
    if cfg.secure_aggregation:
        # its own configuration says secure aggregation: its metrics and test-split size
        # are its own figures, never sent in the clear (as the train path refuses)
        pid = int(context.node_config.get("partition-id", -1))
        error = (
            f"partition {pid} is configured for secure aggregation and refuses to send its "
            "own evaluation in the clear; the server asked for one (is the server's "
            "configuration the same?)"
        )
        fields = {"partition-id": pid, "error": error}
        return Message(RecordDict({"config": ConfigRecord(fields)}), reply_to=msg)
    req = _client_for(msg, context, defaults)
    client, pid = req.client, req.client.client
    metrics, n = client.evaluate(AdapterState.from_flat(from_array_record(msg.content["arrays"])))
    if req.store.token is not None:  # back in the cache: only A changed, payloads set A
        _cache(context, client.model, pid, req.store, req.method, req.fingerprint)
    reply = {"partition-id": pid, "metrics": json.dumps(metrics), "test-examples": n}
    return Message(RecordDict({"config": ConfigRecord(reply)}), reply_to=msg)


def make_client_app(defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """A ClientApp; ``defaults`` fill in run-config keys the context does not set.

    ``flwr run`` gives the app its run config (``[tool.flwr.app.config]`` plus
    ``--run-config`` overrides); a caller that runs the app itself (a test's in-process
    grid, ``flwr.simulation.run_simulation``) can bake one in here.
    """
    base = dict(defaults or {})
    client = ClientApp()

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        """Tells the server this node's partition and config fingerprint, or what is wrong.

        Problems are reported, not raised, so that the server can stop the run at once
        with a message naming this node.
        """
        restore_user_home()
        quiet_libraries()
        conf = context.node_config
        record = ConfigRecord(
            {
                "partition-id": int(conf.get("partition-id", -1)),
                "num-partitions": int(conf.get("num-partitions", -1)),
                "fingerprint": "",
                "error": "",
                "held": "{}",
            }
        )
        try:
            cfg, record["fingerprint"], settings = _resolve(base, context)
            pid = _partition(context, cfg.num_clients)
            task = functools.partial(_task_for, cfg, record["fingerprint"])
            record["own-data"] = node_file(conf, cfg, task) is not None
            token = str(msg.content["config"].get("run-token", ""))
            root = _state_root(context, settings, token)
            record["held"] = json.dumps(held_versions(context, root, token, pid))
        except ValueError as exc:  # ConfigError included
            record["error"] = str(exc)
        return Message(RecordDict({"config": record}), reply_to=msg)

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        """One round of local training on this node's partition (or a SecAgg+ stage)."""
        restore_user_home()
        quiet_libraries()
        if str(msg.content["config"].get("secagg-stage", "collect")) != "collect":
            return secure_stage_step(msg, context, base)
        return train_step(msg, context, base)

    @client.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """This node's own model on its own test split (personalized methods)."""
        restore_user_home()
        quiet_libraries()
        return evaluate_step(msg, context, base)

    return client


app = make_client_app()
