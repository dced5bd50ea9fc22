"""Where a round's seconds go: timers around the calls that do the work, on both engines.

A :class:`RoundClock` collects one round's seconds by part (:data:`PARTS`). The code that
does the work wraps it in :func:`phase`: the clients' training steps
(:func:`fedexlora.run.client_step.local_update`, or whatever trains through
:attr:`fedexlora.run.client.Client.update`), their set-up and reset (the payload applied,
a heterogeneous-rank view folded and restored, the upload read back, state kept), the
global model brought to the outcome, its evaluation, the clients' adapters and the
checkpoint written. Phases nest, and each second counts once: a phase's time excludes
that of the phases inside it (``setup`` around a client's whole turn, ``train`` around
its steps inside it: the steps go to ``train``, the rest to ``setup``).

A phase outside a running clock costs nothing and records nothing. The clock is a
context variable, so that a Flower ClientApp running in the server's own thread (the
tests' in-process grid) records into its own clock (:func:`running`), whose figures
travel back in its reply, and never into the server's.

The round's row gets :meth:`RoundClock.split` under ``split_seconds``: every part, the
longest client's training (``train_max``), the seconds of the round's wall time in which
at least one client was training (``train_wall``: the union of the clients' training
intervals on the machine's clock; the sum when they train one after another, less when
they train in parallel, as Flower's virtual clients do), the server's own seconds
(``aggregate``: payloads, validation, aggregation,
:attr:`fedexlora.server.Server.last_round_seconds`) and the round's wall time
(``total``, from its first payload to its checkpoint written).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["PARTS", "RoundClock", "current", "phase", "running"]

PARTS = ("train", "setup", "evaluate", "apply", "checkpoint")
"""The parts a clock collects (``aggregate`` is the server's own timer's)."""

_CLOCK: ContextVar[RoundClock | None] = ContextVar("fedexlora_round_clock", default=None)


class RoundClock:
    """One round's seconds by part (see the module docstring).

    Attributes:
        seconds: Part -> seconds spent in it (exclusive of nested phases).
        train_by_client: Client -> seconds of its training steps.
        train_spans: (start, end) wall-clock times (``time.time``) of each training
            phase, this process's and those clients reported (:meth:`add_span`).
        clients_measured: False where the clients' seconds could not be measured here
            (Flower clients under DP-SGD or secure aggregation send none): the split
            then gives ``None`` for ``train``, ``train_max`` and ``setup``, never 0.
    """

    def __init__(self) -> None:
        self.clients_measured = True
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.train_by_client: dict[int, float] = {}
        self.train_spans: list[tuple[float, float]] = []
        self._stack: list[list] = []  # [part, client, start, seconds of inner phases]

    def add(self, part: str, seconds: float, client: int | None = None) -> None:
        """Adds ``seconds`` measured elsewhere (a Flower client's reply) to ``part``.

        Raises:
            ValueError: If ``part`` is not one of :data:`PARTS` or ``seconds`` is negative.
        """
        if part not in self.seconds:
            raise ValueError(f"unknown part {part!r} of a round's time; known: {list(PARTS)}")
        if not seconds >= 0:
            raise ValueError(f"seconds of {part!r} must be >= 0, got {seconds!r}")
        self.seconds[part] += seconds
        if part == "train" and client is not None:
            self.train_by_client[client] = self.train_by_client.get(client, 0.0) + seconds

    def add_span(self, start: float, end: float) -> None:
        """A training interval measured elsewhere (a Flower client's reply), wall clock.

        Raises:
            ValueError: If ``end`` is before ``start`` or either is not a finite number.
        """
        if not (math.isfinite(start) and math.isfinite(end) and end >= start):
            raise ValueError(f"a training span must run forward in time, got {start!r}..{end!r}")
        self.train_spans.append((float(start), float(end)))

    def train_span(self) -> tuple[float, float] | None:
        """The first start and the last end of this clock's training (``None``: none)."""
        if not self.train_spans:
            return None
        return min(s for s, _ in self.train_spans), max(e for _, e in self.train_spans)

    @contextlib.contextmanager
    def measure(self, part: str, client: int | None = None) -> Iterator[None]:
        """Times the block into ``part``, less the phases nested in it."""
        if part not in self.seconds:
            raise ValueError(f"unknown part {part!r} of a round's time; known: {list(PARTS)}")
        frame = [part, client, time.perf_counter(), 0.0]
        wall = time.time()
        self._stack.append(frame)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - frame[2]
            self._stack.pop()
            own = max(elapsed - frame[3], 0.0)
            self.add(part, own, client)
            if part == "train":  # its own seconds (a nested phase is no training), from its start
                self.train_spans.append((wall, wall + own))
            if self._stack:
                self._stack[-1][3] += elapsed

    def split(self, *, aggregate: float, total: float) -> dict[str, float | None]:
        """The row's ``split_seconds``: every part, ``train_max``, ``aggregate``, ``total``."""
        out: dict[str, float | None] = {
            "total": float(total),
            "train": self.seconds["train"],
            "train_max": max(self.train_by_client.values(), default=0.0),
            "train_wall": _union(self.train_spans),
            "setup": self.seconds["setup"],
            "evaluate": self.seconds["evaluate"],
            "aggregate": float(aggregate),
            "apply": self.seconds["apply"],
            "checkpoint": self.seconds["checkpoint"],
        }
        if not self.clients_measured:
            out.update(train=None, train_max=None, train_wall=None, setup=None)
        return out


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals ``spans``."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def current() -> RoundClock | None:
    """The running clock of this context, if any."""
    return _CLOCK.get()


@contextlib.contextmanager
def running(clock: RoundClock | None) -> Iterator[RoundClock | None]:
    """Makes ``clock`` the one :func:`phase` records into, in this context, for the block.

    ``None`` stops recording for the block (a phase then records nothing).
    """
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


@contextlib.contextmanager
def phase(part: str, client: int | None = None) -> Iterator[None]:
    """Times the block into ``part`` of the running clock; nothing without one."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    with clock.measure(part, client):
        yield
