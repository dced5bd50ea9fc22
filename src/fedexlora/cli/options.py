"""Typer options generated from the configuration's own declarations.

Each :class:`~fedexlora.config.RunConfig` field declares its flag, help, panel and check
once (:class:`~fedexlora.config.Option`); ``fedexlora run`` offers every field as an
option and ``fedexlora compare`` some of them, both built here. An option defaults to
unset (``None``), so that a ``--config`` file or a ``--recipe`` can set it; its help says
the configuration's default, "(default: X)" (brackets would be read as rich markup).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any

import typer

from fedexlora.config import FLAGS, PANELS, ConfigError, Option, RunConfig, shown_default

__all__ = ["command", "config_params", "from_flags", "in_flags", "option"]


def _fields():
    return {f.name: f for f in fields(RunConfig)}


def option(
    help: str,
    *names: str,
    panel: str,
    default: Any = None,
    default_text: str | None = "",
    kind: type = str,
) -> inspect.Parameter:
    """One hand-written option (not a config field), as :func:`command` takes them.

    Args:
        help: Its sentence, without the default.
        names: Its flags; the parameter is named after the first, without dashes.
        panel: The ``--help`` panel.
        default: The value when the flag is not given.
        default_text: How the help states the default (``""``: it does not).
        kind: The value's type.
    """
    pname = names[0].lstrip("-").split("/")[0].replace("-", "_")
    text = help + (f" (default: {default_text})." if default_text else ".")
    info = typer.Option(default, *names, help=text, rich_help_panel=panel, show_default=False)
    return inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)


def config_params(
    keys: Iterable[str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    panel: str | None = None,
) -> list[inspect.Parameter]:
    """Options for config fields, named by their keys, ordered by panel then field.

    Args:
        keys: The fields to offer (default: all).
        defaults: A command's own defaults, stated in the help instead of the config's.
        panel: One panel for all of them, in the order of ``keys`` (default: each
            field's own).
    """
    hints = typing.get_type_hints(RunConfig)
    everything = _fields()
    chosen = list(everything) if keys is None else list(keys)
    order = {p: i for i, p in enumerate(PANELS)}
    if panel is None:  # by panel; one panel given: in the order asked
        chosen.sort(key=lambda k: order.get(everything[k].metadata["option"].panel, len(order)))
    params = []
    for key in chosen:
        f = everything[key]
        opt: Option = f.metadata["option"]
        if defaults is not None and key in defaults:
            value = defaults[key]
            said = "all" if value is None else shown_default(value)
        elif opt.default_text is not None:
            said = opt.default_text
        else:
            value = f.default if f.default is not MISSING else f.default_factory()
            said = "" if value is None else shown_default(value)
        text = opt.help + (f" (default: {said})." if said else ".")
        kind = _cli_type(hints[key])
        flags = opt.flags or ("--" + key.replace("_", "-"),)
        if kind is bool:
            flags = (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])
        info = typer.Option(
            None,
            *flags,
            help=text,
            rich_help_panel=panel or opt.panel,
            show_default=False,
        )
        params.append(
            inspect.Parameter(
                key, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind | None
            )
        )
    return params


def _unset_removed(hint: Any) -> Any:
    """``int | None`` -> ``int``; any other hint as it is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _cli_type(hint: Any) -> type:
    """The type a flag reads: the field's, a comma list read as one string."""
    base = _unset_removed(hint)
    return str if typing.get_origin(base) is list else base


def command(params: list[inspect.Parameter]) -> Callable[[Callable], Callable]:
    """Gives ``fn(**given)`` the signature ``params``, which Typer reads as its options."""

    def wrap(fn: Callable) -> Callable:
        fn.__signature__ = inspect.Signature(params)
        fn.__annotations__ = {p.name: p.annotation for p in params}
        return fn

    return wrap


def from_flags(given: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config mapping of the options a user gave, and what could not be read.

    A comma list becomes a list (of integers for ``client_ranks``); unset options are
    left out. An error names the flag.
    """
    hints = typing.get_type_hints(RunConfig)
    out: dict[str, Any] = {}
    errs = []
    for key, value in given.items():
        if value is None or key not in hints:
            continue
        base = _unset_removed(hints[key])
        if typing.get_origin(base) is list:
            items = [v.strip() for v in str(value).split(",") if v.strip()]
            if typing.get_args(base) == (int,):
                try:
                    items = [int(v) for v in items]
                except ValueError:
                    errs.append(f"{FLAGS[key]} must be a comma list of integers, got {value!r}")
                    continue
            value = items
        elif hasattr(value, "__fspath__"):
            value = str(value)
        out[key] = value
    return out, errs


def in_flags(exc: ConfigError, typed: Mapping[str, Any]) -> ConfigError:
    """``exc`` with each setting the user gave as a flag named as the flag they typed.

    The configuration names its keys (`lora_r`); a user who typed ``--rank`` reads
    `--rank`. Settings from a TOML file keep their key, which is what the file says.
    """
    errors = []
    for message in exc.errors:
        for key in typed:
            if key in FLAGS:
                message = message.replace(f"`{key}`", f"`{FLAGS[key]}`")
        errors.append(message)
    return type(exc)(errors)
