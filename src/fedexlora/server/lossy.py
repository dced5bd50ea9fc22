"""The lossy modes: residuals truncated, or the base delta capped, with error feedback.

:class:`LossyModes` is the part of :class:`~fedexlora.server.Server` that
``residual_rank`` and ``side_rank`` turn on (both lift the exactness promise and mark a
run *approximate*). ``residual_rank`` truncates each round's residual
(:meth:`~LossyModes._truncate`); ``side_rank`` keeps the accumulated base delta at that
rank (:meth:`~LossyModes._cap_side`). Either way what is cut off is kept back
(``feedback``) and added to the next round's residual, so nothing is lost for good.
"""

from __future__ import annotations

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.side import rank_cap

__all__ = ["LossyModes"]


class LossyModes:
    """``residual_rank`` and ``side_rank`` (one cap, or per layer) of the server."""

    def _cap_side(self, residuals: dict[str, Residual]):
        """``side_rank``: the residual that moves each base delta ``S`` to ``trunc(S + R + F)``.

        ``F`` is what earlier caps cut off (error feedback). The cap is one rank for every
        layer, or each layer's own (``--side-budget``: :func:`fedexlora.core.side.rank_cap`;
        ``None``, a layer whose budget holds the whole delta, is exact). A move that would
        leave the model further from the round's ideal than dropping the round's residual
        (FedIT's gap, ``||R||``) is not made: the delta stays and ``R`` joins the feedback,
        so no round's deviation is worse than FedIT's at the same uploads. Returns the
        residuals to fold, the new capped deltas, and the norm of what is kept back.
        """
        out, capped, norms = {}, {}, {}
        for name in sorted(set(residuals) | set(self.feedback)):
            old = self.base_delta.get(name)
            parts = [
                p
                for p in (old, residuals.get(name), self.feedback.get(name))
                if p is not None and not p.is_zero
            ]
            if not parts:
                continue
            total = parts[0] if len(parts) == 1 else Residual.concat(parts)
            cap = rank_cap(self.side_rank, name)
            if cap is None:  # this layer's budget holds it whole: exact
                target, rest = total, _zero_like(total)
            else:
                target, rest = total.truncate(cap)
            R = residuals.get(name)
            still = old is not None and not old.is_zero and _moves_off(target, old, R)
            if still:
                # catching up on what earlier caps held back would take the model further
                # from this round's ideal than dropping the round's residual (FedIT's gap):
                # the branch stays, and the round's residual joins the feedback
                target = old
                fb = [p for p in (R, self.feedback.get(name)) if p is not None and not p.is_zero]
                rest = (
                    _zero_like(total) if not fb else fb[0] if len(fb) == 1 else Residual.concat(fb)
                )
            self.feedback[name] = rest
            norms[name] = _fro(rest)
            capped[name] = target
            if still:
                continue  # nothing to fold: every side branch keeps what it holds
            if old is None or old.is_zero:
                out[name] = target
            else:
                out[name] = Residual.concat([target, old.scaled(-1.0)])
        return out, capped, norms

    def _truncate(self, residuals: dict[str, Residual]):
        """``residual_rank``: each residual plus its feedback, truncated to that rank.

        Returns the residuals to fold and the norm of what is kept back.
        """
        kept, norms = {}, {}
        for name, r in residuals.items():
            fb = self.feedback.get(name)
            total = r if fb is None or fb.is_zero else Residual.concat([r, fb])
            k, rest = total.truncate(self.residual_rank)
            kept[name] = k
            self.feedback[name] = rest
            norms[name] = (
                float(torch.linalg.norm(rest.to_dense()).item()) if not rest.is_zero else 0.0
            )
        return kept, norms


def _fro(r: Residual | None) -> float:
    """``||r||_F``, from the factors' Gram matrices when factored (no ``(d, n)``)."""
    if r is None or r.is_zero:
        return 0.0
    if r.dense is not None:
        return float(torch.linalg.norm(r.dense.double()))
    U, V = r.U.double(), r.V.double()
    return float(torch.sum((U.T @ U) * (V @ V.T)).clamp_min(0).sqrt())


def _moves_off(target: Residual, old: Residual, R: Residual | None) -> bool:
    """Whether moving the held delta from ``old`` to ``target`` misses the round's ideal.

    The ideal moves by the round's residual ``R``; FedIT's model misses it by ``||R||``.
    """
    parts = [target, old.scaled(-1.0)] + ([] if R is None or R.is_zero else [R.scaled(-1.0)])
    gap = _fro(Residual.concat(parts))
    return gap > _fro(R) * (1 + 1e-9)


def _zero_like(r: Residual) -> Residual:
    t = r.dense if r.dense is not None else r.U
    return Residual.zero(*r.shape, dtype=t.dtype, device=t.device)
