"""The fp32 side branch: where folded residuals live when the base cannot hold them.

A bf16/fp16 weight rounds away most of a small update (bf16 keeps 8 bits of mantissa: an
update 1e-3 the size of the weight loses about 80% of itself), and a 4-bit or 8-bit
weight cannot be changed at all without re-quantizing. So for such a layer the
accumulated ``scale * residual`` is kept beside it in fp32, factored ``U @ V`` or dense,
whichever is smaller, and added to the layer's output in the forward pass:
``y = base(x) + lora(x) + x @ (U V)^T``.

An fp32 (or fp64) weight holds its update itself: an :class:`Accumulator` keeps the sum of
what was folded, and the weight is rebuilt as ``W0 + sum``. (Or, where exactness below
fp32's rounding of ``W`` matters, an fp32 layer keeps a side branch as well:
:func:`fedexlora.bridge.fold.use_side_branch`.)

Pure torch: no peft. :mod:`fedexlora.bridge.fold` attaches one to each LoRA layer that
needs it.
"""

from __future__ import annotations

import math

import torch

from fedexlora.core.factors import Residual

__all__ = ["REFACTOR_GROWTH", "Accumulator", "SideBranch", "passes_rung", "rank_cap"]

REFACTOR_GROWTH = 1.25
"""The side branch's ladder: an uncapped branch re-factors its sum to numerical rank when
its column count passes a power of this (..., 1.25**30 = 808, 1010, 1262, ...)."""


def passes_rung(before: int, after: int, growth: float = REFACTOR_GROWTH) -> bool:
    """Whether going from ``before`` to ``after`` columns passes a power of ``growth``."""
    if after <= before:
        return False
    if before < 1:
        return True
    return math.floor(math.log(after) / math.log(growth)) > math.floor(
        math.log(before) / math.log(growth)
    )


def rank_cap(side_rank, name: str) -> int | None:
    """Layer ``name``'s side-branch rank cap (``None``: none).

    ``side_rank`` is one cap for every layer, or a per-layer mapping (``--side-budget``).
    """
    if side_rank is None or isinstance(side_rank, int):
        return side_rank
    return side_rank.get(name)


class SideBranch(torch.nn.Module):
    """An fp32 correction ``delta`` of shape ``(d, n)`` added to a layer's output.

    ``forward(x, out)`` returns ``out + x @ delta.T``, computed in fp32 with autocast
    off and rounded once to ``out``'s dtype: as peft treats the fp32 LoRA branch of a
    half-precision layer without autocast, and unlike peft under autocast, where its
    branch computes in the autocast dtype (the residual is exact; bf16 would round it).
    The tensors are non-persistent buffers: they follow the model
    across devices but never enter its ``state_dict``.

    Args:
        d: Output features.
        n: Input features.
        max_rank: Keep at most this rank (the best rank-``max_rank`` part, by SVD). The
            server's ``side_rank`` mode keeps the error feedback; here the cap only drops
            the float noise of cancelling updates. ``None`` keeps everything.
        dtype: Storage dtype (fp32; fp64 for an fp64 model, whose accumulator must not
            round to fp32).
    """

    def __init__(
        self,
        d: int,
        n: int,
        *,
        max_rank: int | None = None,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        self.shape = (d, n)
        self.max_rank = max_rank
        self.dtype = dtype
        self.register_buffer("U", torch.zeros(d, 0, device=device, dtype=dtype), persistent=False)
        self.register_buffer("V", torch.zeros(0, n, device=device, dtype=dtype), persistent=False)
        self.register_buffer("dense", None, persistent=False)

    @property
    def residual(self) -> Residual:
        """The correction held, as a :class:`~fedexlora.core.aggregation.Residual` (fp32)."""
        if self.dense is not None:
            return Residual(self.shape, dense=self.dense)
        return Residual(self.shape, U=self.U, V=self.V)

    @property
    def rank(self) -> int:
        """Columns of ``U`` (factored) or ``min(d, n)`` (dense)."""
        return min(self.shape) if self.dense is not None else int(self.U.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.residual.nbytes

    @torch.no_grad()
    def set(self, residual: Residual) -> None:
        """Replaces the correction with ``residual`` (stored in ``dtype`` on this device)."""
        if tuple(residual.shape) != self.shape:
            raise ValueError(f"side branch is {self.shape}, got a residual of {residual.shape}")
        dev, dt = self.U.device, self.dtype
        if residual.dense is not None:
            self.dense = residual.dense.to(dev, dt).contiguous()
            self.U = torch.zeros(self.shape[0], 0, device=dev, dtype=dt)
            self.V = torch.zeros(0, self.shape[1], device=dev, dtype=dt)
        else:
            self.dense = None
            self.U = residual.U.to(dev, dt).contiguous()
            self.V = residual.V.to(dev, dt).contiguous()

    @torch.no_grad()
    def add(self, residual: Residual) -> None:
        """Adds ``residual`` (already scaled), stored in fp32, dense only where smaller.

        Uncapped, the new factors are appended to the held ones (exact: no rounding but
        fp32's storage, and a copy linear in their size), and the sum is re-factored to
        numerical rank (fp64 QR of both factors and an SVD of the small core, never the
        ``(d, n)`` product) only when its column count passes the next rung of a
        geometric ladder (:data:`REFACTOR_GROWTH`), or would otherwise turn the branch
        dense. Clients in general position add ``(k - 1) r`` new directions a round,
        which no re-factoring removes, so a re-factor every round would cost
        ``O((d + n) q^2)`` a round for nothing; on the ladder its total cost stays a few
        times that of the last one. Between rungs the columns held exceed the rank found
        at the last re-factor by at most a quarter of it plus one round's (where rounds
        repeat or cancel directions, those columns are dropped at the next rung). A rung
        is a function of the column counts alone, so a client resumed from its saved
        tensors re-factors where its straight run does. With ``max_rank`` set the sum is
        re-factored every round and cut to it (the best part, by SVD). The first residual
        is kept as it came.
        """
        if residual.is_zero:
            return
        cur = self.residual
        small = residual.dense is None and residual.U.shape[1] <= (self.max_rank or 0)
        if cur.is_zero and (self.max_rank is None or small):
            self.set(residual)  # the first one: as it came
            return
        dev = self.U.device
        d, n = self.shape
        if cur.dense is not None and self.max_rank is None:
            # into a copy (the held tensor may be shared with a saved state): the sum is
            # formed in fp64 and rounded once to the stored dtype, the bits of a sum formed
            # apart, without two more dense fp64 copies
            total = self.dense.clone()
            total.add_(residual.to_dense().to(dev, torch.float64))
            self.dense = total
            return
        if residual.dense is not None or cur.dense is not None:
            total = Residual(
                self.shape,
                dense=cur.to_dense().to(dev, torch.float64)
                + residual.to_dense().to(dev, torch.float64),
            )
        else:
            Uc, Vc = cur.U.to(dev, torch.float64), cur.V.to(dev, torch.float64)
            q = Uc.shape[1] + residual.U.shape[1]
            rung = self.max_rank is not None or passes_rung(Uc.shape[1], q)
            if not rung and q * (d + n) >= d * n:
                # dense only if the sum's rank needs it: the held part to its numerical
                # rank first (factored, it is below dense), as a rung would have it
                held = Residual.from_factors(Uc, Vc)
                Uc, Vc = held.U, held.V
                rung = True
            U = torch.cat([Uc, residual.U.to(dev, torch.float64)], 1)
            V = torch.cat([Vc, residual.V.to(dev, torch.float64)], 0)
            if rung:
                total = Residual.from_factors(U, V)
            else:
                total = Residual.exact(U, V)  # appended, factored (below dense)
        if self.max_rank is not None and total.rank > self.max_rank:
            total, _ = total.truncate(self.max_rank)
        self.set(total)

    def to_dense(self) -> torch.Tensor:
        """The ``(d, n)`` correction in fp64."""
        if self.dense is not None:
            return self.dense.double()
        return self.U.double() @ self.V.double()

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + x @ delta.T`` in fp32 (fp64 when stored so), rounded once to ``out.dtype``."""
        if self.dense is None and self.U.shape[1] == 0:
            return out
        held = self.dense if self.dense is not None else self.U
        work = torch.float64 if held.dtype == torch.float64 else torch.float32  # model.double()
        with torch.autocast(device_type=x.device.type, enabled=False):
            x32 = x.to(work)
            if self.dense is not None:
                delta = x32 @ self.dense.T
            else:
                delta = (x32 @ self.V.T) @ self.U.T
            return (out.to(work) + delta).to(out.dtype)


class Accumulator(torch.nn.Module):
    """The record of what was folded into an fp32 (or fp64) weight, in place.

    Each residual goes into the weight with one ``addmm_`` (the least an exact fold can
    cost; :mod:`fedexlora.bridge.fold` does it), and is recorded here, factored and in
    the weight's dtype, while together the records are smaller than one dense
    ``(d, n)``. Replaying them in order on ``W0`` (``splits`` gives each one's rank)
    repeats the very operations, so the weight comes back bit for bit. Once they outgrow
    dense the record is dropped (``parts is None``) and the weight itself is the state.

    The tensors follow the module's device.
    """

    def __init__(self, d: int, n: int, *, device=None, dtype=torch.float32):
        super().__init__()
        self.shape = (d, n)
        self.dtype = dtype
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] | None = []
        self.register_buffer(
            "_anchor", torch.zeros(0, device=device, dtype=dtype), persistent=False
        )

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.parts:
            self.parts = [(fn(U), fn(V)) for U, V in self.parts]
        return out

    @property
    def outgrown(self) -> bool:
        """Whether the record was dropped: the weight itself is the state."""
        return self.parts is None

    @property
    def splits(self) -> list[int]:
        """The rank of each residual recorded, in the order they were folded."""
        return [int(U.shape[1]) for U, _ in self.parts or []]

    @property
    def residual(self) -> Residual:
        """The recorded residuals' sum, their factors concatenated (zero when none).

        Raises:
            ValueError: Once the record was dropped (:attr:`outgrown`).
        """
        if self.parts is None:
            raise ValueError("the record outgrew dense: the weight itself is the state")
        if not self.parts:
            d, n = self.shape
            return Residual.zero(d, n, dtype=self.dtype, device=self._anchor.device)
        U = torch.cat([U for U, _ in self.parts], 1)
        V = torch.cat([V for _, V in self.parts], 0)
        return Residual(self.shape, U=U, V=V)

    @property
    def rank(self) -> int:
        """Columns recorded, ``min(d, n)`` once outgrown, 0 when nothing was folded."""
        if self.parts is None:
            return min(self.shape)
        return sum(self.splits)

    def clear(self) -> None:
        """Forgets everything (the weight is back at ``W0``)."""
        self.parts = []

    @torch.no_grad()
    def record(self, residual: Residual) -> Residual:
        """Records ``residual`` (already scaled); returns it as it must be folded.

        That is in this record's dtype and device, contiguous: the replay folds the very
        same tensors.
        """
        dev, dt = self._anchor.device, self.dtype
        d, n = self.shape
        if residual.dense is not None:
            self.parts = None  # a dense residual: the weight is the state from now on
            return Residual(self.shape, dense=residual.dense.to(dev, dt).contiguous())
        U = residual.U.to(dev, dt).contiguous()
        V = residual.V.to(dev, dt).contiguous()
        if self.parts is not None:
            if (sum(self.splits) + U.shape[1]) * (d + n) < d * n:
                self.parts.append((U, V))
            else:
                self.parts = None  # dense is smaller now: the weight is the state
        return Residual(self.shape, U=U, V=V)

    @staticmethod
    def split(residual: Residual, splits: list[int] | None) -> list[Residual]:
        """A recorded state back into its parts (``splits``: their ranks; ``None``: one).

        Raises:
            ValueError: If the splits do not add up to the residual's rank.
        """
        if residual.is_zero:
            return []
        if residual.dense is not None:
            return [residual]
        q = int(residual.U.shape[1])
        splits = list(splits) if splits else [q]
        if sum(splits) != q or any(s <= 0 for s in splits):
            raise ValueError(f"recorded splits {splits} do not add up to the rank {q}")
        out, start = [], 0
        for s in splits:
            U = residual.U[:, start : start + s].contiguous()
            V = residual.V[start : start + s].contiguous()
            out.append(Residual(residual.shape, U=U, V=V))
            start += s
        return out
