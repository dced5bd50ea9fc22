"""The in-process engine: a whole run in this process, clients trained in turn.

:func:`run_experiment` runs every method of a configuration here: the run directory and
its life (checks, config, partitions, rows, checkpoints, resume, trackers, summary) are
:class:`fedexlora.run.lifecycle.Run`'s, and the rounds are the one loop both engines
run (:func:`fedexlora.run.loop.run_rounds`). What is this engine's own is how a round is
carried, :class:`InProcess`: one base model in memory, the sampled clients trained on it
in turn, each through the one client every engine uses (:class:`fedexlora.run.client.Client`
on a :class:`fedexlora.run.client.SharedModel`, over a
:class:`fedexlora.run.client_store.MemoryStore`), the same
:class:`fedexlora.server.Server` aggregating (in the clear, or through SecAgg+ played in
process). The Flower engine, its sibling, is :mod:`fedexlora.flower`.
:func:`run_method` runs one method's rounds alone (benchmarks and tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedexlora.bridge.adapters import set_state
from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload
from fedexlora.run.build import Prepared, new_model, new_server
from fedexlora.run.client import Client, SharedModel
from fedexlora.run.client_store import MemoryStore
from fedexlora.run.layout import RunLayout
from fedexlora.run.lifecycle import Run
from fedexlora.run.loop import drive, run_rounds
from fedexlora.run.rounds import RoundTraffic
from fedexlora.run.secure_round import SecureRun
from fedexlora.run.timing import RoundClock, running
from fedexlora.run.workers import update_for
from fedexlora.server.server import Server

__all__ = ["InProcess", "run_experiment", "run_method"]


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
    return drive(
        run,
        lambda current: InProcess(
            cfg,
            current.method,
            run.prep,
            current.model,
            current.server,
            out_dir=run.layout.root,
            progress=progress,
            history=current.rows,
            clients=current.clients,
            local_update=local_update,
            secure_reply=secure_reply,
        ),
    )


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
    clients: MemoryStore | None = None,
    local_update: Callable[..., ClientUpload] | None = None,
    secure_reply: Callable[..., bytes | None] | None = None,
):
    """Runs one method for ``cfg.rounds`` rounds in this process; ``(rows, model, server)``.

    The loop is :func:`fedexlora.run.loop.run_rounds`, carried by :class:`InProcess`.

    Args:
        cfg: The run configuration.
        method: A registered method.
        prep: The shared task, partitions and tokenized data.
        out_dir: Where client adapters go when ``cfg.save_client_adapters`` is set.
        progress: Whether to show progress bars.
        model: A model to use instead of loading one (with ``server``: already restored).
        server: A server restored from a checkpoint; training resumes after its round.
        after_round: Called with ``(row, server, model)`` after each round (checkpoints).
        history: This method's rows so far (a resume): DP budgets continue from them.
        clients: What the clients keep of their own (see :class:`InProcess`).
        local_update: A client's training step (see :class:`InProcess`).
        secure_reply: Under secure aggregation, a client's masked vector (see
            :class:`InProcess`).
    """
    if model is None:
        model, _ = new_model(cfg, prep.task, method)
    server = server or new_server(cfg, method, model)
    transport = InProcess(
        cfg, method, prep, model, server, out_dir=out_dir, progress=progress,
        history=history, clients=clients, local_update=local_update,
        secure_reply=secure_reply,
    )  # fmt: skip
    rows = run_rounds(
        cfg, method, model, server, prep, transport, history=history or (),
        after_round=None if after_round is None else (lambda row: after_round(row, server, model)),
    )  # fmt: skip
    return rows, model, server


class InProcess:
    """The in-process transport: each sampled client trains in turn on one model here.

    One base model stays in memory (:class:`fedexlora.run.client.SharedModel`: its base
    holds the global residuals, so no client needs a model of its own). Each sampled
    client is a :class:`fedexlora.run.client.Client` (:meth:`client`), as under Flower:
    it gets ``server.payload_for(client)``, is loaded onto the shared model (with what
    it keeps of its own, and at its own rank), refuses if its DP-SGD budget is spent,
    trains through ``local_update``, keeps its own parts and replies; the server
    aggregates the uploads, in the clear or through SecAgg+ played in process
    (:class:`fedexlora.run.secure_round.SecureRun`). With DP-SGD a ledger holds every
    client's budget (the round's privacy report).

    Args:
        cfg: The run configuration.
        method: A registered method.
        prep: The shared task, partitions and tokenized data.
        model: The server's global model, which the clients train on in turn.
        server: The method's server.
        out_dir: Where client adapters go when ``cfg.save_client_adapters`` is set.
        progress: Whether to show progress bars.
        history: This method's rows so far (a resume): DP budgets continue from them.
        clients: The clients' store (:class:`fedexlora.run.client_store.MemoryStore`):
            what each keeps of its own (FedSA-LoRA: its B and task head, as flat tensors)
            and its own DP-SGD record (plan and steps, kept up to date after every
            round; under secure aggregation no row holds it), filled in as clients
            train; the caller checkpoints it (a resume passes it back). Each client
            really holds its own, as under Flower.
        local_update: A client's training step, called as
            :func:`fedexlora.run.client_step.local_update` (its default) is, returning the
            client's upload: a caller may wrap it to watch clients or play faulty ones.
        secure_reply: Under secure aggregation, a client's masked vector, called as
            :func:`fedexlora.secagg.rounds.client_reply` (its default) is; ``None`` from
            it is a client that drops out after training.
    """

    def __init__(
        self,
        cfg: RunConfig,
        method: str,
        prep: Prepared,
        model,
        server: Server,
        *,
        out_dir: Path | None = None,
        progress: bool = True,
        history: list[dict] | None = None,
        clients: MemoryStore | None = None,
        local_update: Callable[..., ClientUpload] | None = None,
        secure_reply: Callable[..., bytes | None] | None = None,
    ):
        from fedexlora.core.methods import get_method

        self.cfg, self.method, self.prep = cfg, method, prep
        self.model, self.server = model, server
        self.spec = spec = get_method(method)
        self.out_dir, self.progress = out_dir, progress
        # what the clients keep: their kept parts and DP records, checkpointed by the run
        self.store = MemoryStore() if clients is None else clients
        # nproc_per_client > 1: the node's worker group (fedexlora.run.workers)
        self.local_update = update_for(cfg) if local_update is None else local_update
        self.secure_reply = secure_reply
        centralized = not spec.federated
        parts = [sorted(i for p in prep.parts for i in p)] if centralized else prep.parts
        self.client_data = [prep.train.subset(p) for p in parts]
        # centralized: as many gradient steps per round as all clients together
        self.steps = cfg.local_steps
        if centralized and self.steps is not None:
            self.steps *= len(prep.parts)
        self.ledger = None
        if cfg.dp:
            from fedexlora.training.privacy import Ledger, check_model

            check_model(model)
            self.ledger = Ledger.for_run(cfg, [len(d) for d in self.client_data])
            if self.store.records:  # the clients' own record (a resume)
                self.ledger.load_state(self.store.records)
            elif history:  # a run checkpointed before the clients kept it: the last row
                self.ledger.restore(history[-1])
        self.secure = cfg.secure_aggregation and spec.federated
        self.holder = SharedModel(model, server, cfg, method)  # one model for all

    def client(self, c: int) -> Client:
        """Client ``c`` of this round, on the shared model."""
        return Client(
            self.cfg, self.method, c, self.client_data[c], self.holder, self.store,
            prep=self.prep, update=self.local_update, steps=self.steps,
            progress=self.progress,
            budget=None if self.ledger is None else self.ledger.budgets[c],
        )  # fmt: skip

    def train_round(self, rnd: int) -> RoundTraffic:
        """Round ``rnd``: the sampled clients trained in turn, their uploads aggregated.

        Its clients' seconds (training steps, set-up) go to the round's clock
        (:mod:`fedexlora.run.timing`), which the round's row reads.
        """
        clock = RoundClock()
        with running(clock):
            traffic = self._train_round(rnd)
        traffic.clock = clock
        return traffic

    def _train_round(self, rnd: int) -> RoundTraffic:
        cfg, method, server = self.cfg, self.method, self.server
        t0 = time.perf_counter()
        sampled = server.sample(rnd)
        uploads, bytes_up, bytes_down, down_max = [], 0, 0, 0
        clients = {c: self.client(c) for c in sampled}
        refused = [c for c in sampled if clients[c].refuses()]  # budget spent: not trained
        training = [c for c in sampled if c not in refused]
        sround = (
            SecureRun(server, method, training, cfg.seed, rnd, reply=self.secure_reply)
            if self.secure
            else None
        )
        for c in training:
            if sround is not None and c not in sround.collecting:
                continue  # dropped out before stage 2: not sent a payload
            client, payload = clients[c], server.payload_for(c)
            bytes_down += payload.nbytes
            down_max = max(down_max, payload.nbytes)
            client.apply(payload)
            up = client.train(rnd)
            client.keep(payload.version)
            if sround is not None:
                sent = sround.reply(client, up)
                if not sent:
                    continue  # dropped out: its upload never arrived
                bytes_up += sent
            else:
                bytes_up += up.nbytes
            uploads.append(up)
            if cfg.save_client_adapters and self.out_dir is not None:
                # the client's own model, as it trained it (the weight comes with the outcome)
                client.save_adapter(self.out_dir, rnd, up.num_examples)
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
        return RoundTraffic(
            rnd, sampled, uploads, outcome, t0, bytes_up, bytes_down, down_max,
            dropped=sorted(sround.dropped) if sround is not None else None,
            refused=refused, privacy=self._privacy(refused),
            bytes_up_protocol=sround.protocol_bytes if sround is not None else 0,
        )  # fmt: skip

    def _privacy(self, refused: list[int]) -> dict | None:
        """The round's privacy report; each client's own accounting kept up to date."""
        if self.ledger is None:
            return None
        self.store.records.update(self.ledger.state())
        # under secure aggregation a client's figures would tell its example count
        return self.ledger.row(refused, kept=self.secure)

    def evaluate_clients(self, clients: list[int]) -> dict[int, tuple[dict[str, float], int]]:
        """Each client's own model (the global parts and what it keeps) on its test split."""
        per_client = {c: self.client(c).evaluate(self.server.state) for c in clients}
        set_state(self.model, self.server.state)
        return per_client

    def save_uploads(self, traffic: RoundTraffic) -> None:
        """The adapters were saved as the clients trained: each gets its weight."""
        if self.out_dir is not None:
            RunLayout(self.out_dir).weigh_client_adapters(traffic.round, traffic.outcome.weights)
