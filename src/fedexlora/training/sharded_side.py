"""A LoRA layer's fp32 side branch sharded across a client's ranks (``--distributed fsdp``).

:class:`~fedexlora.core.side.SideBranch` holds its correction in buffers whose rank
changes every round, which ``fully_shard`` (it shards parameters, fixed at wrapping) cannot
follow. :class:`ShardedSide` holds each tensor as this rank's 1/N of its flattened
elements and gathers them for its layer's forward, and again in its backward, so the full
tensors live only while one layer runs. :mod:`fedexlora.training.distributed` installs one
per LoRA layer and loads each round's residual into it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["ShardedSide"]


class _Flat:
    """One tensor held as this rank's 1/N of its flattened, padded elements."""

    def __init__(self, full: torch.Tensor, rank: int, world: int, device, dtype):
        self.shape = tuple(full.shape)
        self.numel = full.numel()
        per = -(-self.numel // world) if self.numel else 0
        flat = full.reshape(-1)
        local = torch.zeros(per, dtype=dtype, device=device)
        lo, hi = min(rank * per, self.numel), min((rank + 1) * per, self.numel)
        local[: hi - lo] = flat[lo:hi].to(device=device, dtype=dtype)
        self.local = local

    def gather(self, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        out = torch.empty(self.local.numel() * world, dtype=self.local.dtype,
                          device=self.local.device)  # fmt: skip
        if self.numel:
            _all_gather(out, self.local, group=group)
        return out[: self.numel].view(self.shape)


# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Apply(torch.autograd.Function):
    """``x @ delta.T`` with ``delta`` gathered in forward and again in backward."""

    @staticmethod
    def forward(fctx, x, side):
        fctx.side = side
        held = side.gathered()
        if "dense" in held:
            return x @ held["dense"].T
        return (x @ held["V"].T) @ held["U"].T

    @staticmethod
    def backward(fctx, g):
        held = fctx.side.gathered()
        if "dense" in held:
            return g @ held["dense"], None
        return (g @ held["U"]) @ held["V"], None


class ShardedSide(torch.nn.Module):
    """A LoRA layer's fp32 side branch held as 1/N flat shards per rank (``fsdp``).

    The same correction as :class:`~fedexlora.core.side.SideBranch` (``out + x @
    delta.T`` in fp32 with autocast off, ``delta = U V`` or dense), with the same
    arithmetic; the full tensors exist only during its layer's forward and backward.
    """

    def __init__(self, d: int, n: int, *, dtype=torch.float32, ctx):
        super().__init__()
        self.shape = (d, n)
        self.dtype = dtype
        self._ctx = ctx
        self._parts: dict[str, _Flat] = {}
        self._rank = 0

    @property
    def rank(self) -> int:
        """Columns of ``U`` (factored), ``min(d, n)`` (dense), as one process holds it."""
        return self._rank

    @property
    def local_nbytes(self) -> int:
        """Bytes this rank holds."""
        return sum(p.local.numel() * p.local.element_size() for p in self._parts.values())

    @torch.no_grad()
    def set_full(self, tensors: Mapping[str, torch.Tensor], device) -> None:
        """Keeps this rank's shard of ``{"U", "V"}`` or ``{"dense"}`` (``{}``: none)."""
        r, w = self._ctx.rank, self._ctx.world_size
        self._parts = {k: _Flat(t, r, w, device, self.dtype) for k, t in tensors.items()}
        if "dense" in tensors:
            self._rank = min(self.shape)
        else:
            self._rank = int(tensors["U"].shape[1]) if "U" in tensors else 0

    def gathered(self) -> dict[str, torch.Tensor]:
        """The full tensors (one all-gather each, on the context's side group)."""
        return {k: p.gather(self._ctx.side_group) for k, p in self._parts.items()}

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + x @ delta.T`` in fp32 (fp64 if stored so), rounded once to ``out.dtype``."""
        if self._rank == 0:
            return out
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=x.device.type, enabled=False):
            delta = _Apply.apply(x.to(work), self)
            return (out.to(work) + delta).to(out.dtype)
