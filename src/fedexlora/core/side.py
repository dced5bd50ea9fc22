"""The fp32 side branch: where folded residuals live when the base cannot hold them.

A bf16/fp16 weight rounds away most of a small update (bf16 keeps 8 bits of mantissa: an
update 1e-3 the size of the weight loses about 80% of itself), and a 4-bit or 8-bit
weight cannot be changed at all without re-quantizing. So for such a layer the
accumulated ``scale * residual`` is kept beside it in fp32, factored ``U @ V`` or dense,
whichever is smaller, and added to the layer's output in the forward pass:
``y = base(x) + lora(x) + x @ (U V)^T``.

An fp32 (or fp64) weight holds its update itself: an :class:`Accumulator` keeps the sum of
what was folded, and the weight is rebuilt as ``W0 + sum``.

Pure torch: no peft. :mod:`fedexlora.bridge.adapters` attaches one to each LoRA layer that
needs it.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual

__all__ = ["Accumulator", "SideBranch"]


class SideBranch(torch.nn.Module):
    """An fp32 correction ``delta`` of shape ``(d, n)`` added to a layer's output.

    ``forward(x, out)`` returns ``out + x @ delta.T``, computed in fp32 with autocast
    off and rounded once to ``out``'s dtype, exactly as peft treats the LoRA branch of a
    half-precision layer. The tensors are non-persistent buffers: they follow the model
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
        """Adds ``residual`` (already scaled) and re-factors the sum to numerical rank.

        The sum is formed and reduced in fp64 (QR and a small SVD, never the ``(d, n)``
        product while factors are smaller), then stored in fp32, dense only where that
        is smaller, and cut to ``max_rank`` when set. The first residual is kept as it
        came.
        """
        if residual.is_zero:
            return
        cur = self.residual
        small = residual.dense is None and residual.U.shape[1] <= (self.max_rank or 0)
        if cur.is_zero and (self.max_rank is None or small):
            self.set(residual)  # the first one: as it came (already at numerical rank)
            return
        dev = self.U.device
        if residual.dense is not None or cur.dense is not None:
            total = Residual(
                self.shape,
                dense=cur.to_dense().to(dev, torch.float64)
                + residual.to_dense().to(dev, torch.float64),
            )
        else:
            U = torch.cat([cur.U.to(dev, torch.float64), residual.U.to(dev, torch.float64)], 1)
            V = torch.cat([cur.V.to(dev, torch.float64), residual.V.to(dev, torch.float64)], 0)
            total = Residual.from_factors(U, V)
        if self.max_rank is not None and total.rank > self.max_rank:
            total, _ = total.truncate(self.max_rank)
        self.set(total)

    def to_dense(self) -> torch.Tensor:
        """The ``(d, n)`` correction in fp64."""
        if self.dense is not None:
            return self.dense.double()
        return self.U.double() @ self.V.double()

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + x @ delta.T`` in fp32, rounded once to ``out.dtype``."""
        if self.dense is None and self.U.shape[1] == 0:
            return out
        with torch.autocast(device_type=x.device.type, enabled=False):
            x32 = x.to(torch.float32)
            if self.dense is not None:
                delta = x32 @ self.dense.T
            else:
                delta = (x32 @ self.V.T) @ self.U.T
            return (out.to(torch.float32) + delta).to(out.dtype)


class Accumulator(torch.nn.Module):
    """The sum of what was folded into an fp32 (or fp64) layer, for ``W = W0 + sum``.

    The sum is held dense from the first residual on (``total``, one ``addmm_`` per
    residual), so every round costs one fold whatever came before, and the form never
    changes. Beside it the residuals themselves are kept, factored, while together they
    are smaller than one dense ``(d, n)``: that is what :attr:`residual` returns for a
    client's saved state, and :meth:`set` replays them one by one (``splits``) into the
    very bits of ``total``. Once they outgrow dense they are dropped and the state is
    ``total`` itself.

    The tensors are non-persistent buffers (the parts follow the module's device too).
    """

    def __init__(self, d: int, n: int, *, device=None, dtype=torch.float32):
        super().__init__()
        self.shape = (d, n)
        self.dtype = dtype
        self.max_rank = None  # not used: the sum is exact (kept for the fold's interface)
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] | None = []
        self.register_buffer("total", None, persistent=False)
        self.register_buffer(
            "_anchor", torch.zeros(0, device=device, dtype=dtype), persistent=False
        )

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.parts:
            self.parts = [(fn(U), fn(V)) for U, V in self.parts]
        return out

    @property
    def splits(self) -> list[int]:
        """The rank of each residual held factored, in the order they were added."""
        return [int(U.shape[1]) for U, _ in self.parts or []]

    @property
    def residual(self) -> Residual:
        """The sum as a :class:`Residual`: the factors concatenated while held, else dense."""
        d, n = self.shape
        if self.parts:
            U = torch.cat([U for U, _ in self.parts], 1)
            V = torch.cat([V for _, V in self.parts], 0)
            return Residual(self.shape, U=U, V=V)
        if self.total is not None:
            return Residual(self.shape, dense=self.total)
        return Residual.zero(d, n, dtype=self.dtype, device=self._anchor.device)

    @property
    def rank(self) -> int:
        """Columns of the factors held, ``min(d, n)`` once dense, 0 when empty."""
        if self.parts:
            return sum(self.splits)
        return min(self.shape) if self.total is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the state (:attr:`residual`)."""
        return self.residual.nbytes

    @torch.no_grad()
    def set(self, residual: Residual, splits: list[int] | None = None) -> None:
        """Replaces the sum with ``residual``, added as the parts ``splits`` say.

        ``splits`` are the ranks of the residuals a factored state was built from
        (:attr:`splits`); replaying them in order gives the bits the sum had. Without
        them the factors are one part.
        """
        if tuple(residual.shape) != self.shape:
            raise ValueError(f"accumulator is {self.shape}, got a residual of {residual.shape}")
        self.parts, self.total = [], None
        if residual.is_zero:
            return
        if residual.dense is not None:
            self.add(residual)
            return
        q = int(residual.U.shape[1])
        splits = list(splits) if splits else [q]
        if sum(splits) != q or any(s <= 0 for s in splits):
            raise ValueError(f"accumulator splits {splits} do not add up to the rank {q}")
        start = 0
        for s in splits:
            part = Residual(
                self.shape,
                U=residual.U[:, start : start + s],
                V=residual.V[start : start + s],
            )
            self.add(part)
            start += s

    @torch.no_grad()
    def add(self, residual: Residual) -> None:
        """``sum += residual`` (already scaled): one ``addmm_`` (or ``add_``)."""
        if residual.is_zero:
            return
        dev, dt = self._anchor.device, self.dtype
        d, n = self.shape
        if self.total is None:
            self.total = torch.zeros(d, n, device=dev, dtype=dt)
        if residual.dense is not None:
            self.total.add_(residual.dense.to(dev, dt))
            self.parts = None  # a dense part: the state is the sum itself from now on
            return
        U = residual.U.to(dev, dt).contiguous()
        V = residual.V.to(dev, dt).contiguous()
        self.total.addmm_(U, V)
        if self.parts is not None:
            if (sum(self.splits) + U.shape[1]) * (d + n) < d * n:
                self.parts.append((U, V))
            else:
                self.parts = None  # dense is smaller now: the state is the sum

    def to_dense(self) -> torch.Tensor:
        """The ``(d, n)`` sum in fp64."""
        if self.total is None:
            return torch.zeros(self.shape, dtype=torch.float64, device=self._anchor.device)
        return self.total.double()
