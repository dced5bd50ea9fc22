"""Resume: a run's models and servers brought back from their newest intact checkpoints."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from fedexlora.bridge.adapters import set_state
from fedexlora.bridge.fold import folded_weights, load_side_state, side_state
from fedexlora.config import RESUME_SAFE, RunConfig, load_run_config
from fedexlora.run.build import new_model, new_server
from fedexlora.run.checkpoint import (
    BASE_DELTAS,
    CLIENTS,
    CheckpointError,
    checkpoints,
    config_fingerprint,
    load_checkpoint,
)
from fedexlora.run.client_store import MemoryStore
from fedexlora.run.layout import RunError, RunLayout, write_rows
from fedexlora.run.report import intact_rows
from fedexlora.run.stopping import method_done

__all__ = [
    "apply_base_deltas",
    "base_deltas",
    "check_client_rows",
    "finished_methods",
    "load_task_for",
    "restore_latest",
    "restore_model",
    "restore_run",
]


def base_deltas(model) -> dict[str, torch.Tensor]:
    """What folding changed in the model: each layer's accumulated residual.

    ``side.<module>.*`` (:func:`fedexlora.bridge.fold.side_state`): a freshly loaded
    model plus these is the model, bit for bit.
    """
    return side_state(model)


@torch.no_grad()
def apply_base_deltas(model, deltas: dict[str, torch.Tensor]) -> None:
    """Restores :func:`base_deltas` onto a freshly loaded model.

    Checkpoints written before the accumulators hold ``W - W0`` of each fp32 layer in
    fp64 under the module's name; those are still restored (``W0 + delta -> W``).
    """
    side = {k: v for k, v in deltas.items() if k.startswith("side.")}
    legacy = {k: v for k, v in deltas.items() if not k.startswith("side.")}
    if legacy:
        weights = folded_weights(model)
        if set(legacy) != set(weights):
            raise CheckpointError("checkpoint base deltas cover other modules than the model")
        for n, w in weights.items():
            if tuple(legacy[n].shape) != tuple(w.shape):
                raise CheckpointError(f"checkpoint base delta for {n!r} has the wrong shape")
            w.copy_((w.double() + legacy[n]).to(w.dtype))
    try:
        load_side_state(model, side)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint side branches do not match the model: {exc}") from None


def restore_model(cfg: RunConfig, task, method: str, ckpt: Path, fingerprint: str | None):
    """A fresh model and server brought to the state of checkpoint ``ckpt``.

    ``info["clients"]`` is what the in-process clients kept of their own, their store
    (:class:`fedexlora.run.client_store.MemoryStore`: their kept parts, empty for most
    methods, and their DP-SGD records).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model, tokenizer = new_model(cfg, task, method)
    server = new_server(cfg, method, model)
    info = load_checkpoint(ckpt, server, fingerprint=fingerprint)
    try:
        deltas = load_file(str(ckpt / BASE_DELTAS))
        own = load_file(str(ckpt / CLIENTS)) if CLIENTS in info.get("files", {}) else {}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: base deltas unreadable: {exc}", corrupt=True
        ) from None
    apply_base_deltas(model, deltas)
    set_state(model, server.state)
    info["clients"] = MemoryStore.from_flat(own)  # the in-process clients' own
    return model, tokenizer, server, info


def restore_latest(cfg: RunConfig, task, method: str, directory: Path, fingerprint):
    """:func:`restore_model` from the newest checkpoint in ``directory`` that is intact.

    A damaged newest checkpoint (unreadable, or left incomplete by a crash) is skipped with
    a warning and the one before it is used; one from another configuration is an error.
    Returns ``None`` when there is no checkpoint at all.

    Raises:
        CheckpointError: If no checkpoint is intact, or the newest intact one does not
            match the configuration.
    """
    complete = checkpoints(directory)
    broken = [
        p for p in sorted(Path(directory).glob("round-*")) if p.is_dir() and p not in complete
    ]
    for p in broken:
        warnings.warn(f"skipping incomplete checkpoint {str(p)!r}", stacklevel=2)
    first_error = None
    if broken and not complete:
        raise CheckpointError(
            f"checkpoint {str(broken[-1])!r} is unreadable or corrupt: a file it lists is "
            "missing or has the wrong size, and no older checkpoint is intact",
            corrupt=True,
        )
    for ckpt in reversed(complete):
        try:
            return restore_model(cfg, task, method, ckpt, fingerprint)
        except CheckpointError as exc:
            if not exc.corrupt:
                raise
            first_error = first_error or exc
            warnings.warn(f"{exc}; falling back to the checkpoint before it", stacklevel=2)
    if first_error is not None:
        raise first_error
    return None


def restore_run(
    cfg: RunConfig, task, out: Path, fingerprint: str, say=print, kept: set | None = None
):
    """Every method of the run in ``out`` restored from its newest intact checkpoint.

    Rewrites ``metrics.jsonl`` to the rows those checkpoints hold (rows of a round that
    was not checkpointed are dropped: it runs again). A method whose rows in
    ``metrics.jsonl`` are finished (every round, or stopped by the rule:
    :func:`fedexlora.run.stopping.method_done`) keeps them, is not loaded and is not run
    again, checkpoint or none: a study's cell kept without its checkpoints
    (``config.toml`` and ``metrics.jsonl``) is still whole. Rows of methods the run no
    longer lists stay, after its own. Shared by both engines.

    Args:
        cfg: The run's configuration, resolved against its ``config.toml``.
        task: The loaded task.
        out: The run directory.
        fingerprint: :func:`~fedexlora.run.checkpoint.config_fingerprint` of ``cfg``.
        say: Prints a message.
        kept: :func:`finished_methods`, when the caller has it already (read once).

    Returns:
        ``(restored, done_rows)``: method -> ``(model, server, clients)`` (its in-process
        clients' store: what they keep of their own, and their DP-SGD records),
        and method -> its rows, for the methods that have a checkpoint or finished rows.
    """
    layout = RunLayout(out)
    before = intact_rows(layout.metrics)
    kept = finished_methods(cfg, layout, before) if kept is None else kept
    if kept:  # no checkpoint's fingerprint is read for them
        _same_settings(cfg, layout, fingerprint)
    restored: dict[str, tuple] = {}
    done_rows: dict[str, list[dict]] = {}
    for method in cfg.methods:
        rows = [r for r in before if r.get("method") == method]
        if method in kept:
            done_rows[method] = rows
            say(f"{method} finished before ({len(rows)} rounds): its rows are kept")
            continue
        found = restore_latest(cfg, task, method, layout.checkpoints(method), fingerprint)
        if found is None:
            continue
        model, _, server, info = found
        restored[method] = (model, server, info["clients"])
        # a checkpoint's copy of its own round's row lacks the checkpoint's seconds (taken
        # before they were known): the row metrics.jsonl holds of that round has them
        written = {r.get("round"): r for r in rows}
        done_rows[method] = [_with_split(r, written.get(r.get("round"))) for r in info["rows"]]
        say(f"resuming {method} after round {server.round}")
    others = [r for r in before if r.get("method") not in cfg.methods]
    write_rows(layout.metrics, [r for m in cfg.methods for r in done_rows.get(m, [])] + others)
    return restored, done_rows


def _with_split(row: dict, written: dict | None) -> dict:
    """``row`` (from a checkpoint) with the ``split_seconds`` of ``written``.

    ``written`` is the same round's row in ``metrics.jsonl``, used only when it is the
    same row but for its seconds.
    """
    if written is None or "split_seconds" not in written:
        return row
    rest = {k: v for k, v in row.items() if k != "split_seconds"}
    if rest != {k: v for k, v in written.items() if k != "split_seconds"}:
        return row
    return {**row, "split_seconds": written["split_seconds"]}


def finished_methods(cfg: RunConfig, layout: RunLayout, rows: list[dict] | None = None) -> set:
    """The methods of ``cfg`` a resume keeps from their rows in ``metrics.jsonl``.

    Those that have finished (:func:`fedexlora.run.stopping.method_done`) and whose
    newest intact checkpoint, if any, is of their last row's round.
    """
    rows = intact_rows(layout.metrics) if rows is None else rows
    kept = set()
    for method in cfg.methods:
        mine = [r for r in rows if r.get("method") == method]
        if method_done(cfg, mine) and _checkpointed(layout.checkpoints(method), mine):
            kept.add(method)
    return kept


def _same_settings(cfg: RunConfig, layout: RunLayout, fingerprint: str) -> None:
    """Refuses a resume whose settings differ from those of ``config.toml``.

    Apart from :data:`~fedexlora.config.RESUME_SAFE` and the list of methods: a kept
    method's rows would sit beside rounds of other settings.

    Raises:
        CheckpointError: Naming the settings that differ.
    """
    ran = load_run_config(layout.config)
    if config_fingerprint(ran) == fingerprint:
        return
    was, now = ran.resolved().to_dict(), cfg.resolved(ran).to_dict()
    diff = [
        f"{k}: {was.get(k)!r} → {now.get(k)!r}"
        for k in sorted(set(was) | set(now))
        if k not in RESUME_SAFE and k != "methods" and was.get(k) != now.get(k)
    ]
    raise CheckpointError(
        f"--resume: {str(layout.config)!r} ran with other settings than this resume "
        f"({'; '.join(diff) or 'they hash differently'}); resume with its own settings or "
        "start a new run"
    )


def _checkpointed(directory: Path, rows: list[dict]) -> bool:
    """Whether the newest intact checkpoint, if any, is of ``rows``' last round.

    A row is written after its round's checkpoint, except that of a round that failed the
    exactness check (kept as evidence, with no checkpoint): such a method resumes from
    its checkpoint and runs the round again. A cell kept without checkpoints is trusted.
    """
    done = checkpoints(directory)
    return not done or done[-1].name == f"round-{rows[-1]['round']:04d}"


def check_client_rows(cfg: RunConfig, task, layout: RunLayout) -> None:
    """Refuses clients' files that changed since the run began (``--client-data``).

    The run's ``partitions.txt`` keeps its rows' digest; a resume would go on training,
    and an export would rebuild Fed-SB's frozen factors, on other rows.

    Raises:
        RunError: If the digest of ``task``'s training rows is not the one kept.
    """
    from fedexlora.tasks.own_data import rows_digest

    if cfg.client_data is None or not layout.partitions.is_file():
        return
    kept = re.search(r"rows digest ([0-9a-f]+)", layout.partitions.read_text())
    if kept is not None and kept.group(1) != rows_digest(task.train):
        raise RunError(
            f"--client-data {cfg.client_data}: the clients' files changed since the run "
            f"began (their rows' digest {rows_digest(task.train)}, the run's "
            f"{kept.group(1)} in partitions.txt); restore them, or start a new run"
        )


def load_task_for(cfg: RunConfig):
    """The configuration's task, split and sliced as the run uses it.

    With ``client_data`` its training rows are the clients' own files, each row's
    ``client`` beside it (:func:`fedexlora.tasks.own_data.clients_own_rows`).
    """
    from fedexlora.tasks.data import load_task

    task = load_task(
        cfg.task,
        seed=cfg.seed,
        test_fraction=cfg.test_fraction,
        max_train=cfg.max_train,
        max_test=cfg.max_test,
        data_dir=cfg.data_dir,
    )
    if cfg.client_data is not None:
        from fedexlora.tasks.own_data import clients_own_rows

        task.train = clients_own_rows(cfg.client_data, cfg.num_clients, task)
    return task
