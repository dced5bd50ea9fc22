"""The building blocks of every aggregation rule: residuals, weights, stacked factors.

Everything here is a pure function on tensors: inputs are never mutated, results are new
tensors computed in at least fp32. There is no I/O, no peft and no configuration here.

Shapes follow peft: ``A`` is ``(r, n)`` (``lora_A.weight``), ``B`` is ``(d, r)``
(``lora_B.weight``) and the update ``B @ A`` is ``(d, n)``, before the LoRA scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "cut_rank",
    "used_rank",
    "AggregationResult",
    "Residual",
    "centred_residual",
    "deviation",
    "factor_product",
    "normalize_weights",
    "pad_rank",
    "residuals_from_flat",
    "residuals_to_flat",
    "split_leading",
    "svd_of_product",
]


@dataclass(frozen=True)
class Residual:
    """A ``(d, n)`` correction, stored factored as ``U @ V`` or dense, whichever is smaller.

    Attributes:
        shape: The ``(d, n)`` shape of the full matrix.
        U: ``(d, q)`` left factor, or ``None`` when stored dense.
        V: ``(q, n)`` right factor, or ``None`` when stored dense.
        dense: ``(d, n)`` matrix, or ``None`` when stored factored.
    """

    shape: tuple[int, int]
    U: torch.Tensor | None = None
    V: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    stored_rank: int | None = None  # known rank; for a directly formed dense one, its bound
    ordered: bool = False  # factored as ``X S @ Y^T`` by an SVD, strongest direction first

    @property
    def is_factored(self) -> bool:
        """Whether the residual is stored as two factors."""
        return self.dense is None

    @property
    def rank(self) -> int:
        """The rank: ``q`` when factored; when dense, the numerical rank or its bound.

        A dense residual formed directly (no reduction) reports ``min(q, d, n)``.
        """
        if self.stored_rank is not None:
            return self.stored_rank
        if self.dense is not None:
            return int(torch.linalg.matrix_rank(self.dense.double()).item())
        assert self.U is not None
        return int(self.U.shape[1])

    @property
    def is_zero(self) -> bool:
        """Whether the residual is exactly zero (rank 0, nothing to fold)."""
        return self.dense is None and self.rank == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors that represent the residual."""
        tensors = [self.dense] if self.dense is not None else [self.U, self.V]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_dense(self) -> torch.Tensor:
        """Returns the full ``(d, n)`` matrix."""
        if self.dense is not None:
            return self.dense.clone()
        assert self.U is not None and self.V is not None
        return self.U @ self.V

    def to(self, dtype: torch.dtype) -> Residual:
        """The same residual with its tensors cast to ``dtype``."""
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return Residual(
            self.shape,
            U=cast(self.U),
            V=cast(self.V),
            dense=cast(self.dense),
            stored_rank=self.stored_rank,
            ordered=self.ordered,
        )

    def scaled(self, factor: float) -> Residual:
        """``factor * self`` (the left factor, or the dense matrix, is scaled)."""
        if self.dense is not None:
            return Residual(self.shape, dense=self.dense * factor, stored_rank=self.stored_rank)
        assert self.U is not None and self.V is not None
        return Residual(
            self.shape,
            U=self.U * factor,
            V=self.V,
            stored_rank=self.stored_rank,
            ordered=self.ordered,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by role: ``{"U", "V"}`` or ``{"dense"}``."""
        if self.dense is not None:
            return {"dense": self.dense}
        assert self.U is not None and self.V is not None
        return {"U": self.U, "V": self.V}

    @staticmethod
    def zero(d: int, n: int, dtype: torch.dtype = torch.float32, device=None) -> Residual:
        """A rank-0 residual of shape ``(d, n)``."""
        return Residual(
            (d, n),
            U=torch.zeros(d, 0, dtype=dtype, device=device),
            V=torch.zeros(0, n, dtype=dtype, device=device),
        )

    @staticmethod
    def exact(U: torch.Tensor, V: torch.Tensor, dense_dtype: torch.dtype | None = None) -> Residual:
        """``U @ V`` kept as given (no reduction, no rounding), or dense where smaller.

        The dense form is one matmul in ``dense_dtype`` (default: the factors' dtype).
        """
        d, q = U.shape
        n = V.shape[1]
        if q == 0:
            return Residual.zero(d, n, dtype=dense_dtype or U.dtype, device=U.device)
        if q * (d + n) >= d * n:
            dt = dense_dtype or U.dtype
            return Residual((d, n), dense=U.to(dt) @ V.to(dt), stored_rank=min(q, d, n))
        return Residual((d, n), U=U, V=V)

    @staticmethod
    def from_factors(
        U: torch.Tensor,
        V: torch.Tensor,
        *,
        rtol: float | None = None,
        dense_dtype: torch.dtype | None = None,
    ) -> Residual:
        """Builds a residual from ``U @ V``, reduced to its numerical rank.

        The reduction never forms the ``(d, n)`` product: it takes a QR of ``U`` and of
        ``V.T``, then an SVD of the small ``(q, q)`` core. It falls back to dense storage
        only where dense is smaller than the reduced factors.

        Args:
            U: ``(d, q)`` left factor.
            V: ``(q, n)`` right factor.
            rtol: Singular values below ``rtol * s_max`` are dropped. Defaults to
                ``max(d, n) * eps`` of the compute dtype.
            dense_dtype: The dtype of the one matmul that forms a dense residual when
                ``q (d + n) >= d n``; defaults to the factors' dtype.
        """
        if U.ndim != 2 or V.ndim != 2 or U.shape[1] != V.shape[0]:
            raise ValueError(
                f"residual factors must be (d, q) and (q, n), got {tuple(U.shape)} and "
                f"{tuple(V.shape)}"
            )
        d, q = U.shape
        n = V.shape[1]
        if q == 0 or not U.any() or not V.any():
            return Residual.zero(d, n, dtype=U.dtype, device=U.device)
        if q * (d + n) >= d * n:
            # Even unreduced factors would not beat dense: one matmul, no QR/SVD. The rank
            # is then only known as its bound min(q, d, n).
            return Residual.exact(U, V, dense_dtype=dense_dtype)
        Qu, Ru = torch.linalg.qr(U)  # (d, q'), (q', q)
        Qv, Rv = torch.linalg.qr(V.T)  # (n, q''), (q'', q)
        core = Ru @ Rv.T  # (q', q'')
        X, S, Yh = torch.linalg.svd(core, full_matrices=False)
        if rtol is None:
            rtol = max(d, n) * torch.finfo(S.dtype).eps
        keep = int((S > rtol * S[0]).sum().item()) if S.numel() and S[0] > 0 else 0
        U_red = (Qu @ X[:, :keep]) * S[:keep]  # (d, keep)
        V_red = Yh[:keep] @ Qv.T  # (keep, n)
        if keep * (d + n) >= d * n:
            return Residual((d, n), dense=U_red @ V_red, stored_rank=keep)
        return Residual((d, n), U=U_red.contiguous(), V=V_red.contiguous(), ordered=True)

    def truncate(self, rank: int) -> tuple[Residual, Residual]:
        """Splits into the best rank-``rank`` part (by SVD) and the remainder.

        Returns:
            ``(kept, remainder)`` with ``kept + remainder == self``.
        """
        if rank < 0:
            raise ValueError(f"`rank` must be >= 0, got {rank}")
        d, n = self.shape
        if self.dense is not None:
            X, S, Yh = torch.linalg.svd(self.dense, full_matrices=False)
            Uf, Vf = X * S, Yh
        else:
            assert self.U is not None and self.V is not None
            if not self.ordered:  # e.g. the exact factors of `centred_residual`: SVD first
                reduced = Residual.from_factors(self.U, self.V)
                if reduced.dense is None and not reduced.ordered:  # zero
                    return reduced, Residual.zero(d, n, dtype=self.U.dtype, device=self.U.device)
                return reduced.truncate(rank)
            Uf, Vf = self.U, self.V
        if rank >= Uf.shape[1]:
            return self, Residual.zero(d, n, dtype=Uf.dtype, device=Uf.device)
        kept = Residual((d, n), U=Uf[:, :rank].contiguous(), V=Vf[:rank].contiguous(), ordered=True)
        rest = Residual((d, n), U=Uf[:, rank:].contiguous(), V=Vf[rank:].contiguous(), ordered=True)
        return kept, rest

    @staticmethod
    def concat(parts: Sequence[Residual], *, reduce: bool = True) -> Residual:
        """The sum of several residuals of one shape.

        Args:
            parts: Residuals of one shape.
            reduce: Re-factor the concatenated factors to numerical rank (QR of both and an
                SVD of the core). Without it the factors are only concatenated (no
                rounding, cost linear in their size), and summed dense with one matmul
                where dense is smaller.
        """
        if not parts:
            raise ValueError("`parts` must hold at least one residual")
        shape = parts[0].shape
        for p in parts:
            if p.shape != shape:
                raise ValueError(f"cannot add residuals of shapes {shape} and {p.shape}")
        if any(p.dense is not None for p in parts):
            dense = next(p for p in parts if p.dense is not None)
            total = dense.dense.clone()
            for p in parts:
                if p is dense:
                    continue
                if p.dense is not None:
                    total.add_(p.dense.to(total))
                elif p.U is not None and p.U.shape[1]:
                    total.addmm_(p.U.to(total), p.V.to(total))
            bound = min(sum(p.rank for p in parts), *shape)
            return Residual(shape, dense=total, stored_rank=bound)
        U = torch.cat([p.U for p in parts], dim=1)  # type: ignore[misc]
        V = torch.cat([p.V for p in parts], dim=0)  # type: ignore[misc]
        return Residual.from_factors(U, V) if reduce else Residual.exact(U, V)


@dataclass(frozen=True)
class AggregationResult:
    """The new global adapter of one layer and the residual to fold into its base weight.

    The global update satisfies ``B @ A + residual.to_dense() == target`` where the target
    is ``sum_i p_i B_i A_i`` for the exact methods (``fedex``, ``ffa``, ``flora``, plus
    the previous global ``B @ A`` for ``flora``'s fresh adapter, which is zero).

    Attributes:
        A: ``(r, n)`` new global A.
        B: ``(d, r)`` new global B.
        residual: The correction to fold into the base weight (times the LoRA scale).
        weights: The normalised client weights used.
        method: The aggregation method.
    """

    A: torch.Tensor
    B: torch.Tensor
    residual: Residual
    weights: torch.Tensor
    method: str


def normalize_weights(weights: Sequence[float] | torch.Tensor | None, k: int) -> torch.Tensor:
    """Returns fp64 weights that sum to 1, uniform when ``weights`` is ``None``.

    Raises:
        ValueError: On a wrong count, negative, non-finite or all-zero weights.
    """
    if k == 0:
        raise ValueError("nothing to aggregate: got 0 clients")
    if weights is None:
        return torch.full((k,), 1.0 / k, dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() != k:
        raise ValueError(f"`weights` must have one entry per client ({k}), got {w.numel()}")
    if not torch.isfinite(w).all():
        raise ValueError(f"`weights` must be finite, got {w.tolist()}")
    if (w < 0).any():
        raise ValueError(f"`weights` must be non-negative, got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"`weights` must not sum to 0, got {w.tolist()}")
    return w / total


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _stack(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], dtype=None):
    """Validates and stacks factors: returns ``(k, r, n)`` and ``(k, d, r)`` copies."""
    if len(As) == 0 or len(Bs) == 0:
        raise ValueError("nothing to aggregate: `As` and `Bs` must be non-empty")
    if len(As) != len(Bs):
        raise ValueError(f"got {len(As)} A factors but {len(Bs)} B factors")
    A0, B0 = As[0], Bs[0]
    if A0.ndim != 2 or B0.ndim != 2:
        raise ValueError(f"factors must be 2-D, got A {tuple(A0.shape)} and B {tuple(B0.shape)}")
    if B0.shape[1] != A0.shape[0]:
        raise ValueError(
            f"rank mismatch: B is {tuple(B0.shape)} but A is {tuple(A0.shape)} (client 0)"
        )
    for i, (A, B) in enumerate(zip(As, Bs)):
        if tuple(A.shape) != tuple(A0.shape):
            raise ValueError(
                f"client {i}: A has shape {tuple(A.shape)}, expected {tuple(A0.shape)}"
            )
        if tuple(B.shape) != tuple(B0.shape):
            raise ValueError(
                f"client {i}: B has shape {tuple(B.shape)}, expected {tuple(B0.shape)}"
            )
    dtype = dtype or _compute_dtype(A0)
    A = torch.empty((len(As), *A0.shape), dtype=dtype, device=A0.device)  # (k, r, n)
    B = torch.empty((len(Bs), *B0.shape), dtype=dtype, device=B0.device)  # (k, d, r)
    for i, (a, b) in enumerate(zip(As, Bs)):  # one pass each: copy_ casts
        A[i].copy_(a.detach())
        B[i].copy_(b.detach())
    return A, B


def factor_product(
    As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ideal update ``sum_i p_i B_i A_i`` as stacked factors ``(P, Q)``, ``P @ Q``.

    Returns:
        ``P`` of shape ``(d, k r)`` and ``Q`` of shape ``(k r, n)``.
    """
    A, B = _stack(As, Bs)
    p = normalize_weights(weights, A.shape[0]).to(device=A.device, dtype=A.dtype)
    k, r, n = A.shape
    P = (B * p[:, None, None]).permute(1, 0, 2).reshape(B.shape[1], k * r)  # (d, k r)
    Q = A.reshape(k * r, n)  # (k r, n)
    return P, Q


def _gram_fro2(U: torch.Tensor, V: torch.Tensor) -> float:
    """``||U @ V||_F^2`` from the small Gram matrices, without the ``(d, n)`` product."""
    U64, V64 = U.double(), V.double()
    return float(torch.sum((U64.T @ U64) * (V64 @ V64.T)).clamp_min(0).item())


def deviation(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], weights=None) -> float:
    """Relative Frobenius deviation of the averaged-factor product from the ideal update.

    ``||B̄ Ā - sum_i p_i B_i A_i||_F / ||sum_i p_i B_i A_i||_F``: what plain averaging of
    the factors (FedIT) loses, and what FedEx-LoRA's residual corrects. Never forms a
    ``(d, n)`` product. The difference is ``U V`` with the centred factors
    ``U = [sqrt(p_i)(B_i - B̄)]`` and ``V = [sqrt(p_i)(A_i - Ā)]`` (centred in fp64, so
    the factors' common part cancels exactly), whose Gram matrices (``(k r, k r)``, the
    only ``O((d + n) (k r)^2)`` work, in the factors' precision) give its norm; the ideal
    is ``B̄ Ā + U V``, whose norm needs only ``r``-wide products on top. About 1e-6
    relative for fp32 factors, 1e-12 for fp64. Returns 0 when the ideal update is zero.
    """
    A, B = _stack(As, Bs, dtype=torch.float64)
    p = normalize_weights(weights, A.shape[0]).to(device=A.device, dtype=A.dtype)
    U, V = _centred_factors(A, B, p)  # (d, k r), (k r, n), centred in fp64
    A_bar = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    # The Gram products in the inputs' precision (fp32 for fp32 factors: half the time of
    # fp64 GEMMs, and 1e-6 relative is ample for a reported deviation); the centring that
    # would cancel the factors' common part is done above, in fp64.
    work = _compute_dtype(As[0])
    Uw, Vw = U.to(work), V.to(work)
    GU, GV = (Uw.T @ Uw).double(), (Vw @ Vw.T).double()  # (k r, k r)
    num = float(torch.sum(GU * GV).clamp_min(0))  # ||U V||^2
    avg = float(torch.sum((B_bar.T @ B_bar) * (A_bar @ A_bar.T)))  # ||B̄ Ā||^2
    cross = float(torch.sum((B_bar.T @ U) * (A_bar @ V.T)))  # <B̄ Ā, U V>
    den = max(avg + 2 * cross + num, 0.0)
    return math.sqrt(num / den) if den > 0 else 0.0


def _centred_factors(A: torch.Tensor, B: torch.Tensor, p: torch.Tensor):
    """``U = [sqrt(p_i)(B_i - B̄)]`` (d, k r) and ``V = [sqrt(p_i)(A_i - Ā)]`` (k r, n)."""
    k, r, n = A.shape
    d = B.shape[1]
    A_bar = torch.einsum("k,krn->rn", p, A)  # (r, n)
    B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    sq = p.sqrt()
    # each written once, in the layout of the result: U (d, k, r) is (d, k r) as is
    U = torch.sub(B.permute(1, 0, 2), B_bar[:, None, :]).mul_(sq[None, :, None])
    V = torch.sub(A, A_bar).mul_(sq[:, None, None])
    return U.reshape(d, k * r), V.reshape(k * r, n)


def centred_residual(
    A: torch.Tensor,
    B: torch.Tensor,
    p: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    B_bar: torch.Tensor | None = None,
) -> Residual:
    """``Σ p_i B_i A_i − B̄ Ā``, factored exactly at rank <= (k-1) r without QR or SVD.

    With ``Σ p_i = 1`` the residual is ``Σ_i p_i (B_i − B̄)(A_i − A_j)`` for any client
    ``j``, whose own term vanishes: ``Σ_i p_i (B_i − B̄) A_j = 0``. So with ``j`` the
    heaviest client, ``U = [p_i (B_i − B̄)]`` and ``V = [A_i − A_j]`` over the other
    clients of nonzero weight are exact factors of rank ``(k' − 1) r``: two subtractions
    of the stacked factors, no ``(d, n)`` product and no factorization. Blocks that are
    exactly zero (duplicate clients, an unchanged B) are dropped, so identical clients
    give the zero residual. Where ``q (d + n) >= d n`` the residual is stored dense (one
    matmul in ``out_dtype``), the smaller of the two.

    Args:
        A: ``(k, r, n)`` stacked client A factors (fp64 for the exact residual).
        B: ``(k, d, r)`` stacked client B factors.
        p: ``(k,)`` weights that sum to one, on the factors' device.
        out_dtype: The dtype of the returned residual; defaults to ``A``'s.
        B_bar: ``Σ p_i B_i`` when the caller has it already (it is computed otherwise).

    Returns:
        The residual, factored (not SVD-ordered: :meth:`Residual.truncate` orders it when
        asked) or dense, on the factors' device.
    """
    k, r, n = A.shape
    d = B.shape[1]
    out = out_dtype or A.dtype
    p = p.to(device=A.device, dtype=A.dtype)
    j = int(torch.argmax(p).item()) if A.device.type != "meta" else 0
    if B_bar is None:
        B_bar = torch.einsum("k,kdr->dr", p, B)  # (d, r)
    others = torch.tensor([i for i in range(k) if i != j], dtype=torch.long, device=A.device)
    # computed in place, in the layout of the result: U (d, k-1, r) is (d, (k-1) r) as is
    U = B.permute(1, 0, 2)[:, others]  # (d, k-1, r), a copy
    U.sub_(B_bar[:, None, :]).mul_(p[others][None, :, None])
    V = A[others]  # (k-1, r, n), a copy
    V.sub_(A[j])
    if A.device.type != "meta":  # values exist: drop the blocks that contribute nothing
        live = U.any(2).any(0) & V.flatten(1).any(1)
        if not bool(live.all()):
            U, V = U[:, live], V[live]
    m = V.shape[0]
    U = U.reshape(d, m * r).to(out)  # (d, m r)
    V = V.reshape(m * r, n).to(out)  # (m r, n)
    return Residual.exact(U, V, dense_dtype=out)


def svd_of_product(A: torch.Tensor, B: torch.Tensor):
    """The thin SVD of ``B @ A`` in fp64, without forming the ``(d, n)`` product.

    QR of both factors, then an SVD of the ``(r, r)`` core: ``O((d + n) r^2)``.

    Returns:
        ``(U, S, V)`` with ``U`` ``(d, q)``, ``S`` ``(q,)`` descending, ``V`` ``(q, n)``
        (orthonormal columns of ``U`` and rows of ``V``), ``q = min(r, d, n)``, and
        ``U @ diag(S) @ V == B @ A``.
    """
    A64, B64 = A.detach().double(), B.detach().double()
    Qb, Rb = torch.linalg.qr(B64)  # (d, q), (q, r)
    Qa, Ra = torch.linalg.qr(A64.T)  # (n, q'), (q', r)
    X, S, Yh = torch.linalg.svd(Rb @ Ra.T, full_matrices=False)
    return Qb @ X, S, Yh @ Qa.T


def split_leading(
    A: torch.Tensor, B: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, Residual]:
    """Splits ``B @ A`` into its best rank-``rank`` part and the rest, without ``(d, n)``.

    ``B @ A = X S Y^T`` (QR of both factors, then an SVD of the ``(r, r)`` core). The
    leading part keeps the most energy.

    Returns:
        ``(A_lead, B_lead, tail)`` with ``A_lead`` ``(rank, n)``, ``B_lead`` ``(d, rank)``,
        both carrying ``sqrt(S)``, and ``B_lead @ A_lead + tail.to_dense() == B @ A``.
    """
    if rank < 1:
        raise ValueError(f"`rank` must be >= 1, got {rank}")
    out = _compute_dtype(A)
    U, S, V = svd_of_product(A, B)
    k = min(rank, S.numel())
    root = S[:k].sqrt()
    B_lead = torch.zeros(B.shape[0], rank, dtype=torch.float64, device=B.device)
    A_lead = torch.zeros(rank, A.shape[1], dtype=torch.float64, device=A.device)
    B_lead[:, :k] = U[:, :k] * root
    A_lead[:k] = root[:, None] * V[:k]
    d, n = B.shape[0], A.shape[1]
    tail = Residual((d, n), U=(U[:, k:] * S[k:]).to(out), V=V[k:].to(out).contiguous())
    return A_lead.to(out), B_lead.to(out), tail


def pad_rank(A: torch.Tensor, B: torch.Tensor, rank: int, factor: float = 1.0):
    """Zero-pads ``(A, B)`` to ``rank`` and multiplies both by ``sqrt(factor)``.

    ``pad_B @ pad_A == factor * B @ A``: used to express a client's rank-``r_i`` factors,
    trained at scale ``s_i``, in the global adapter's rank and scale
    (``factor = s_i / s_global``).
    """
    r = A.shape[0]
    if r > rank:
        raise ValueError(f"cannot pad rank {r} down to {rank}")
    root = math.sqrt(factor)
    pA = torch.zeros(rank, A.shape[1], dtype=A.dtype, device=A.device)
    pB = torch.zeros(B.shape[0], rank, dtype=B.dtype, device=B.device)
    pA[:r] = A * root
    pB[:, :r] = B * root
    return pA, pB


def residuals_to_flat(prefix: str, residuals: dict[str, Residual]) -> dict[str, torch.Tensor]:
    """``{f"{prefix}.{module}.U"|".V"|".dense": tensor}``: a flat map for transport or disk."""
    out = {}
    for name, r in residuals.items():
        for role, t in r.tensors().items():
            out[f"{prefix}.{name}.{role}"] = t
    return out


def residuals_from_flat(prefix: str, flat: dict[str, torch.Tensor]) -> dict[str, Residual]:
    """Inverse of :func:`residuals_to_flat`; shapes are read from the tensors."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith(prefix + "."):
            name, role = k[len(prefix) + 1 :].rsplit(".", 1)
            parts.setdefault(name, {})[role] = v
    out = {}
    for name, p in parts.items():
        if "dense" in p:
            out[name] = Residual(tuple(p["dense"].shape), dense=p["dense"])
        elif "U" in p and "V" in p:
            out[name] = Residual((p["U"].shape[0], p["V"].shape[1]), U=p["U"], V=p["V"])
        else:
            raise ValueError(f"residual {prefix}.{name} needs U and V, or dense; got {sorted(p)}")
    return out


def used_rank(state) -> int:
    """The rank an ``AdapterState``'s factors use (the last live A row or B column + 1).

    A HetLoRA client that pruned its rank uploads zeros beyond it.
    """
    used = 0
    for A, B in state.factors.values():
        for X, dim in ((A, 1), (B, 0)):
            if X is not None:
                live = (X != 0).any(dim=dim).nonzero().flatten()
                used = max(used, int(live.max()) + 1 if live.numel() else 0)
    return used


def cut_rank(state, rank: int):
    """``state`` with every A row and B column from ``rank`` on set to zero."""
    factors = {}
    for name, (A, B) in state.factors.items():
        if A is not None:
            A = A.clone()
            A[rank:] = 0
        if B is not None:
            B = B.clone()
            B[:, rank:] = 0
        factors[name] = (A, B)
    return dataclasses.replace(state, factors=factors)
