"""The in-process engine: a whole run in this process, clients trained in turn.

:func:`run_experiment` runs every method of a configuration here: the run directory and
its life (checks, config, partitions, rows, checkpoints, resume, trackers, summary) are
:class:`fedexlora.run.lifecycle.Run`'s, and each method's rounds are
:func:`run_method`'s. That loop keeps one base model in memory and trains the sampled
clients on it in turn; it builds what it trains as every engine does
(:mod:`fedexlora.run.build`), trains each client through the same step
(:mod:`fedexlora.run.client_step`), runs the same :class:`fedexlora.server.Server` (in
the clear, or through SecAgg+ in process) and closes each round the same way
(:func:`fedexlora.run.rounds.close_round`). The Flower engine, its sibling, is
:mod:`fedexlora.flower`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedexlora.bridge.adapters import (
    fold_residuals,
    get_state,
    layer_info,
    restore_base,
    set_state,
    snapshot_base,
)
from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload
from fedexlora.core.state import AdapterState
from fedexlora.run.build import Prepared, client_adapter, new_model, new_server
from fedexlora.run.client_step import local_update, save_client_adapter
from fedexlora.run.layout import RunLayout
from fedexlora.run.lifecycle import Run
from fedexlora.run.rounds import RoundTraffic, close_round, evaluate_personal
from fedexlora.run.secure_round import SecureRun
from fedexlora.server.server import Server

__all__ = ["run_experiment", "run_method"]


def run_experiment(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    console=None,
    local_update: Callable[..., ClientUpload] | None = None,
    secure_reply: Callable[..., bytes | None] | None = None,
) -> list[dict]:
    """Runs every method of ``cfg`` in this process and writes the run directory.

    The directory gets ``config.toml``, ``metrics.jsonl`` (one row per method and round,
    appended and fsynced as each round ends), ``summary.md``, PNG plots and, per method,
    ``checkpoints/<method>/round-XXXX`` after every round.

    Args:
        cfg: A validated configuration.
        out_dir: The run directory.
        resume: Continue a run in ``out_dir`` from its last complete round.
        progress: Show progress bars.
        console: A ``rich`` console for messages (plain ``print`` when ``None``).
        local_update: Each client's training step (:func:`fedexlora.run.client_step.local_update`
            when ``None``): a caller may wrap it to watch clients or play faulty ones.
        secure_reply: Under secure aggregation, each client's masked vector
            (:func:`fedexlora.secagg.rounds.client_reply` when ``None``); a caller may
            wrap it to play a client that drops out after training (``None``).

    Returns:
        All metrics rows.

    Raises:
        RunError: If ``out_dir`` holds a run and ``resume`` is not set, or the reverse.
        CheckpointError: If a checkpoint is corrupt or does not match the configuration.
    """
    say = console.print if console is not None else print
    run = Run.open(cfg, out_dir, resume=resume, say=say)
    for current in run.methods():
        run_method(
            cfg,
            current.method,
            run.prep,
            out_dir=run.layout.root,
            progress=progress,
            model=current.model,
            server=current.server,
            after_round=lambda row, _srv, _mdl, _m=current: run.record(_m, row),
            history=current.rows,
            personal=current.personal,
            **({} if local_update is None else {"local_update": local_update}),
            **({} if secure_reply is None else {"secure_reply": secure_reply}),
        )
    return run.finish()


def run_method(
    cfg: RunConfig,
    method: str,
    prep: Prepared,
    *,
    out_dir: Path | None = None,
    progress: bool = True,
    model=None,
    server: Server | None = None,
    after_round: Callable[[dict, Server, torch.nn.Module], None] | None = None,
    history: list[dict] | None = None,
    personal: dict[int, dict[str, torch.Tensor]] | None = None,
    local_update: Callable[..., ClientUpload] = local_update,
    secure_reply: Callable[..., bytes | None] | None = None,
):
    """Runs one method for ``cfg.rounds`` rounds and returns ``(rows, model, server)``.

    Each sampled client gets ``server.payload_for(client)`` and trains through
    ``local_update``.

    Args:
        cfg: The run configuration.
        method: ``fedex``, ``fedit``, ``ffa``, ``flora`` or ``centralized``.
        prep: The shared task, partitions and tokenized data.
        out_dir: Where client adapters go when ``cfg.save_client_adapters`` is set.
        progress: Whether to show progress bars.
        model: A model to use instead of loading one (with ``server``: already restored).
        server: A server restored from a checkpoint; training resumes after its round.
        after_round: Called with ``(row, server, model)`` after each round (checkpoints).
        history: This method's rows so far (a resume): DP budgets continue from them.
        personal: What each client keeps of its own (FedSA-LoRA: client -> its B and task
            head, as flat tensors, :meth:`~fedexlora.core.state.AdapterState.to_flat`),
            filled in as clients train; the caller checkpoints it (a resume passes it
            back). Each client really holds its own, as under Flower.
        local_update: A client's training step, called as
            :func:`fedexlora.run.client_step.local_update` (its default) is, returning the
            client's upload: a caller may wrap it to watch clients or play faulty ones.
        secure_reply: Under secure aggregation, a client's masked vector, called as
            :func:`fedexlora.secagg.rounds.client_reply` (its default) is; ``None`` from
            it is a client that drops out after training.
    """
    from fedexlora.core.methods import get_method

    spec = get_method(method)
    centralized = not spec.federated
    own = {} if personal is None else personal
    if model is None:
        model, _ = new_model(cfg, prep.task, method)
    parts = [sorted(i for p in prep.parts for i in p)] if centralized else prep.parts
    server = server or new_server(cfg, method, model)
    client_data = [prep.train.subset(p) for p in parts]
    # centralized: as many gradient steps per round as all clients together
    steps = cfg.local_steps
    if centralized and steps is not None:
        steps *= len(prep.parts)
    ledger = None
    if cfg.dp:
        from fedexlora.training.privacy import Ledger, check_model, steps_per_round

        check_model(model)
        ledger = Ledger.for_run(cfg, [len(d) for d in client_data])
        if history:
            ledger.restore(history[-1])
    rows = []
    secure = cfg.secure_aggregation and spec.federated
    for rnd in range(server.round + 1, cfg.rounds + 1):
        t0 = time.perf_counter()
        sampled = server.sample(rnd)
        uploads, bytes_up, bytes_down, down_max = [], 0, 0, 0
        refused = []
        wants = {}
        for c in sampled:
            if ledger is not None:
                want = steps if steps is not None else steps_per_round(cfg, len(client_data[c]))
                if not ledger.allow(c, want):
                    refused.append(c)  # its budget is spent: not trained, nothing sent
                    continue
                wants[c] = want
        training = [c for c in sampled if c not in refused]
        sround = (
            SecureRun(server, method, training, cfg.seed, rnd, reply=secure_reply)
            if secure
            else None
        )
        for c in training:
            if sround is not None and c not in sround.collecting:
                continue  # dropped out before stage 2: not sent a payload
            payload = server.payload_for(c)
            bytes_down += payload.nbytes
            down_max = max(down_max, payload.nbytes)
            set_state(model, server.state)  # the shared base already holds the residuals
            if c in own and not payload.reset:  # what it keeps of its own (MethodSpec.keeps)
                set_state(model, AdapterState.from_flat(own[c]))
            with _client_view(model, server, c, client_adapter(cfg, method, c)):
                up = local_update(
                    cfg, method, model, client_data[c], rnd, c, steps=steps, progress=progress,
                    dp=None if ledger is None else ledger.budgets[c], tokenizer=prep.tokenizer,
                )  # fmt: skip
            if ledger is not None:
                ledger.record(c, wants[c])
            if spec.personalized:
                own[c] = get_state(model, **spec.kept_parts()).to_flat()
            if sround is not None:
                sent = sround.reply(c, up)
                if not sent:
                    continue  # dropped out: its upload never arrived
                bytes_up += sent
            else:
                bytes_up += up.nbytes
            uploads.append(up)
            if cfg.save_client_adapters and out_dir is not None:
                save_client_adapter(model, out_dir, rnd, c, up.num_examples)
        if sround is not None:
            outcome = sround.aggregate()
            uploads = [u for u in uploads if u.client_id in outcome.accepted]
            # the engine (not the server) knows each client: the true weights, to measure
            # the model against the ideal of the clients' own uploads
            n = {
                u.client_id: 1 if server.weighting == "uniform" else int(u.num_examples)
                for u in uploads
            }
            outcome.weights = {c: v / sum(n.values()) for c, v in n.items()}
        else:
            outcome = server.aggregate(uploads, effective=False)  # measured on the model
        if cfg.save_client_adapters and out_dir is not None:
            for c, w in outcome.weights.items():
                meta = RunLayout(out_dir).client_adapter_meta(rnd, c)
                meta.write_text(json.dumps({**json.loads(meta.read_text()), "weight": w}))
        privacy = ledger.row(refused) if ledger is not None else None

        def evaluate_clients(clients: list[int]) -> dict:
            per_client = {
                c: evaluate_personal(
                    cfg, method, model, prep, c, server.state, AdapterState.from_flat(own[c])
                )
                for c in clients
            }
            set_state(model, server.state)
            return per_client

        traffic = RoundTraffic(
            rnd, sampled, uploads, outcome, t0, bytes_up, bytes_down, down_max,
            dropped=sorted(sround.dropped) if sround is not None else None,
            refused=refused, privacy=privacy,
        )  # fmt: skip
        row = close_round(
            cfg, method, model, server, prep, traffic, earlier=[*(history or []), *rows],
            evaluate_clients=evaluate_clients,
        )  # fmt: skip
        rows.append(row)
        if after_round is not None:
            after_round(row, server, model)
    return rows, model, server


@contextlib.contextmanager
def _client_view(model, server: Server, client: int, adapter: str | None):
    """Temporarily turns the shared model into a client of another rank.

    The client's remainder ``T_c`` is folded into the shared base under the client's own
    adapter and scale, and restored bit for bit afterwards.
    """
    if adapter is None:
        yield
        return
    snapshot = snapshot_base(model)
    info = layer_info(model, adapter)
    remainder = server.remainder.get(client, {})
    fold_residuals(
        model, {n: t.scaled(1.0 / info[n].scale) for n, t in remainder.items()}, adapter=adapter
    )
    model.set_adapter(adapter)
    set_state(model, server.sent[client], adapter=adapter)
    try:
        yield
    finally:
        restore_base(model, snapshot)
        model.set_adapter("default")
