"""The ``fedexlora`` command line: one module per command, registered on one Typer app.

``run``, ``validate`` and ``export`` (panel "Run") train and ship a model; ``methods``,
``recipes``, ``compare`` and ``bench`` (panel "Experiments") describe, reproduce and
measure. A command imports what it needs (transformers, peft, datasets, Flower) when it
runs, not when the CLI starts.
"""

from __future__ import annotations

import sys

import typer

from fedexlora.cli._common import console, err_console
from fedexlora.cli.compare import compare_cmd
from fedexlora.cli.export import export_cmd
from fedexlora.cli.methods import methods as methods_cmd
from fedexlora.cli.recipes import recipes_cmd
from fedexlora.cli.run import run_cmd
from fedexlora.cli.validate import validate_cmd
from fedexlora.experiments.bench import bench_app

__all__ = ["app", "console", "err_console", "main"]

RUN_PANEL = "Run"
EXPERIMENTS_PANEL = "Experiments"

app = typer.Typer(
    pretty_exceptions_show_locals=False,
    add_completion=False,
    no_args_is_help=True,
    help="Federated LoRA fine-tuning with exact aggregation (FedEx-LoRA) and its baselines.",
)


def _version(value: bool) -> None:
    if value:
        from fedexlora import __version__

        typer.echo(f"fedex-lora {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    pass


app.command("run", rich_help_panel=RUN_PANEL)(run_cmd)
app.command("validate", rich_help_panel=RUN_PANEL)(validate_cmd)
app.command("export", rich_help_panel=RUN_PANEL)(export_cmd)
app.command("methods", rich_help_panel=EXPERIMENTS_PANEL)(methods_cmd)
app.command("recipes", rich_help_panel=EXPERIMENTS_PANEL)(recipes_cmd)
app.command("compare", rich_help_panel=EXPERIMENTS_PANEL)(compare_cmd)
app.add_typer(bench_app, name="bench", rich_help_panel=EXPERIMENTS_PANEL)


def main() -> None:  # pragma: no cover
    """Entry point for ``python -m fedexlora``."""
    app(prog_name="fedexlora")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
