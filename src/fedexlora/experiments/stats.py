"""Paired statistics for method comparisons: mean difference, 95% CI, paired t-test."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Paired", "paired"]


@dataclass(frozen=True)
class Paired:
    """A paired difference ``a − b`` over matched runs (same seed, partition and start).

    Attributes:
        n: Number of pairs.
        mean: Mean difference.
        lo: Lower end of the two-sided 95% confidence interval (t distribution, n−1 df);
            NaN when ``n < 2``.
        hi: Upper end of the interval.
        p: Two-sided p-value of the paired t-test of mean 0; NaN when ``n < 2``.
        ahead: Pairs where ``a`` is better (higher, or lower for a loss).
        tied: Pairs with no difference.
    """

    n: int
    mean: float
    lo: float
    hi: float
    p: float
    ahead: int
    tied: int

    @property
    def behind(self) -> int:
        """Pairs where ``a`` is worse."""
        return self.n - self.ahead - self.tied

    def text(self, scale: float = 1.0, unit: str = "") -> str:
        """``+0.018 [95% CI +0.003, +0.033], paired t-test p=0.03, n=3``.

        ``scale`` multiplies the figures, e.g. 100 for points of accuracy.
        """
        m = f"{self.mean * scale:+.3g}{unit}"
        if self.n < 2:
            return f"{m} (n=1: no interval or test)"
        return (
            f"{m} [95% CI {self.lo * scale:+.3g}, {self.hi * scale:+.3g}]{unit}, "
            f"paired t-test p{_p(self.p)}, n={self.n}"
        )


def _p(p: float) -> str:
    if math.isnan(p):
        return " n/a"
    return f"={p:.2g}" if p >= 1e-4 else "<1e-4"


def paired(a: list[float], b: list[float], higher_is_better: bool = True) -> Paired:
    """Paired difference ``a − b`` with a t-based 95% CI and a two-sided paired t-test.

    The pairs are matched runs, so the test is on the per-pair differences. With only a
    handful of pairs (3 to 10 seeds) the t-test is the usual choice; it assumes the
    differences are roughly normal. When every difference is equal, the interval is that
    value and the p-value is 1 if it is zero, else 0.

    Raises:
        ValueError: If the lists differ in length or are empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = statistics.fmean(d)
    sign = 1 if higher_is_better else -1
    ahead = sum(sign * x > 0 for x in d)
    tied = sum(x == 0 for x in d)
    if n < 2:
        return Paired(n, mean, math.nan, math.nan, math.nan, ahead, tied)
    sd = statistics.stdev(d)
    if sd == 0:
        return Paired(n, mean, mean, mean, 1.0 if mean == 0 else 0.0, ahead, tied)
    from scipy import stats

    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.975, n - 1)) * se
    p = float(2 * stats.t.sf(abs(mean / se), n - 1))
    return Paired(n, mean, mean - half, mean + half, p, ahead, tied)
