"""``fedexlora recipes``: the paper's experiments, one ``run --recipe`` each."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fedexlora.cli._common import console

__all__ = ["recipes_cmd"]


def recipes_cmd() -> None:
    """The paper's experiments: one command each, with the paper's figure per method."""
    from fedexlora.run.recipes import recipe_table

    header, rows = recipe_table()
    table = Table(title="fedexlora run --recipe NAME (figures: the FedEx-LoRA paper)")
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    (console if console.is_terminal else Console(width=200)).print(table)
