"""What every command shares: the consoles, one-line errors, quiet libraries."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

__all__ = ["console", "err_console", "fail", "quiet_libraries"]

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``error: message`` on stderr and exits with ``code``.

    Args:
        message: Plain text; brackets in it are escaped, not read as rich markup.
        code: The exit status (2, a usage error: a bad flag, input or config file).

    Raises:
        typer.Exit: Always.
    """
    from rich.markup import escape

    # escaped: a message may hold brackets (pip extras, lists) that rich would eat
    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def quiet_libraries() -> None:
    """Silences the warnings and progress bars of the libraries a command loads."""
    from fedexlora.quiet import quiet_libraries as quiet

    quiet()
