"""The life of a run, one for both engines: its directory from the first line to the last.

:class:`Run` owns the run directory (:class:`fedexlora.run.layout.RunLayout`).
:meth:`Run.open` refuses to overwrite a run, loads the task, the first method's model
(whose tokenizer encodes the task) and the partitions, writes ``config.toml`` and
``partitions.txt``, and restores every method on a resume; the run then hands out each
method's model and server, after each round appends the row, logs it to the trackers and
writes the checkpoint, and at the end writes ``summary.md`` and the plots. An engine only
trains rounds:

.. code-block:: python

    run = Run.open(cfg, out, resume=resume)
    for m in run.methods():          # each method still to run, its model and server
        ...train the rounds after m.server.round, and after each one:
        run.record(m, row)
    rows = run.finish()

The in-process engine (:func:`fedexlora.run.inprocess.run_experiment`) and the Flower
ServerApp (:func:`fedexlora.flower.server_app.run_server`) both drive it.
:func:`run_tasks` runs every task of a multi-task recipe, through either engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedexlora.config import RunConfig, load_run_config
from fedexlora.core.methods.spec import EXACT_BOUND, ROUNDING_MARGIN
from fedexlora.run.build import Prepared, new_model, new_server, prepare
from fedexlora.run.checkpoint import config_fingerprint, save_checkpoint
from fedexlora.run.client_store import MemoryStore
from fedexlora.run.layout import RunError, RunLayout, append_row, write_atomic, write_rows
from fedexlora.run.recipes import get_recipe, paper_section, recipe_section
from fedexlora.run.report import intact_rows, read_metrics, write_summary
from fedexlora.run.restore import (
    base_deltas,
    check_client_rows,
    finished_methods,
    load_task_for,
    restore_run,
)
from fedexlora.run.stopping import cell_done, stop_metric_error
from fedexlora.run.trackers import open_trackers

__all__ = ["MethodRun", "Run", "run_tasks"]

_TABLE_LINES = 20
_MATH_BOUND = 1e-6  # exact server math in fp64 is ~1e-15 off; 1e-6 leaves room for fp32 steps


@dataclass
class MethodRun:
    """One method of a run: its model, its server and its rows so far.

    Attributes:
        method: The method's name.
        model: The model the server's global state lives in (base with residuals folded).
        server: The method's :class:`fedexlora.server.Server`.
        rows: Its metrics rows, restored ones first.
        restored: How many of ``rows`` came from a checkpoint (a resume).
        clients: The in-process engine's clients' store
            (:class:`fedexlora.run.client_store.MemoryStore`: what they keep of their own
            between rounds, and their DP-SGD records, which under secure aggregation no
            row holds), checkpointed with the server as it gives itself
            (:meth:`~fedexlora.run.client_store.MemoryStore.to_flat`).
    """

    method: str
    model: Any
    server: Any
    rows: list[dict] = field(default_factory=list)
    restored: int = 0
    clients: MemoryStore = field(default_factory=MemoryStore)

    @property
    def new_rows(self) -> list[dict]:
        """The rows written in this process."""
        return self.rows[self.restored :]


class Run:
    """One run directory, from its checks to its summary; see the module docstring.

    :meth:`open` opens a run: it checks the directory, loads the task, the first
    method's model and the partitions, writes the run's first files and, on a resume,
    restores every method. The constructor only holds what :meth:`open` gives it.

    Args:
        cfg: The configuration, resolved against the run's own (:meth:`open`).
        layout: The run directory.
        task: The loaded task.
        prep: Its partitions and tokenized splits, shared by every method.
        trackers: The open trackers (:func:`fedexlora.run.trackers.open_trackers`).
        resume: Whether the run continues from its checkpoints.
        say: Prints a message (``print``, or a rich console's ``print``).
        first_model: The model whose tokenizer encoded the task, for ``first_method``
            when it is not restored (it is not loaded twice); ``None``: every method
            loads its own.
        first_method: The method ``first_model`` was built for: the first of
            ``cfg.methods`` that has not finished (default: the first).
        restored: Method -> ``(model, server, clients)`` brought back from its newest
            intact checkpoint.
        done_rows: Method -> the rows that checkpoint holds.
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: RunLayout,
        task,
        prep: Prepared,
        *,
        trackers,
        resume: bool = False,
        say: Callable[[str], Any] = print,
        first_model=None,
        first_method: str | None = None,
        restored: dict[str, tuple] | None = None,
        done_rows: dict[str, list[dict]] | None = None,
    ):
        self.cfg = cfg
        self.layout = layout
        self.task = task
        self.prep = prep
        self.trackers = trackers
        self.resume = resume
        self.say = say
        self.fingerprint = config_fingerprint(cfg)
        self._first_model = first_model
        self._first_method = first_method or cfg.methods[0]
        self._restored: dict[str, tuple] = dict(restored or {})
        self._done_rows: dict[str, list[dict]] = dict(done_rows or {})
        self.all_rows: list[dict] = []

    @classmethod
    def open(
        cls,
        cfg: RunConfig,
        out: str | Path,
        *,
        resume: bool = False,
        say: Callable[[str], Any] = print,
        resume_hint: str = "pass --resume to continue it",
    ) -> Run:
        """Opens the run in ``out``, new or resumed, and says what it trains on.

        In this order, so that a bad input leaves nothing behind: the configuration is
        resolved against the run's ``config.toml`` (a resume runs as the run ran) and the
        directory checked; the task is loaded, then the first method's model (its
        tokenizer encodes the task, and the first method trains it) and the partitions.
        Only then is anything written: ``config.toml`` and ``partitions.txt``, and
        ``metrics.jsonl`` (empty; on a resume, cut back to the rows of the checkpoints
        every method is restored from).

        Args:
            cfg: A validated configuration.
            out: The run directory.
            resume: Continue the run in ``out`` from each method's last intact checkpoint.
            say: Prints a message (``print``, or a rich console's ``print``).
            resume_hint: How the user resumes, for the message when ``out`` holds a run.

        Raises:
            RunError: If ``out`` holds a run and ``resume`` is not set, or the reverse.
            CheckpointError: If a checkpoint is corrupt or does not match the configuration.
        """
        layout = RunLayout(out)
        ran = None
        if resume and layout.config.is_file():
            ran = load_run_config(layout.config)
        cfg = cfg.resolved(ran)  # config.toml says how the run ran
        if resume:
            if not layout.config.is_file():
                raise RunError(f"--resume: {str(layout.root)!r} holds no run (no config.toml)")
        elif layout.holds_run():
            raise RunError(
                f"--out {str(layout.root)!r} already holds a run; {resume_hint} or "
                "choose another directory"
            )
        # the task, the model and the partitions first: a bad input leaves nothing behind
        task = load_task_for(cfg)
        problem = stop_metric_error(cfg, task.metric_names)
        if problem is not None:
            raise RunError(problem)
        # the first method still to run: a finished one is not loaded (a cell gaining a
        # method would load an 8B model only to tokenize)
        kept = finished_methods(cfg, layout) if resume else set()
        first = next((m for m in cfg.methods if m not in kept), cfg.methods[0])
        first_model, tokenizer = new_model(cfg, task, first)
        prep = prepare(cfg, tokenizer, task)
        if cfg.dp:  # each client checks its own too; this names the problem before round 1
            from fedexlora.training.privacy import check_delta, plan

            sizes = [len(p) for p in prep.parts]
            check_delta(cfg.dp_delta, sizes)
            plan(cfg, sizes)  # an epsilon no noise meets is refused before a file is written
        layout.root.mkdir(parents=True, exist_ok=True)
        if not resume:
            write_atomic(layout.config, cfg.to_toml())
        if resume:  # on the rows it began with
            check_client_rows(cfg, task, layout)
        say(f"task {cfg.task}: {len(prep.task.train)} train / {len(prep.task.test)} test")
        say(_partition_summary(layout, prep))
        if not resume:
            _note_partition(cfg, task, layout)
        restored: dict[str, tuple] = {}
        done_rows: dict[str, list[dict]] = {}
        if resume:
            restored, done_rows = restore_run(
                cfg, task, layout.root, config_fingerprint(cfg), say, kept=kept
            )
            # checked against it: config.toml now says how the run goes on, with what a
            # resume may change (--rounds...), still listing every method it holds rows of
            # (a compare cell gaining a method runs that one alone)
            held = list(dict.fromkeys([*(ran.methods if ran else ()), *cfg.methods]))
            write_atomic(layout.config, cfg.replace(methods=held).to_toml())
        else:
            layout.metrics.write_text("")
        trackers = open_trackers(cfg, layout.root, resume)
        return cls(
            cfg, layout, task, prep, trackers=trackers, resume=resume, say=say,
            first_model=first_model, first_method=first, restored=restored,
            done_rows=done_rows,
        )  # fmt: skip

    # -- the methods ------------------------------------------------------------------
    def methods(self) -> Iterator[MethodRun]:
        """Each method of the run, restored or new; those already finished are skipped.

        The first method reuses the model loaded to tokenize the task. A method's model
        is released when the loop moves on to the next one.
        """
        for method in self.cfg.methods:
            rows = list(self._done_rows.get(method, []))
            if method not in self._restored and rows:  # finished, kept without a checkpoint
                self.all_rows.extend(rows)
                continue
            clients = MemoryStore()
            if method in self._restored:
                model, server, clients = self._restored.pop(method)
            else:
                model = self._first_model if method == self._first_method else None
                if model is None:
                    model = new_model(self.cfg, self.task, method)[0]
                server = new_server(self.cfg, method, model)
            self._first_model = None
            current = MethodRun(method, model, server, rows, len(rows), clients)
            if server.round < self.cfg.rounds:
                t0 = time.perf_counter()
                yield current
                dropped = sorted({c for r in current.new_rows for c in r.get("dropped", [])})
                self.say(
                    f"{method}: {len(current.new_rows)} rounds in "
                    f"{time.perf_counter() - t0:.1f}s"
                    + (f" (clients dropped at some round: {dropped})" if dropped else "")
                )
            self.all_rows.extend(current.rows)
            del current, model, server

    def record(self, current: MethodRun, row: dict) -> None:
        """After a round: the checkpoint written, the row appended and fsynced, and logged.

        The checkpoint's seconds go into the row's ``split_seconds`` (``checkpoint``, and
        ``total``: the round's wall time up to here), so the row is written after it
        (the checkpoint's own copy of the row, which a resume writes back, holds the split
        without them). A round that fails the
        exactness check (:meth:`_check_exact`) still writes its row, and no checkpoint.
        """
        t0 = time.perf_counter()
        current.rows.append(row)
        try:
            self._check_exact(current.method, row)
        except RunError as exc:
            # the evidence is kept, marked: the method has not finished (a resume runs the
            # round again from its checkpoint: fedexlora.run.stopping.method_done)
            row["exactness_error"] = str(exc)
            append_row(self.layout.metrics, row)
            self.trackers.log_row(row)
            raise
        t1 = time.perf_counter()
        save_checkpoint(
            self.layout.checkpoints(current.method),
            current.server,
            meta={
                "rows": current.rows,
                "fingerprint": self.fingerprint,
                "parts": self.prep.parts,
                "config": self.cfg.to_dict(),
            },
            keep=self.cfg.keep_checkpoints,
            base=base_deltas(current.model),
            clients=current.clients.to_flat(),
        )
        split = row.get("split_seconds")
        if split is not None:
            now = time.perf_counter()
            split["checkpoint"] += now - t1
            split["total"] = row["seconds"] + (now - t0)
        append_row(self.layout.metrics, row)
        self.trackers.log_row(row)

    def _check_exact(self, method: str, row: dict) -> None:
        """Fails the run when a method declared exact is over ``EXACT_BOUND`` from the ideal.

        Over the bound, the method's server math is checked on random factors
        (:meth:`MethodSpec.math_deviation`): math that is not exact is an error, and so
        is any departure with the residuals beside the weights, where float rounding is
        about 1e-7 of the update. Folded into fp32 weights with exact math, a figure within
        ``ROUNDING_MARGIN`` times fp32's unit rounding of the weights (the row's
        ``rounding_floor``) is fp32's rounding of a small update: ``summary.md`` says it,
        and no error is raised; beyond it, it is an error.
        The row is written first (``metrics.jsonl`` keeps the evidence); the round's
        checkpoint is not, so no later run resumes from that model.

        Raises:
            RunError: If the method is declared exact, no lossy mode is on, and the model
                is over the bound from the ideal for a reason other than fp32 rounding.
        """
        from fedexlora.core.methods import get_method

        worst = (row.get("effective_deviation") or {}).get("max")
        if worst is None or worst <= EXACT_BOUND or self.cfg.approximate:
            return
        spec = get_method(method)
        if not spec.exact:
            return
        math = get_method(spec.server).math_deviation()
        head = (
            f"{method} round {row['round']}: the model is {worst:.2g} of the round's update "
            f"from the ideal average of the clients' models, over the {EXACT_BOUND:g} that a "
            f"method declared exact ({spec.title}, MethodSpec.exact) may be off by float "
            "rounding"
        )
        tail = f" The round's row is in {self.layout.metrics}; docs/ARCHITECTURE.md says what "
        tail += "`exact` promises."
        if math > _MATH_BOUND:
            raise RunError(
                f"{head}, and its server math is {math:.2g} from sum_i p_i B_i A_i on random "
                "factors in fp64 (MethodSpec.math_deviation): it is not exact. Fix its "
                f"`aggregate`, or declare it exact=False.{tail}"
            )
        if self.cfg.side_branch:
            raise RunError(
                f"{head}, though its server math is exact on random factors and, with the "
                "residuals beside the weights, float rounding is about 1e-7 of the update: "
                "the model departs from what the server computed. Please report it with "
                f"config.toml and metrics.jsonl.{tail}"
            )
        floor = row.get("rounding_floor")
        if floor is not None and worst > ROUNDING_MARGIN * floor:
            raise RunError(
                f"{head}, though its server math is exact on random factors, and fp32's "
                f"rounding of these weights explains at most {ROUNDING_MARGIN * floor:.2g} of "
                "the update: the model departs from what the server computed. Please report "
                f"it with config.toml and metrics.jsonl.{tail}"
            )

    def run_token(self) -> str:
        """This run's identity (Flower clients key their state on it); kept on a resume."""
        path = self.layout.run_token
        if self.resume and path.is_file():
            return path.read_text().strip()
        token = uuid.uuid4().hex
        write_atomic(path, token)
        return token

    def finish(self) -> list[dict]:
        """Every method's rows in order in ``metrics.jsonl``, the summary and the plots."""
        if self.resume:  # restored rows were written first: every method's rows in order
            others = [  # of methods the run no longer lists: kept
                r for r in read_metrics(self.layout.metrics)
                if r.get("method") not in self.cfg.methods
            ]  # fmt: skip
            write_rows(self.layout.metrics, self.all_rows + others)
        write_summary(
            self.layout.root,
            self.all_rows,
            self.cfg.to_toml(),
            extra=recipe_section(self.cfg, self.all_rows),
            folded_fp32=not self.cfg.side_branch,
        )
        self.trackers.finish()
        return self.all_rows


def _note_partition(cfg: RunConfig, task, layout: RunLayout) -> None:
    """Adds a comment to ``config.toml`` when the clients were not partitioned as it says."""
    from fedexlora.run.build import effective_partition

    _, note = effective_partition(cfg, task)
    if note and cfg.client_data is None:  # own files: partitions.txt says so
        path = layout.config
        write_atomic(path, path.read_text() + f"\n# note: {note}\n")


def _partition_summary(layout: RunLayout, prep: Prepared) -> str:
    """The partition table, written to ``partitions.txt``; shortened on screen when long."""
    write_atomic(layout.partitions, prep.partition_table + "\n")
    lines = prep.partition_table.splitlines()
    if len(prep.parts) <= _TABLE_LINES:
        return prep.partition_table
    sizes = sorted(len(p) for p in prep.parts)
    return "\n".join(
        lines[: _TABLE_LINES // 2 + 1]
        + [
            f"   ... {len(sizes)} clients of {sizes[0]} to {sizes[-1]} examples "
            f"(median {sizes[len(sizes) // 2]}): see partitions.txt",
            lines[-1],
        ]
    )


def run_tasks(
    cfg: RunConfig,
    tasks: tuple[str, ...] | list[str],
    out: str | Path,
    run_one: Callable[[RunConfig, Path, bool], Any],
    *,
    say: Callable[[str], Any] = print,
) -> dict[str, list[dict]]:
    """Runs ``cfg`` on every task of a multi-task recipe, each in ``out/<task>/``.

    ``run_one(cfg, directory, resume)`` runs one task on the chosen engine. A task whose
    directory already holds all its rows is not run again; one that holds some resumes.
    Then ``out/summary.md`` gets the recipe's paper figures beside every task's.

    Returns:
        Per task, its metrics rows.
    """
    layout = RunLayout(out)
    layout.root.mkdir(parents=True, exist_ok=True)
    recipe = get_recipe(cfg.recipe) if cfg.recipe else None
    per_task: dict[str, list[dict]] = {}
    for i, task in enumerate(tasks, 1):
        sub = layout.task(task)
        resume = sub.config.is_file()
        name = recipe.name if recipe is not None else "run"
        say(f"[{i}/{len(tasks)}] {name}: task {task} -> {sub.root}")
        done = resume and cell_done(cfg, intact_rows(sub.metrics))  # all rounds, or stopped
        if not done:
            run_one(cfg.replace(task=task), sub.root, resume)
        per_task[task] = read_metrics(sub.metrics)
    title = f"# fedex-lora recipe {recipe.name}\n\n" if recipe is not None else "# fedex-lora\n\n"
    text = title + (paper_section(recipe, per_task, cfg) if recipe is not None else "")
    layout.summary.write_text(text)
    say(text)
    return per_task
