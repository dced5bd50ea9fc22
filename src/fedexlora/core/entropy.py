"""Randomness for DP that no one but the client can replay: OS entropy through ChaCha20.

DP-SGD's guarantee holds only if its Poisson sampling and Gaussian noise are unknown to
whoever sees the upload. A generator seeded from the run's seed is not: the server sends
that seed, so it could replay a client's training and tell, with certainty, whether a
record was in it (issue 55). Here each draw stream is ChaCha20's keystream under a fresh
256-bit key from the operating system (``os.urandom``), created on the client and never
stored or sent: a cryptographically secure generator, as Linux's own ``getrandom`` is.

- :meth:`SecureRandom.random` gives uniforms in ``[0, 1)`` with 53 random bits each (a
  stand-in for ``numpy.random.Generator.random``, which SecAgg+'s stochastic rounding
  calls).
- :meth:`SecureRandom.normal` gives Gaussian noise by Box-Muller in float64, each value
  the sum of four draws halved, as Opacus's ``secure_mode`` does against the
  floating-point attacks on Gaussian samplers (Holohan & Braghin, arXiv 2107.10138).
- :func:`fedexlora.training.entropy.secure_dp_optimizer` is Opacus's ``DPOptimizer``
  with its noise drawn so.

Reproducible DP (``dp_reproducible``) keeps the seeded torch generators instead: for
simulations only, and not private against anyone who knows the seed.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

__all__ = ["SecureRandom"]

_CHUNK = 1 << 24  # bytes of keystream per call at most (16 MiB)


class SecureRandom:
    """A draw stream keyed by 32 bytes of OS entropy (ChaCha20's keystream).

    No seed exists outside this object; two instances never share a stream.
    """

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        key, nonce = os.urandom(32), os.urandom(16)
        self._stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()

    def _words(self, count: int) -> np.ndarray:
        """``count`` uniformly random 64-bit words."""
        parts, left = [], 8 * int(count)
        while left > 0:
            take = min(left, _CHUNK)
            parts.append(self._stream.update(bytes(take)))
            left -= take
        return np.frombuffer(b"".join(parts), dtype=np.uint64)

    def random(self, size=None) -> np.ndarray:
        """Uniforms in ``[0, 1)`` of shape ``size`` (53 random bits each), as numpy's."""
        shape = () if size is None else tuple(np.atleast_1d(size).tolist())
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        u = (self._words(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return u.reshape(shape)

    def normal(self, shape, std: float) -> torch.Tensor:
        """Gaussian noise of standard deviation ``std`` (float64, on the CPU).

        Each value is ``(z1 + z2 + z3 + z4) / 2`` of four standard normals (Opacus's
        ``secure_mode``), each from two 53-bit uniforms by Box-Muller.
        """
        shape = tuple(int(s) for s in shape)
        count = math.prod(shape)
        half = 2 * count  # 4 normals a value; Box-Muller gives two per pair of uniforms
        u = self.random(2 * half).reshape(2, half)
        radius = np.sqrt(-2.0 * np.log1p(-u[0]))  # 1 - u in (0, 1]: no log(0)
        angle = 2.0 * math.pi * u[1]
        z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)]).reshape(4, count)
        out = z.sum(axis=0) * (0.5 * float(std))
        return torch.from_numpy(out).reshape(shape)
