"""``fedexlora validate``: every error of a config file, at once."""

from __future__ import annotations

from pathlib import Path

import typer

from fedexlora.cli._common import console, fail, quiet_libraries

__all__ = ["validate_cmd"]


def validate_cmd(config: Path = typer.Argument(..., help="A TOML config file.")) -> None:
    """Check a config file and list every error at once.

    CONFIG is a TOML file of `fedexlora run` settings. Its settings are checked, then what
    they name: the task (a local file is read), the device, the export directory, the
    packages the engine needs, and the maximum length against the model's positions.
    Exits 2 when there is an error, as `fedexlora run --config CONFIG` does.
    """
    quiet_libraries()  # before the imports: peft imports bitsandbytes, which logs
    from fedexlora.config import ConfigError
    from fedexlora.run.preflight import input_problems
    from fedexlora.run.recipes import load_config_file

    try:
        cfg = load_config_file(config)  # a recipe it names, applied as run applies it
    except ConfigError as exc:
        fail(str(exc))
    problems = input_problems(cfg)
    if problems:
        fail("\n".join([f"{config}:", *(f"  - {p}" for p in problems)]))
    console.print(f"{config}: valid")
