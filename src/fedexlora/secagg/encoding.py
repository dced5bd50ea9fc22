"""Floats to the integers SecAgg+ sums, and back: Flower's quantizer, limb by limb.

SecAgg+ sums integers modulo ``2**32`` (Flower's ``modulus_range`` must be below
``2**32``), so one quantized number has at most about 30 bits once ``k`` clients' values
must sum without wrapping. Flower's quantizer maps ``[-C, C]`` onto those integers with
stochastic rounding: at 30 bits a step of ``2 C / 2**30``. That is too coarse for
FedEx-LoRA, whose product ``B_i A_i`` is 1e-4 to 1e-8 of the factors' size, and whose
residual is the small difference of two such sums.

So each number goes as ``L`` limbs: limb 0 is Flower's quantization of the value over
``[-C, C]``; limb ``l`` is Flower's quantization, over ``[-step_{l-1}, step_{l-1}]``, of
what the limbs before it left (always within one step, since stochastic rounding moves
a value by less than one step). Every limb is summed on its own, and the server adds the
dequantized limb sums. With ``L`` limbs over ``T = 2**b`` values the error per client and
number is below ``2**L C / T**L`` (8.9e-16 for ``C = 256``, ``b = 30``, ``L = 2``): exact
within float rounding, and still unbiased. A value beyond ``[-C, C]`` (or not finite) is
clipped (a non-finite one to 0), counted, and the count is summed securely with the rest
and reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Quantization"]

MOD_RANGE = 2**32  # Flower's SecAgg+ modulus must be below 2**32 (+1 for the <)
_MAX_TARGET = 2**30  # Flower's stochastic rounding casts to int32


@dataclass(frozen=True)
class Quantization:
    """How a client's float vector becomes integers in ``[0, target_range]``.

    Attributes:
        clip: ``C``: values are clipped to ``[-C, C]`` (a power of two).
        target_range: ``T``: each limb is an integer in ``[0, T]`` (a power of two).
        limbs: ``L``: limbs per number.
        clients: The most clients whose limbs may be summed without wrapping.
    """

    clip: float
    target_range: int
    limbs: int
    clients: int

    @classmethod
    def for_clients(cls, clients: int, *, clip: float = 256.0, bits: int = 52) -> Quantization:
        """The quantization for ``clients`` summed vectors, with ``bits`` bits in all.

        ``T`` is the largest power of two with ``clients * T < 2**32`` (at most ``2**30``),
        and ``L = ceil(bits / log2 T)``.

        Raises:
            ValueError: If ``clients`` is below 1 or too large for any ``T >= 2**8``, or
                ``clip`` is not a positive power of two.
        """
        if clients < 1:
            raise ValueError(f"secure aggregation needs at least one client, got {clients}")
        if not (clip > 0 and math.log2(clip).is_integer()):
            raise ValueError(f"the clipping range must be a power of two, got {clip}")
        t = min(_MAX_TARGET, 2 ** int(math.floor(math.log2((MOD_RANGE - 1) / clients))))
        if clients * t >= MOD_RANGE:
            t //= 2
        if t < 2**8:
            raise ValueError(f"{clients} clients are too many to sum within 2**32")
        limbs = max(1, math.ceil(bits / math.log2(t)))
        return cls(float(clip), int(t), int(limbs), int(clients))

    @property
    def steps(self) -> list[float]:
        """Each limb's clipping range: ``C``, then the step of the limb before."""
        out = [self.clip]
        for _ in range(self.limbs - 1):
            out.append(2 * out[-1] / self.target_range)
        return out

    @property
    def resolution(self) -> float:
        """The largest error per client and number (the last limb's step)."""
        return 2 * self.steps[-1] / self.target_range

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """``(ints, clipped)``: the limbs of ``x`` (fp64, flat) as one int64 vector.

        The vector is ``[limb 0 of x, limb 1 of x, ...]``, each limb as long as ``x``.
        Each limb is Flower's quantization (``quantize``: ``[-c, c]`` onto ``[0, T]``) with
        its stochastic rounding drawn from ``rng``, not numpy's global generator.
        """
        from flwr.common.secure_aggregation.quantization import dequantize

        x = np.asarray(x, dtype=np.float64).reshape(-1)
        finite = np.isfinite(x)
        clipped = int(np.count_nonzero(~finite | (np.abs(np.where(finite, x, 0.0)) > self.clip)))
        rest = np.clip(np.where(finite, x, 0.0), -self.clip, self.clip)  # NaN, inf: counted
        out = []
        for c in self.steps:
            q = _quantize(rest, c, self.target_range, rng)
            out.append(q)
            (back,) = dequantize([q], c, self.target_range)
            rest = rest - back  # within one step (exact, or within 2**-53 of a step)
        return np.concatenate(out), clipped

    def decode(self, summed: np.ndarray, count: int) -> np.ndarray:
        """The sum of ``count`` clients' ``x`` from the sum of their :meth:`encode` ints."""
        from flwr.common.secure_aggregation.quantization import dequantize

        summed = np.asarray(summed, dtype=np.int64)
        n = summed.size // self.limbs
        total = np.zeros(n, dtype=np.float64)
        for i, c in enumerate(self.steps):
            (part,) = dequantize([summed[i * n : (i + 1) * n]], c, self.target_range)
            total += part - (count - 1) * c  # Flower's offset for a sum of `count`
        return total


def _quantize(x: np.ndarray, clip: float, target: int, rng: np.random.Generator) -> np.ndarray:
    """Flower's ``quantize`` of one array, its stochastic rounding drawn from ``rng``.

    ``(clip(x, -c, c) + c) T / (2 c)``, rounded up, then down by one with the probability
    of the distance to the floor's complement: unbiased, as Flower's ``_stochastic_round``.
    """
    pre = (np.clip(x, -clip, clip) + clip) * (target / (2 * clip))
    q = np.ceil(pre).astype(np.int64)
    q[rng.random(q.shape) < q - pre] -= 1
    return q
