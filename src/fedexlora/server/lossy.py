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

__all__ = ["LossyModes"]


class LossyModes:
    """``residual_rank`` and ``side_rank`` of :class:`~fedexlora.server.Server`."""

    def _cap_side(self, residuals: dict[str, Residual]):
        """``side_rank``: the residual that moves each base delta ``S`` to ``trunc(S + R + F)``.

        ``F`` is what earlier caps cut off (error feedback). Returns the residuals to fold,
        the new capped deltas, and the norm of what is kept back.
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
            target, rest = total.truncate(self.side_rank)
            self.feedback[name] = rest
            norms[name] = 0.0 if rest.is_zero else float(torch.linalg.norm(rest.to_dense()))
            capped[name] = target
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
