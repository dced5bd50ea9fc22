"""Heterogeneous ranks on the server: each client's view, its remainder, its pruned rank.

:class:`HeteroRanks` is the part of :class:`~fedexlora.server.Server` for clients whose
adapter has another rank than the global one (``client_layers``;
:mod:`fedexlora.core.hetero` holds the math). It builds the view such a client trains
from and the residual that moves its base there (:meth:`~HeteroRanks._hetero_view`),
keeping per client the view it was sent (``sent``) and what it holds folded beyond its
rank (``remainder``, ``T_c``); it brings uploads back to the global rank and adds each
client's ``Σ p_i T_i`` to the round's residual. For HetLoRA it remembers the rank each
client pruned itself to (``client_rank``) and cuts that client's later views to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.factors import cut_rank
from fedexlora.core.hetero import client_view, to_global
from fedexlora.core.messages import ClientUpload
from fedexlora.core.state import AdapterState

__all__ = ["HeteroRanks"]


class HeteroRanks:
    """Clients of other ranks (views, remainders) and HetLoRA's pruned ranks."""

    def _hetero_view(self, c: int, glob: dict[str, Residual]):
        """Client ``c``'s factors, and its residual: catch-up plus the change of ``T_c``.

        Everything is expressed in the client's own LoRA scale.
        """
        gen = torch.Generator().manual_seed(self.seed * 65_537 + self.round * 101 + c)
        layers_c = self.client_layers[c]
        view, t_new = client_view(
            self.state, self.layers, layers_c, generator=gen, **self.spec.hetero_cut
        )
        t_old = self.remainder.get(c, {})
        out = {}
        for name, info in self.layers.items():
            s_c = layers_c[name].scale
            parts = []
            if name in glob:
                parts.append(glob[name].scaled(info.scale / s_c))
            if name in t_new:
                parts.append(t_new[name].scaled(1.0 / s_c))
            if name in t_old:
                parts.append(t_old[name].scaled(-1.0 / s_c))
            if parts:
                out[name] = parts[0] if len(parts) == 1 else Residual.concat(parts)
        self.remainder[c] = t_new
        self.sent[c] = view
        return view, out

    def _pruned_view(self, client_id: int, state: AdapterState) -> AdapterState:
        """HetLoRA: ``state`` cut to the rank the client pruned itself to (else as it is).

        The cut view becomes the one the client's upload is checked against.
        """
        if client_id in self.client_rank:
            state = cut_rank(state, self.client_rank[client_id])
            if client_id in self.sent:
                self.sent[client_id] = state
        return state

    def _note_pruned_ranks(self, accepted: Sequence[ClientUpload]) -> None:
        """A client that pruned its rank (HetLoRA): that rank, remembered below full."""
        used = self.spec.used_ranks({u.client_id: u.state for u in accepted})
        for c, rank in used.items():
            full = self.client_layers.get(c, self.layers)
            if rank < min(info.rank for info in full.values()):
                self.client_rank[c] = rank

    def _to_global(self, up: ClientUpload) -> AdapterState:
        if up.client_id not in self.client_layers:
            return up.state
        return to_global(up.state, self.layers, self.client_layers[up.client_id])

    def _add_remainders(self, residuals, accepted, weights) -> dict[str, Residual]:
        """Adds ``Σ p_i T_i / s_g``: the part of each client's start its factors lack."""
        out = dict(residuals)
        for name, info in self.layers.items():
            parts = [
                self.remainder[u.client_id][name].scaled(float(p) / info.scale)
                for u, p in zip(accepted, weights)
                if name in self.remainder.get(u.client_id, {})
            ]
            if parts:
                base = [out[name]] if name in out and not out[name].is_zero else []
                out[name] = Residual.concat(base + parts)
        return out
