"""FedEx's residual from sums of sketches: the one-pass two-sided sketch, and its rebuild.

Under secure aggregation the server sees only sums. For FedEx-LoRA it needs, per layer,
``Ā``, ``B̄`` and the residual ``R = M - B̄ Ā`` of ``M = Σ p_i B_i A_i``, whose rank is at
most ``(k - 1) r``. Instead of the dense ``w_i B_i A_i`` (``d n`` numbers), each client
adds two sketches of its product against public test matrices (Tropp, Yurtsever, Udell,
Cevher 2017, "Practical sketching algorithms for low-rank matrix approximation", the
one-pass two-sided sketch):

- ``Y_i = w_i L_i (R_i Ω)``, the range sketch, ``(m, s)``;
- ``W_i = (Ψ L_i) w_i R_i``, the co-range sketch, ``(s2, c)``;

where ``L_i R_i`` is the client's product in the orientation that puts the longer side
first (``B_i A_i``, or its transpose ``A_i^T B_i^T`` when ``n > d``: then the larger
``s2`` multiplies the shorter side). The sums are ``Y = X Ω`` and ``W = Ψ X`` of the
weighted mean ``X`` (``M`` or ``M^T``).

The server knows ``Ā`` and ``B̄`` from the same sum, so it subtracts their product's
sketches itself: ``Y - X̄ Ω`` and ``W - Ψ X̄`` sketch the residual alone, of rank at most
``(k - 1) r``. So ``s = (k - 1) r + over`` suffices, not ``k r + over``: the one-pass
sketch costs what a second round's sketch of the centred residual would, in one round.
The rebuild is ``R = Q (Ψ Q)^+ W_R`` with ``Q = orth(Y_R)``, exact whenever ``s`` is at
least the residual's rank, then cut by an SVD of the small ``(s, c)`` core to rank
``(k - 1) r``: two factors, the clear path's size.

The test matrices are drawn from a public seed and the layer's name by an integer hash
(no torch generator, whose stream may change between versions): a client and the server
on different machines and torch versions derive the same ``Ω`` and ``Ψ`` bit for bit.
Their entries are uniform on ``[-sqrt(3), sqrt(3))`` (unit variance).

The rebuild is bitwise reproducible (#55): for one input, the same output on every call
and whatever torch's thread count (:func:`_serial`). torch's default least-squares driver
on CPU (MKL's ``gelsy``, a QR with column pivoting) returned several different results for
one input in as many calls, even on one thread; ``Ψ Q`` has full column rank (``s2 > s``,
``Q`` orthonormal), so the plain QR solve ``gels`` is used, and the QR, the solve, the
SVD and the products run on one thread, whose result does not depend on how many
threads the caller set. (Another BLAS or LAPACK build may round differently: the same
run on the same installation repeats to the bit.)

Pure torch: nothing here knows of clients, messages or the protocol.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "EXTRA",
    "OVER",
    "Sketch",
    "SketchPlan",
    "SketchShape",
    "client_sketches",
    "residual_from_dense",
    "sketch_matrices",
]

OVER = 10
"""Oversampling of the range sketch: ``s = (k - 1) r + OVER``. Measured in
``benchmarks/secure_cost.py --study`` (docs/PRIVACY.md)."""

EXTRA = 10
"""The co-range sketch's excess over the range sketch: ``s2 = s + EXTRA``. With
``s2 = s`` the pseudo-inverse of ``Ψ Q`` is ill-conditioned and amplifies the
quantization's error (measured in ``benchmarks/secure_cost.py --study``)."""

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SketchShape:
    """How one ``(d, n)`` layer's product is sketched.

    Attributes:
        d: Rows of the product ``B A``.
        n: Columns of the product.
        s: Width of the range sketch ``Y``, ``(m, s)``.
        s2: Height of the co-range sketch ``W``, ``(s2, c)``.
        transposed: Whether the sketched matrix is ``(B A)^T`` (when ``n > d``).
    """

    d: int
    n: int
    s: int
    s2: int
    transposed: bool

    @property
    def m(self) -> int:
        """Rows of the sketched matrix (the longer side)."""
        return self.n if self.transposed else self.d

    @property
    def c(self) -> int:
        """Columns of the sketched matrix (the shorter side)."""
        return self.d if self.transposed else self.n

    @property
    def numbers(self) -> int:
        """Numbers of both sketches: ``m s + s2 c``."""
        return self.m * self.s + self.s2 * self.c


@dataclass(frozen=True)
class SketchPlan:
    """The public parameters of a round's sketches, the same at every client and the server.

    Attributes:
        clients: The clients sampled for the round, ``k``: the residual of any subset of
            them has rank at most ``(k - 1) r``.
        seed: The round's public seed of the test matrices.
        over: ``s = (k - 1) r + over``.
        extra: ``s2 = s + extra``.
    """

    clients: int
    seed: int
    over: int = OVER
    extra: int = EXTRA

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"a sketch plan needs at least one client, got {self.clients}")
        if self.over < 0 or self.extra < 0:
            raise ValueError(
                f"the sketch's oversampling must be >= 0, got over={self.over}, extra={self.extra}"
            )

    def shape(self, d: int, n: int, r: int) -> SketchShape | None:
        """The sketch of a ``(d, n)`` layer of rank ``r``, or ``None`` where dense is smaller.

        Raises:
            ValueError: If a dimension is not positive.
        """
        if d < 1 or n < 1 or r < 1:
            raise ValueError(f"a sketched layer needs d, n, r >= 1, got {d}, {n}, {r}")
        transposed = n > d
        m, c = (n, d) if transposed else (d, n)
        s = (self.clients - 1) * r + self.over
        s2 = s + self.extra
        if s >= c or s2 > m:  # a full-width sketch is no smaller than the matrix
            return None
        shape = SketchShape(d, n, s, s2, transposed)
        return shape if shape.numbers < d * n else None


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 lanes holding values below ``2**32``)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _key(seed: int, name: str, which: str) -> tuple[int, int]:
    digest = hashlib.sha256(f"fedexlora-sketch/{seed}/{name}/{which}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _uniform(seed: int, name: str, which: str, rows: int, cols: int) -> torch.Tensor:
    """``(rows, cols)`` fp64, uniform on ``[-sqrt(3), sqrt(3))``, from the hash alone."""
    k0, k1 = _key(seed, name, which)
    idx = torch.arange(rows * cols, dtype=torch.int64)
    if rows * cols >= 2**32:
        raise ValueError(f"a test matrix of {rows} x {cols} is too large to index")
    h = _mix32(idx ^ k0)
    h = _mix32(h ^ k1)
    h = _mix32(h ^ idx)  # a third round: consecutive entries decorrelated
    u = (h.double() + 0.5) / 2.0**32  # (0, 1)
    return ((2.0 * u - 1.0) * math.sqrt(3.0)).reshape(rows, cols)


def sketch_matrices(seed: int, name: str, shape: SketchShape) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Ω, Ψ)`` of layer ``name``: ``(c, s)`` and ``(s2, m)``, fp64, from ``seed`` alone."""
    omega = _uniform(seed, name, "omega", shape.c, shape.s)
    psi = _uniform(seed, name, "psi", shape.s2, shape.m)
    return omega, psi


@contextlib.contextmanager
def _serial() -> Iterator[None]:
    """Runs the block with torch on one thread, restoring the caller's count after.

    Linear algebra whose rounding is then the same whatever the caller's thread count
    (a multi-threaded QR or product splits its sums by thread).
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _oriented(A: torch.Tensor, B: torch.Tensor, shape: SketchShape):
    """``(L, R)`` with ``L R`` the sketched matrix: ``(B, A)``, or ``(A^T, B^T)``."""
    return (A.T, B.T) if shape.transposed else (B, A)


def client_sketches(
    A: torch.Tensor, B: torch.Tensor, shape: SketchShape, seed: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's ``(Y_i, W_i)`` of ``B A`` (fp64, unweighted): ``(m, s)`` and ``(s2, c)``.

    Computed from the factors, never the ``(d, n)`` product: ``L (R Ω)`` and ``(Ψ L) R``.
    """
    if tuple(A.shape) != (A.shape[0], shape.n) or tuple(B.shape) != (shape.d, A.shape[0]):
        raise ValueError(
            f"{name}: factors {tuple(A.shape)} and {tuple(B.shape)} do not fit a "
            f"({shape.d}, {shape.n}) sketch"
        )
    omega, psi = sketch_matrices(seed, name, shape)
    L, R = _oriented(A.detach().double().cpu(), B.detach().double().cpu(), shape)
    return L @ (R @ omega), (psi @ L) @ R


@dataclass(frozen=True)
class Sketch:
    """The mean sketches of one layer, as the server reads them from the sums.

    Attributes:
        name: The layer (its test matrices' key).
        shape: The sketch's shape.
        seed: The round's public seed.
        Y: ``(m, s)``: ``X Ω`` for the weighted mean ``X`` of the products.
        W: ``(s2, c)``: ``Ψ X``.
    """

    name: str
    shape: SketchShape
    seed: int
    Y: torch.Tensor
    W: torch.Tensor

    def residual(
        self, A_bar: torch.Tensor, B_bar: torch.Tensor, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, V)``, ``(d, q)`` and ``(q, n)`` fp64 with ``U V = X - B̄ Ā`` (oriented back).

        The sketches of ``B̄ Ā`` are subtracted first (the server knows both), so the
        rebuild sees the residual alone; ``q = min(rank, s)``.

        Raises:
            ValueError: If ``rank`` is negative or the means do not fit the shape.
        """
        if rank < 0:
            raise ValueError(f"`rank` must be >= 0, got {rank}")
        sh = self.shape
        if tuple(A_bar.shape)[1] != sh.n or tuple(B_bar.shape)[0] != sh.d:
            raise ValueError(
                f"{self.name}: means {tuple(A_bar.shape)} and {tuple(B_bar.shape)} do not fit "
                f"a ({sh.d}, {sh.n}) sketch"
            )
        omega, psi = sketch_matrices(self.seed, self.name, sh)
        L, R = _oriented(A_bar.double().cpu(), B_bar.double().cpu(), sh)
        with _serial():  # bitwise reproducible (see the module's docstring)
            Y = self.Y.double() - L @ (R @ omega)  # (m, s): the residual's range sketch
            W = self.W.double() - (psi @ L) @ R  # (s2, c): its co-range sketch
            Q, _ = torch.linalg.qr(Y)  # (m, s)
            # (s, c): (Ψ Q)^+ W; ΨQ has full column rank, and gels (a QR solve) repeats
            # to the bit where the default gelsy does not
            core = torch.linalg.lstsq(psi @ Q, W, driver="gels").solution
            X, S, Vh = torch.linalg.svd(core, full_matrices=False)  # core = X S Vh
            q = min(rank, S.numel())
            left = (Q @ X[:, :q]) * S[:q]  # (m, q)
            right = Vh[:q]  # (q, c)
        if sh.transposed:  # (left right)^T = right^T left^T
            return right.T.contiguous(), left.T.contiguous()
        return left.contiguous(), right.contiguous()


def residual_from_dense(
    M: torch.Tensor, A_bar: torch.Tensor, B_bar: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, V)`` of rank ``min(rank, d, n)`` (fp64) closest to ``M - B̄ Ā``, by an SVD.

    For the layers whose products travel dense (where the sketch is not smaller).
    """
    if rank < 0:
        raise ValueError(f"`rank` must be >= 0, got {rank}")
    with _serial():  # bitwise reproducible, as Sketch.residual
        dense = M.double() - B_bar.double() @ A_bar.double()
        X, S, Vh = torch.linalg.svd(dense, full_matrices=False)
    q = min(rank, S.numel())
    return (X[:, :q] * S[:q]).contiguous(), Vh[:q].contiguous()
