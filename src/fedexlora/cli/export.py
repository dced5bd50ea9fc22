"""``fedexlora export``: a run's final global model, as a PEFT adapter or a merged model."""

from __future__ import annotations

from pathlib import Path

import typer

from fedexlora.cli._common import console, fail, quiet_libraries

__all__ = ["export_cmd"]


def export_cmd(
    run_dir: Path = typer.Argument(..., help="A run directory written by `fedexlora run`."),
    dest: Path = typer.Argument(..., help="Where to write the model or adapter."),
    method: str | None = typer.Option(
        None, help="Which method's model (default: the run's first)."
    ),
    fmt: str | None = typer.Option(
        None,
        "--format",
        help="adapter (PEFT, exact on the unchanged base) or merged, a Hugging Face model "
        "(default: adapter for a run that kept a side branch, as an exact method does unless "
        "told otherwise and every bf16/fp16/quantized base does; merged otherwise, as after "
        "--no-fp32-side-branch).",
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Merged model dtype (default: fp32)."),
    allow_inexact: bool = typer.Option(
        False, "--allow-inexact", help="Allow a merged bf16/fp16 model (rounds the update)."
    ),
) -> None:
    """Export a run's final global model, exactly: a PEFT adapter or a merged model.

    RUN_DIR is a directory written by `fedexlora run`; DEST is where the model goes.
    """
    quiet_libraries()
    from fedexlora.run.checkpoint import CheckpointError
    from fedexlora.run.export import export_model
    from fedexlora.run.layout import RunError

    try:
        res = export_model(
            run_dir, dest, method, fmt=fmt, dtype=dtype, allow_inexact=allow_inexact or None
        )
    except (RunError, CheckpointError, ValueError, OSError) as exc:  # OSError: disk full...
        fail(str(exc))
    console.print(f"exported to {res.path} ({res.note})")
