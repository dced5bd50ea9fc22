"""A whole run: every method on identical partitions, the run directory and resume."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from fedexlora.bridge.adapters import folded_weights, load_side_state, set_state, side_state
from fedexlora.config import RunConfig
from fedexlora.run.checkpoint import (
    CheckpointError,
    config_fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from fedexlora.run.engine import new_model, new_server, prepare
from fedexlora.run.recipes import recipe_section
from fedexlora.run.report import write_summary
from fedexlora.run.simulation import run_method
from fedexlora.run.trackers import open_trackers

__all__ = [
    "RunError",
    "append_row",
    "apply_base_deltas",
    "base_deltas",
    "write_atomic",
    "write_rows",
    "load_task_for",
    "restore_latest",
    "restore_model",
    "restore_run",
    "run_experiment",
]


class RunError(ValueError):
    """A run that cannot start or continue, for a reason the user can fix."""


def base_deltas(model) -> dict[str, torch.Tensor]:
    """What folding changed in the model: each layer's accumulated residual.

    ``side.<module>.U|V|dense``, factored or dense (:func:`fedexlora.bridge.adapters.side_state`):
    a freshly loaded model plus these is the model, bit for bit.
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


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename: whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Writes ``metrics.jsonl`` with exactly ``rows``, atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_row(path: Path, row: dict) -> None:
    """Appends one JSON row to ``metrics.jsonl`` and fsyncs it."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def restore_model(cfg: RunConfig, task, method: str, ckpt: Path, fingerprint: str | None):
    """A fresh model and server brought to the state of checkpoint ``ckpt``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model, tokenizer = new_model(cfg, task, method)
    server = new_server(cfg, method, model)
    info = load_checkpoint(ckpt, server, fingerprint=fingerprint)
    try:
        deltas = load_file(str(ckpt / "base_deltas.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: base deltas unreadable: {exc}", corrupt=True
        ) from None
    apply_base_deltas(model, deltas)
    set_state(model, server.state)
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
    import warnings

    from fedexlora.run.checkpoint import checkpoints

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


def restore_run(cfg: RunConfig, task, out: Path, fingerprint: str, say=print):
    """Every method of the run in ``out`` restored from its newest intact checkpoint.

    Rewrites ``metrics.jsonl`` to the rows those checkpoints hold (rows of a round that
    was not checkpointed are dropped: it runs again). Shared by both engines.

    Returns:
        ``(restored, done_rows)``: method -> ``(model, server)``, and method -> its rows,
        for the methods that have a checkpoint.
    """
    restored: dict[str, tuple] = {}
    done_rows: dict[str, list[dict]] = {}
    for method in cfg.methods:
        found = restore_latest(cfg, task, method, out / "checkpoints" / method, fingerprint)
        if found is None:
            continue
        model, _, server, info = found
        restored[method] = (model, server)
        done_rows[method] = info["rows"]
        say(f"resuming {method} after round {server.round}")
    write_rows(out / "metrics.jsonl", [r for m in cfg.methods for r in done_rows.get(m, [])])
    return restored, done_rows


def run_experiment(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    console=None,
    tamper=None,
) -> list[dict]:
    """Runs every method of ``cfg`` and writes the run directory.

    The directory gets ``config.toml``, ``metrics.jsonl`` (one row per method and round,
    appended and fsynced as each round ends), ``summary.md``, PNG plots and, per method,
    ``checkpoints/<method>/round-XXXX`` after every round.

    Args:
        cfg: A validated configuration.
        out_dir: The run directory.
        resume: Continue a run in ``out_dir`` from its last complete round.
        progress: Show progress bars.
        console: A ``rich`` console for messages (plain ``print`` when ``None``).
        tamper: Test hook passed to :func:`fedexlora.run.simulation.run_method`.

    Returns:
        All metrics rows.

    Raises:
        RunError: If ``out_dir`` holds a run and ``resume`` is not set, or the reverse.
        CheckpointError: If a checkpoint is corrupt or does not match the configuration.
    """
    say = console.print if console is not None else print
    out = Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    fingerprint = config_fingerprint(cfg.to_dict())
    if resume:
        if not (out / "config.toml").is_file():
            raise RunError(f"--resume: {str(out)!r} holds no run (no config.toml)")
    elif metrics_path.exists() and metrics_path.stat().st_size > 0:
        raise RunError(
            f"--out {str(out)!r} already holds a run; pass --resume to continue it or "
            "choose another directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_atomic(out / "config.toml", cfg.to_toml())

    task = load_task_for(cfg)
    first_model, tokenizer = new_model(cfg, task, cfg.methods[0])
    prep = prepare(cfg, tokenizer, task)
    say(
        f"[bold]task[/bold] {cfg.task}: {len(prep.task.train)} train / {len(prep.task.test)} test"
        if console is not None
        else f"task {cfg.task}: {len(prep.task.train)} train / {len(prep.task.test)} test"
    )
    say(_partition_summary(prep, out))
    if not resume:
        note_partition(cfg, task, out)

    # On resume, what each method's last checkpoint says; rows past it are dropped.
    done_rows: dict[str, list[dict]] = {}
    restored: dict[str, tuple] = {}
    if resume:
        restored, done_rows = restore_run(cfg, task, out, fingerprint, say)
    else:
        metrics_path.write_text("")

    trackers = open_trackers(cfg, out, resume)
    all_rows: list[dict] = []
    for i, method in enumerate(cfg.methods):
        rows = list(done_rows.get(method, []))
        if method in restored:
            model, server = restored.pop(method)
        else:
            model = (
                first_model
                if i == 0 and first_model is not None
                else new_model(cfg, task, method)[0]
            )
            server = new_server(cfg, method, model)
        first_model = None

        def after_round(row, srv, mdl, _rows=rows, _method=method):
            _rows.append(row)
            append_row(metrics_path, row)
            trackers.log_row(row)
            save_checkpoint(
                out / "checkpoints" / _method,
                srv,
                meta={
                    "rows": _rows,
                    "fingerprint": fingerprint,
                    "parts": prep.parts,
                    "config": cfg.to_dict(),
                },
                keep=cfg.keep_checkpoints,
                base=base_deltas(mdl),
            )

        if server.round < cfg.rounds:
            t0 = time.perf_counter()
            run_method(
                cfg,
                method,
                prep,
                out_dir=out,
                progress=progress,
                tamper=tamper,
                model=model,
                server=server,
                after_round=after_round,
                history=rows,
            )
            say(
                f"{method}: {cfg.rounds - (len(done_rows.get(method, [])))} rounds in "
                f"{time.perf_counter() - t0:.1f}s"
            )
        all_rows.extend(rows)
        del model
    if resume:  # restored rows were written first: put every method's rows in order
        write_rows(metrics_path, all_rows)
    write_summary(out, all_rows, cfg.to_toml(), extra=recipe_section(cfg, all_rows))
    trackers.finish()
    return all_rows


_TABLE_LINES = 20


def note_partition(cfg: RunConfig, task, out: Path) -> None:
    """Adds a comment to ``config.toml`` when the clients were not partitioned as it says."""
    from fedexlora.run.engine import effective_partition

    _, note = effective_partition(cfg, task)
    if note:
        path = out / "config.toml"
        write_atomic(path, path.read_text() + f"\n# note: {note}\n")


def _partition_summary(prep, out: Path) -> str:
    """The partition table, written to ``partitions.txt``; shortened on screen when long."""
    write_atomic(out / "partitions.txt", prep.partition_table + "\n")
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


def load_task_for(cfg: RunConfig):
    """The configuration's task, split and sliced as the run uses it."""
    from fedexlora.tasks.data import load_task

    return load_task(
        cfg.task,
        seed=cfg.seed,
        test_fraction=cfg.test_fraction,
        max_train=cfg.max_train,
        max_test=cfg.max_test,
        data_dir=cfg.data_dir,
    )
