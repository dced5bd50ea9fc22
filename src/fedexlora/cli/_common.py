"""What every command shares: the consoles, one-line errors, quiet libraries."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

__all__ = ["console", "err_console", "fail", "quiet_libraries"]

console = Console()
err_console = Console(stderr=True)


_WRITE_ERRORS = ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EIO")


def write_error(exc: OSError, again: str) -> str | None:
    """One line for a disk that stopped taking the run's files, or ``None``.

    A disk full, read-only or denied; the line says how to go on (``again``). A round's
    files are written atomically, so the rounds done are intact.
    """
    import errno

    if errno.errorcode.get(exc.errno or -1) not in _WRITE_ERRORS:
        return None
    where = f" {exc.filename}" if exc.filename else ""
    return (
        f"cannot write{where}: {exc.strerror}; the rounds done are checkpointed: free the "
        f"space (or make it writable), then continue with: {again}"
    )


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
