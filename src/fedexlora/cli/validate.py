"""``fedexlora validate``: every error of a config file, at once."""

from __future__ import annotations

from pathlib import Path

import typer

from fedexlora.cli._common import console, fail

__all__ = ["validate_cmd"]


def validate_cmd(config: Path = typer.Argument(..., help="A TOML config file.")) -> None:
    """Check a config file and list every error at once.

    CONFIG is a TOML file of `fedexlora run` settings; exits 2 when it has errors, as
    `fedexlora run --config CONFIG` does.
    """
    from fedexlora.config import ConfigError, load_config

    try:
        load_config(config)
    except ConfigError as exc:
        fail(str(exc))
    console.print(f"{config}: valid")
