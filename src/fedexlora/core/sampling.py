"""How many clients a round samples: one rule for the server and for DP's plan.

The server samples this many clients a round (:meth:`fedexlora.server.Server.sample`),
and DP-SGD plans each client's budget for its expected share of the rounds
(:func:`fedexlora.training.privacy.planned_rounds`); both ask :func:`sample_size`, so
that the plan is made for the rounds the server will actually sample.
"""

from __future__ import annotations

import math

__all__ = ["sample_size"]


def sample_size(num_clients: int, fraction: float) -> int:
    """Clients per round: ``fraction * num_clients`` rounded half up, at least one.

    Half up, not Python's ``round`` (half to even): 5 clients at fraction 0.5 sample 3.

    Args:
        num_clients: Clients in the federation.
        fraction: Fraction of them sampled per round.

    Returns:
        The number of clients sampled per round (at most ``num_clients`` for a
        ``fraction`` of at most 1).
    """
    return max(1, math.floor(fraction * num_clients + 0.5))
