"""``fedexlora validate``: every error of a config file, at once."""

from __future__ import annotations

import re
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
    problems = [_as_keys(p) for p in input_problems(cfg)]
    if problems:
        fail("\n".join([f"{config}:", *(f"  - {p}" for p in problems)]))
    console.print(f"{config}: valid")


def _as_keys(problem: str) -> str:
    """A problem as the file spells its settings: ``--max-length`` becomes ```max_length```.

    The checks are the ones ``run`` makes, which name the flag typed; a file has keys.
    """
    from fedexlora.config import FLAGS

    key_of = {flag: key for key, flag in FLAGS.items()}
    return re.sub(
        r"(?<![\w`-])--[a-z][a-z0-9-]*",
        lambda m: f"`{key_of[m.group()]}`" if m.group() in key_of else m.group(),
        problem,
    )
