"""What the server holds, as data: its state for checkpoints, and its size by part.

:class:`StateDict` is the part of :class:`~fedexlora.server.Server` that turns its fields
into a ``state_dict`` (JSON-able values and one flat map of tensors, as torch's) and back:
:meth:`~StateDict.load_state_dict` parses and checks a state first
(:mod:`fedexlora.server.snapshot`) and changes the server completely or not at all.
:meth:`~StateDict.nbytes` counts the bytes of the tensors the server keeps.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedexlora.core.aggregation import residuals_to_flat
from fedexlora.core.messages import _nbytes
from fedexlora.server.snapshot import _parse_state, check_state

__all__ = ["StateDict"]


class StateDict:
    """``state_dict``, ``load_state_dict`` and ``nbytes`` of :class:`~fedexlora.server.Server`."""

    def state_dict(self) -> dict:
        """Everything that restores this server exactly, as torch's ``state_dict``.

        A server built with the same arguments and given this by :meth:`load_state_dict`
        sends the same payloads and aggregates to the same results, bit for bit. Client
        sampling, FLoRA's re-initialisation and the heterogeneous views draw from
        generators seeded by ``seed``, the round and the client, so ``round`` is all the
        random state there is. The constructor's arguments are not part of it.

        Returns:
            A new dict. ``tensors`` holds detached copies; everything else is JSON-able:

            - ``round``, ``version``: rounds done; the base-weight version.
            - ``method``: the aggregation method (checked on load).
            - ``client_version``: ``{str(client): version}``, the base each client holds.
            - ``history_versions``: each ``v`` whose residual (version ``v`` to ``v + 1``)
              is kept for catch-up.
            - ``remainder_clients``, ``sent_clients``: heterogeneous ranks: the clients
              whose remainder ``T_c``, and whose view, the server holds.
            - ``last_sizes``: ``{module: [bytes, dense bytes]}`` of the latest residual.
            - ``client_rank``: ``{str(client): rank}``, the rank each client pruned itself
              to (HetLoRA).
            - ``tensors``: flat ``name -> tensor``: ``state.<key>`` (the global state,
              :meth:`~fedexlora.core.state.AdapterState.to_flat`),
              ``base_delta.<module>.<U|V|dense>`` (see
              :func:`~fedexlora.core.aggregation.residuals_to_flat`), ``feedback.…``,
              ``history<v>.…``, ``remainder<c>.…`` and ``sent<c>.<key>``.
        """
        flat = {f"state.{k}": v for k, v in self.state.to_flat().items()}
        # the outgrown layers' deltas are read from the model: the format does not change
        flat.update(residuals_to_flat("base_delta", self.record.all()))
        flat.update(residuals_to_flat("feedback", self.feedback))
        for v, res in self.history.items():
            flat.update(residuals_to_flat(f"history{v}", res))
        for c, res in self.remainder.items():
            flat.update(residuals_to_flat(f"remainder{c}", res))
        for c, view in self.sent.items():
            flat.update({f"sent{c}.{k}": t for k, t in view.to_flat().items()})
        return {
            "round": self.round,
            "version": self.version,
            "method": self.method,
            "client_version": {str(c): v for c, v in self.client_version.items()},
            "history_versions": sorted(self.history),
            "remainder_clients": sorted(self.remainder),
            "last_sizes": {k: list(v) for k, v in self.last_sizes.items()},
            "sent_clients": sorted(self.sent),
            "client_rank": {str(c): r for c, r in sorted(self.client_rank.items())},
            "tensors": {k: t.detach().contiguous().clone() for k, t in flat.items()},
        }

    def load_state_dict(self, state: Mapping, *, assign: bool = False) -> None:
        """Restores a :meth:`state_dict`, completely or not at all.

        Everything is parsed and checked against this server before anything changes.

        Args:
            state: What :meth:`state_dict` returned (or a copy read back from disk).
            assign: Keep the given tensors instead of copies, as torch's ``assign`` does:
                for a caller that owns them (a checkpoint loader) and would rather not
                hold them twice.

        Raises:
            ServerStateMismatch: If ``state`` is for another method, or its modules,
                shapes, dtypes or heterogeneous clients are not this server's.
            ValueError: If ``state`` is malformed: a key missing or unexpected, a value
                of the wrong type, tensors that make no residual or adapter state.
        """
        parsed = _parse_state(state, assign=assign)
        check_state(self, parsed)
        self.round = parsed["round"]
        self.version = parsed["version"]
        self.state = parsed["state"]
        self.client_version = parsed["client_version"]
        self.history = parsed["history"]
        self.last_sizes = parsed["last_sizes"]
        self.record.load(parsed["base_delta"])
        self.feedback = parsed["feedback"]
        self.remainder = parsed["remainder"]
        self.sent = parsed["sent"]
        self.client_rank = parsed["client_rank"]
        self.awaiting = set()  # payloads sent before the load were for another state

    def nbytes(self) -> dict[str, int]:
        """Bytes of the server's tensors, by part (``total`` is their sum).

        ``state``: the global factors and extras; ``base_delta``: what was folded into the
        global base since ``W0``, where the server keeps it (not the :attr:`outgrown`
        layers, which the model holds); ``history``: the residuals kept for catch-up;
        ``feedback``: what the lossy modes hold back; ``clients``: per-client views
        (heterogeneous ranks only).
        """
        out = {
            "state": self.state.nbytes,
            "base_delta": self.record.held_nbytes(),
            "history": sum(_nbytes(res) for res in self.history.values()),
            "feedback": _nbytes(self.feedback),
            "clients": sum(_nbytes(t) for t in self.remainder.values())
            + sum(v.nbytes for v in self.sent.values()),
        }
        out["total"] = sum(out.values())
        return out
