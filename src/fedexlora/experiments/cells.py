"""The grid's coordinates: a federation :class:`Setting` and one run of it, a :class:`Cell`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cell", "Setting"]


@dataclass(frozen=True)
class Setting:
    """One federation setting of the grid.

    Attributes:
        name: Label used in tables, e.g. ``iid-3``.
        num_clients: Clients.
        partition: ``iid``, ``dirichlet`` or ``group`` (whole groups per client).
        alpha: Dirichlet concentration.
    """

    name: str
    num_clients: int
    partition: str
    alpha: float = 0.5


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a setting, a rank, local steps per round, a seed.

    ``steps`` is ``None`` when the grid has one steps value (the base configuration's);
    ``ceiling`` marks the centralized run of a study, once per client count.
    """

    setting: Setting
    rank: int
    steps: int | None
    seed: int
    ceiling: bool = False
    epsilon: float | None = None  # the DP axis (``inf``: no DP); None when not an axis

    @property
    def group(self) -> tuple:
        """The cell without its seed: the unit that a table row summarises."""
        return (self.setting, self.rank, self.steps, self.ceiling, self.epsilon)

    def dirname(self) -> str:
        """The cell's run directory name."""
        if self.ceiling:
            return f"centralized-{self.setting.num_clients}_r{self.rank}_seed{self.seed}"
        steps = "" if self.steps is None else f"_s{self.steps}"
        eps = "" if self.epsilon is None else f"_eps{self.epsilon:g}"
        return f"{self.setting.name}_r{self.rank}{steps}{eps}_seed{self.seed}"
