"""The server's own seconds in a round: the decorator its timed calls wear.

:func:`timed` adds a call's seconds to the :class:`~fedexlora.server.Server`'s work in
the current round (``_busy``); the call that advances the round closes it into
``last_round_seconds``. It wraps the payloads (:mod:`fedexlora.server.payloads`) and both
aggregations (:mod:`fedexlora.server.aggregation`).
"""

from __future__ import annotations

import functools
import time

__all__ = ["timed"]


def timed(fn):
    """Adds the method's seconds to the server's work in the current round (``self._busy``).

    A call that advances the round (an aggregation, clear or secure) closes it: the
    seconds summed since the previous round closed become ``last_round_seconds``
    (payloads, validation, a secure round's unmasking, aggregation: the server's own
    work in the round).
    """

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        before = self.round
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._busy += time.perf_counter() - t0
            if self.round != before:
                self.last_round_seconds, self._busy = self._busy, 0.0

    return wrapper
