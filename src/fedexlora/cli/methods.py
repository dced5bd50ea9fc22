"""``fedexlora methods``: the method registry as a table."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def methods() -> None:
    """Every method: its paper, whether it is exact and linear, what travels, bytes per round."""
    from fedexlora.core.methods import REGISTRY
    from fedexlora.core.secure import secure_refusal

    table = Table(
        title="fedexlora run --method NAME (bytes per round: d x n layer, rank r, k clients)"
    )
    for h in ("name", "method", "paper", "exact", "linear", "secure agg.", "clients train",
              "up", "down", "bytes per round"):  # fmt: skip
        table.add_column(h, overflow="fold")
    for spec in REGISTRY.values():
        cells = [
            spec.name,
            spec.title,
            spec.paper,
            "yes" if spec.exact else "no",
            "yes" if spec.linear else "no",
            ("yes, + products" if spec.secure_products else "yes")
            if secure_refusal(spec) is None
            else "no",
            spec.trains,
            spec.uploads,
            spec.downloads,
            spec.bytes_per_round,
        ]
        table.add_row(*map(escape, cells))  # a formula's [..] is not rich markup
    console = Console()
    # logs and pipes: wide enough that no cell wraps
    (console if console.is_terminal else Console(width=400)).print(table)
