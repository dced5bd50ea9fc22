"""One unit for bytes everywhere the package prints them: SI (1 kB = 10^3 B, 1 MB = 10^6 B)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """SI-unit bytes with three significant digits: ``892 kB``, ``7.38 MB``.

    Every report of the package (run summaries, compare reports, ``bench comm``) and the
    docs use this one unit: ``MB`` is 10^6 bytes, never 2^20.
    """
    sign = "-" if n < 0 else ""
    n = abs(n)
    units = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
    for i, (unit, scale) in enumerate(units):
        if n >= scale:
            v = n / scale
            if v >= 999.5 and i > 0:  # rounds up to the next unit: 1.00 MB, not 1000 kB
                unit, v = units[i - 1][0], n / units[i - 1][1]
            return f"{sign}{v:.3g} {unit}" if v < 100 else f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"
