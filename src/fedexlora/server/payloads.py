"""What the server sends: client sampling, each client's payload, the catch-up history.

:class:`Payloads` is the part of :class:`~fedexlora.server.Server` that decides who trains
in a round (:meth:`~Payloads.sample`) and what each of them receives
(:meth:`~Payloads.payload_for`): the global factors (or only those the round uploads),
and the residuals that bring the client's base from the version it holds to the current
one, from the residual history, or a ``reset`` payload of the whole base delta when that
history no longer reaches back. It keeps the version each client holds
(``client_version``) and prunes the history to what clients need and the memory bound
allows. A client of another rank gets its own view through
:mod:`fedexlora.server.hetero`. The fields it reads and writes are the server's, set in
:class:`~fedexlora.server.Server`'s constructor.
"""

from __future__ import annotations

import math
import operator

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.messages import Payload, _nbytes
from fedexlora.core.sampling import sample_size
from fedexlora.core.state import AdapterState
from fedexlora.server.timing import timed

__all__ = ["Payloads"]


class Payloads:
    """Sampling, payloads and the residual history of :class:`~fedexlora.server.Server`."""

    def sample(self, rnd: int) -> list[int]:
        """The clients taking part in round ``rnd`` (sorted), seeded by (seed, round)."""
        m = self.sample_size()
        if m >= self.num_clients:
            return list(range(self.num_clients))
        g = torch.Generator().manual_seed(self.seed * 100_003 + rnd)
        return sorted(torch.randperm(self.num_clients, generator=g)[:m].tolist())

    def sample_size(self) -> int:
        """Clients per round (:func:`fedexlora.core.sampling.sample_size`, as DP plans)."""
        return sample_size(self.num_clients, self.fraction)

    def expected_absence(self) -> float:
        """Rounds a client waits, on average, between two samplings (1 when all are)."""
        return max(1.0, self.num_clients / self.sample_size())

    def _uploaded(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients upload A and B in round ``rnd`` (the factors the server updates)."""
        return self.spec.plan(rnd).uploaded

    def upload_template(self, rnd: int | None = None) -> AdapterState:
        """What a valid upload in round ``rnd`` contains (default: the coming round).

        The round plan's uploads (:meth:`~fedexlora.core.methods.MethodSpec.plan`, what
        every client step sends): FFA-LoRA clients send no A; RoLoRA's send only the
        factor the round trains; FedSA-LoRA's send no B and no task head (each keeps its
        own).
        """
        plan = self.spec.plan(self.round + 1 if rnd is None else rnd)
        if plan.upload_A and plan.upload_B and plan.upload_extra:
            return self.state
        return AdapterState(
            factors={
                k: (A if plan.upload_A else None, B if plan.upload_B else None)
                for k, (A, B) in self.state.factors.items()
            },
            extra=self.state.extra if plan.upload_extra else {},
        )

    def catch_up(self, since: int) -> dict[str, Residual] | None:
        """Per module, the residual that moves a base from version ``since`` to now.

        The residuals of the missed rounds are concatenated (not re-factored), or summed
        dense where that is smaller. ``None`` when the history no longer
        reaches back to ``since`` (the client must be reset from ``W0``).
        """
        if since >= self.version:
            return {}
        if since < self.history_floor:
            return None
        out = {}
        for name in self.layers:
            parts = [
                self.history[v][name] for v in range(since, self.version) if name in self.history[v]
            ]
            if parts:
                out[name] = parts[0] if len(parts) == 1 else Residual.concat(parts, reduce=False)
        return out

    @property
    def history_floor(self) -> int:
        """The oldest base version the residual history can still bring up to date."""
        return min(self.history, default=self.version)

    @timed
    def payload_for(self, client_id: int) -> Payload:
        """Builds the payload for ``client_id`` and records its new base version.

        A client the server knows at a version its history still reaches gets the
        residuals since that version. A new or forgotten client, or one away longer than
        the history reaches, gets a ``reset`` payload: the accumulated base delta from
        ``W0`` (also chosen when it is smaller than the catch-up). Either way the client
        holds the global model exactly after :func:`fedexlora.bridge.steps.apply_payload`.

        When clients are sampled more rarely than the history reaches
        (:meth:`expected_absence` > :meth:`history_reach`, e.g. 1% of many clients), the
        payload says ``keep=False`` and the server does not remember the client's
        version: its next payload will be a reset one, and it need not keep its model.
        """
        try:
            client_id = operator.index(client_id)  # an int, numpy's included
        except TypeError:
            raise TypeError(f"client_id must be an integer, got {client_id!r}") from None
        if not 0 <= client_id < self.num_clients:
            raise ValueError(
                f"client {client_id}: the server has {self.num_clients} clients "
                f"(ids 0 to {self.num_clients - 1}; Server(num_clients=...))"
            )
        self.awaiting.add(client_id)  # its upload is this round's (aggregate checks it)
        since = self.client_version.get(client_id)
        residuals = None if since is None else self.catch_up(since)
        if residuals and self.record.nbytes() < _nbytes(residuals):
            residuals = None  # the whole delta is smaller than the catch-up
        reset = residuals is None
        if reset:
            residuals = self.deltas()
            self.remainder.pop(client_id, None)  # heterogeneous ranks: nothing folded
        state = self.state
        if self.spec.sends_uploaded_parts_only(reset, self.round + 1):  # it holds the rest
            state = self.upload_template(self.round + 1)
        if reset:
            self.client_rank.pop(client_id, None)  # a client that starts over: its full rank
        if client_id in self.client_layers:
            state, residuals = self._hetero_view(client_id, residuals)
        state = self._pruned_view(client_id, state)  # HetLoRA: what it pruned stays pruned
        keep = self.history_reach() >= self.expected_absence()
        if keep:
            self.client_version[client_id] = self.version
        else:  # its next payload is a reset one: nothing to remember but this round's view
            self.client_version.pop(client_id, None)
        self._prune()
        return Payload(
            round=self.round + 1,
            version=self.version,
            state=state,
            residuals=residuals,
            reset=reset,
            keep=keep,
            scales={n: x.scale for n, x in self.client_layers.get(client_id, self.layers).items()},
        )

    def history_reach(self) -> float:
        """About how many rounds back the history will reach (``inf`` before any round).

        The latest round's residual is always kept; as many more rounds of its size as
        fit beside the base delta in one dense update, the least over the layers.
        """
        reach = math.inf
        for name, (size, dense) in self.last_sizes.items():
            room = dense - self.record.nbytes(name)
            reach = min(reach, 1 + max(0, room) // max(1, size))
        return reach

    def forget_client(self, client_id: int) -> None:
        """Marks a client's base weights as unknown, e.g. after its payload was lost.

        Its next payload is built as for a new client: the whole base delta since W0, with
        every factor, so the client must start again from the pretrained weights.
        """
        self.client_version.pop(client_id, None)
        self.remainder.pop(client_id, None)  # heterogeneous ranks: nothing folded any more
        self.client_rank.pop(client_id, None)

    def _prune(self) -> None:
        """Drops history no client needs, and history beyond the memory bound.

        Per layer, the history older than the latest round plus the base delta must fit
        in one dense ``(d, n)`` update; the oldest rounds go first. Clients that held one
        of them are reset from the base delta when they come back.
        """
        if not self.history:
            return
        oldest = min(self.client_version.values(), default=self.version)
        drop = {v for v in self.history if v < oldest}
        newest = max(self.history)
        used = {name: self.record.nbytes(name) for name in [*self.base_delta, *self.outgrown]}
        cut = False
        for v in sorted(self.history, reverse=True):
            if v in drop:
                break
            if v == newest:
                continue  # the latest round's residual is always kept
            res = self.history[v]
            cut = cut or any(
                used.get(name, 0) + r.nbytes > self._dense_nbytes(name, r)
                for name, r in res.items()
            )
            if cut:
                drop.add(v)
                continue
            for name, r in res.items():
                used[name] = used.get(name, 0) + r.nbytes
        for v in drop:
            del self.history[v]

    def _dense_nbytes(self, name: str, r: Residual) -> int:
        d, n = self.layers[name].shape
        t = r.dense if r.dense is not None else r.U
        return d * n * (t.element_size() if t is not None else 4)
