"""The fp32 side branch: where folded residuals live when the base cannot hold them.

A bf16/fp16 weight rounds away most of a small update (bf16 keeps 8 bits of mantissa: an
update 1e-3 the size of the weight loses about 80% of itself), and a 4-bit or 8-bit
weight cannot be changed at all without re-quantizing. So for such a layer the
accumulated ``scale * residual`` is kept beside it in fp32, factored ``U @ V`` or dense,
whichever is smaller, and added to the layer's output in the forward pass:
``y = base(x) + lora(x) + x @ (U V)^T``.

Pure torch: no peft. :mod:`fedexlora.bridge.adapters` attaches one to each LoRA layer that
needs it.
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual

__all__ = ["SideBranch"]


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
        refactor: Re-factor each sum to numerical rank (QR and a small SVD). A branch
            the forward pass applies needs its rank small; an fp32 layer's accumulator,
            rebuilt into the weight with one ``addmm``, only concatenates (no rounding,
            no QR of ever taller factors) until dense is smaller.
    """

    def __init__(
        self,
        d: int,
        n: int,
        *,
        max_rank: int | None = None,
        device=None,
        dtype=torch.float32,
        refactor: bool = True,
    ):
        super().__init__()
        self.shape = (d, n)
        self.max_rank = max_rank
        self.dtype = dtype
        self.refactor = refactor
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
        is smaller, and cut to ``max_rank`` when set. Without ``refactor`` the factors
        are only concatenated until dense is smaller. The first residual is kept as it
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
        if not self.refactor and residual.dense is None and cur.dense is None:
            U = torch.cat([cur.U, residual.U.to(dev, self.dtype)], 1)
            V = torch.cat([cur.V, residual.V.to(dev, self.dtype)], 0)
            d, n = self.shape
            if U.shape[1] * (d + n) < d * n:
                self.set(Residual(self.shape, U=U, V=V))
            else:  # dense is smaller now
                self.set(Residual(self.shape, dense=U.double() @ V.double()))
            return
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
