"""The server's record of everything folded into the global base since ``W0``.

Reset payloads and checkpoints are built from it. Per layer it is kept factored while that
is smaller (the round's factors appended in place), then dense. An engine that folds every
outcome into a model it holds can spare the server the dense copy: with :attr:`source`
set (both of fedex-lora's engines set it to :func:`fedexlora.bridge.fold.folded_delta`
on their model), a layer whose record would turn dense is dropped (:attr:`outgrown`) and
read from the model when asked. The model is checked against the factors of the rounds
that reached it at the first read, or at the start of the next round
(:meth:`DeltaRecord.check_all`); on a mismatch the record warns and keeps its own copy.

Pure torch: no peft, no model. The source is any ``name -> Residual`` callable.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.state import LayerInfo

__all__ = ["DeltaRecord"]


class DeltaRecord:
    """Per layer, the sum of the residuals folded since ``W0``, in the server's units.

    Attributes:
        kept: The layers whose delta this record holds itself (factored or dense).
        source: Reads what the global model holds folded (``name -> Residual``), or None.
        outgrown: The layers whose delta only the model holds.
    """

    def __init__(self, layers: Mapping[str, LayerInfo]):
        self.layers = layers
        self.kept: dict[str, Residual] = {}
        self.source: Callable[[str], Residual] | None = None
        self.outgrown: set[str] = set()
        # a factored delta's U and V are views into these, with room for more rounds
        self._room: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # per outgrown layer, the factors that reached it, until the model is checked
        self._unchecked: dict[str, list[Residual]] = {}
        self._own: set[str] = set()  # layers whose model disagreed: kept here for good

    # -- reading ---------------------------------------------------------------------
    def get(self, name: str) -> Residual | None:
        """Module ``name``'s delta (read from the model where :attr:`outgrown`), or None."""
        if name in self.outgrown:
            if self.source is None:
                raise RuntimeError(
                    f"the base delta of {name!r} lives in the engine's model, and the "
                    "server has no `delta_source` to read it from"
                )
            if name not in self._unchecked:
                return self.source(name)
            held = self._check(name)
            if held is not None:
                return held
        return self.kept.get(name)

    def all(self) -> dict[str, Residual]:
        """Every layer's delta, zero ones included (a checkpoint's)."""
        return {name: self.get(name) for name in [*self.kept, *sorted(self.outgrown)]}

    def nbytes(self, name: str | None = None) -> int:
        """Bytes of a delta as a reset payload sends it (all layers for ``None``)."""
        if name is None:
            return sum(self.nbytes(k) for k in [*self.kept, *self.outgrown])
        if name in self.outgrown:
            return self._dense_bytes(name)  # a reset payload sends it dense, fp32
        r = self.kept.get(name)
        return 0 if r is None or r.is_zero else r.nbytes

    def held_nbytes(self) -> int:
        """Bytes this record holds (the factors awaiting a check included)."""
        return sum(r.nbytes for r in self.kept.values()) + sum(
            p.nbytes for parts in self._unchecked.values() for p in parts
        )

    # -- writing ---------------------------------------------------------------------
    def add(self, name: str, r: Residual) -> None:
        """Adds a round's residual ``r`` to module ``name``'s delta.

        Factors are appended in place (not re-factored, not concatenated anew: the round
        copies only its own). Where the sum would turn dense and :attr:`source` can give
        it, the copy is dropped: the model holds it, and forming a dense ``d x n`` here
        would cost a matmul of the record's whole rank in that round and a dense add in
        every later one. The factors are kept until the model is checked against them.
        """
        if name in self.outgrown:
            return  # the model holds it (checked at the start of this round at the latest)
        prev = self.kept.get(name)
        if prev is not None and prev.is_zero:
            prev = None
        d, n = self.layers[name].shape
        grows_dense = (
            r.dense is not None
            or prev is not None
            and (prev.dense is not None or (prev.rank + r.rank) * (d + n) >= d * n)
        )
        if not grows_dense:
            self.kept[name] = r if prev is None else self._append(name, prev, r)
            return
        self._room.pop(name, None)
        parts = [r] if prev is None else [prev, r]
        if self.source is not None and name not in self._own:
            self.outgrown.add(name)
            self.kept.pop(name, None)
            self._unchecked[name] = parts
            return
        self.kept[name] = r if prev is None else Residual.concat(parts, reduce=False)

    def set(self, name: str, r: Residual) -> None:
        """Replaces module ``name``'s delta (the ``side_rank`` mode's capped delta)."""
        self.kept[name] = r

    def load(self, kept: dict[str, Residual]) -> None:
        """Restores the deltas of a checkpoint.

        With a :attr:`source`, a dense delta is one the record had dropped (checkpoints
        read it from the model): it is dropped again, to be checked against the model
        (restored by then) at the first read or the next round.
        """
        self.kept = dict(kept)
        self.outgrown, self._room, self._unchecked, self._own = set(), {}, {}, set()
        if self.source is not None:
            for name, r in list(self.kept.items()):
                if r.dense is not None:
                    self.outgrown.add(name)
                    self._unchecked[name] = [self.kept.pop(name)]

    def check_all(self) -> None:
        """Checks every outgrown layer not yet checked: call once the model folded them."""
        for name in list(self._unchecked):
            self._check(name)

    # -- internals -------------------------------------------------------------------
    def _append(self, name: str, prev: Residual, r: Residual) -> Residual:
        """``prev + r``, factored: ``r``'s factors written after ``prev``'s in place.

        ``prev``'s ``U`` and ``V`` are views of buffers with room to spare (twice what is
        used, up to the rank at which dense is smaller), so a round copies only its own
        residual, not the whole record. A view handed out earlier never changes.
        """
        d, n = prev.shape
        q0, q1 = int(prev.U.shape[1]), int(r.U.shape[1])
        room = self._room.get(name)
        if (
            room is None
            or room[0].data_ptr() != prev.U.data_ptr()
            or room[1].data_ptr() != prev.V.data_ptr()
            or room[0].shape[1] < q0 + q1
            or room[0].dtype != prev.U.dtype
        ):
            cap = min(max(2 * (q0 + q1), 16), -(-d * n // (d + n)))
            U = torch.empty(d, cap, dtype=prev.U.dtype, device=prev.U.device)
            V = torch.empty(cap, n, dtype=prev.V.dtype, device=prev.V.device)
            U[:, :q0], V[:q0] = prev.U, prev.V
            room = self._room[name] = (U, V)
        U, V = room
        U[:, q0 : q0 + q1] = r.U.to(U)
        V[q0 : q0 + q1] = r.V.to(V)
        return Residual((d, n), U=U[:, : q0 + q1], V=V[: q0 + q1])

    def _dense_bytes(self, name: str) -> int:
        d, n = self.layers[name].shape
        return d * n * 4

    def _check(self, name: str) -> Residual | None:
        """Checks the model's delta of ``name`` against the factors that reached it.

        On a random probe (two fp32 matrix-vector products per round's factors, to 1%).
        Returns the model's delta; on a mismatch (was every outcome folded into the model
        given as the source?) it warns, keeps the delta here from then on, and returns
        ``None``.
        """
        parts = self._unchecked.pop(name)
        held = self.source(name)
        d, n = self.layers[name].shape
        ok = tuple(held.shape) == (d, n)
        if ok:
            x = torch.randn(n, 1, generator=torch.Generator().manual_seed(7_919))

            def probe(res: Residual) -> torch.Tensor:
                if res.is_zero:
                    return torch.zeros(d, 1)
                if res.dense is not None:
                    return res.dense.cpu().float() @ x
                return res.U.cpu().float() @ (res.V.cpu().float() @ x)

            want = sum(probe(p) for p in parts)
            ok = bool(torch.linalg.norm(probe(held) - want) <= 1e-2 * torch.linalg.norm(want))
        if ok:
            return held
        warnings.warn(
            f"the model's base delta of {name!r} is not the server's record: the server "
            "keeps its own copy (was every round's residual folded into the model given "
            "as `delta_source`?)",
            stacklevel=4,
        )
        self.outgrown.discard(name)
        self._own.add(name)
        self.kept[name] = Residual.concat(parts, reduce=False)
        return None
