"""Server state and one round of server logic, shared by every engine.

The server holds the global adapter state, the base-weight version, and the residual
history that clients who skipped rounds need to catch up (the messages themselves are in
:mod:`fedexlora.core.messages`, re-exported here). It samples clients, builds each
client's payload, validates uploads and aggregates them. It never touches a model: engines
fold the returned residuals into whatever model they hold (see :mod:`fedexlora.bridge.adapters`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from fedexlora.core.aggregation import Residual, residuals_to_flat
from fedexlora.core.hetero import client_view, cut_rank, to_global, used_rank
from fedexlora.core.messages import (
    ClientUpload,
    Payload,
    RoundOutcome,
    _nbytes,
    example_count,
    validate_upload,
)
from fedexlora.core.methods import get_method, method_names
from fedexlora.core.sampling import sample_size
from fedexlora.core.secure import SecureSums
from fedexlora.core.state import AdapterState, LayerInfo, aggregate_states
from fedexlora.server.record import DeltaRecord
from fedexlora.server.snapshot import (
    ServerStateMismatch,
    _parse_state,
    check_state,
)

__all__ = [
    "ClientUpload",
    "Payload",
    "RoundOutcome",
    "Server",
    "ServerStateMismatch",
    "example_count",
    "validate_upload",
]


def _timed(fn):
    """Adds the method's seconds to the server's work in the current round (``self._busy``).

    A call that advances the round (an aggregation, clear or secure) closes it: the
    seconds summed since the previous round closed become ``last_round_seconds``
    (payloads, validation, a secure round's unmasking, aggregation: the server's own
    work in the round).
    """

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        before = self.round
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._busy += time.perf_counter() - t0
            if self.round != before:
                self.last_round_seconds, self._busy = self._busy, 0.0

    return wrapper


class Server:
    """The federated server: global state, client sampling, payloads, aggregation.

    Its memory is bounded whatever the number of clients: per adapted layer it keeps the
    accumulated base delta (factored while that is smaller, else one dense matrix) and
    only as much residual history as fits beside it in one dense update's worth, plus
    the latest round's residual. A client away longer than that history reaches is sent
    a ``reset`` payload built from the base delta (see :meth:`payload_for`).

    An engine that holds the global model can spare the server its dense copy of the base
    delta: with :attr:`delta_source` set (both of fedex-lora's engines set it to
    :func:`fedexlora.bridge.adapters.folded_delta` on their model), a layer whose record
    would turn dense is dropped instead (:attr:`outgrown`) and read back from the model
    when a reset payload or a checkpoint needs it. Each round then costs the server no
    more than aggregating: no dense rebuild, no growing copy.

    Args:
        state: The initial global adapter state (with A for every module).
        layers: Scale, orientation and shape of each LoRA layer.
        method: ``fedex``, ``fedit``, ``ffa`` or ``flora``.
        num_clients: Clients in the federation.
        fraction: Fraction of clients sampled per round (at least one).
        weighting: ``examples`` or ``uniform``; ``None``: the method's own
            (:attr:`~fedexlora.core.methods.MethodSpec.weighting`: ``uniform`` for
            ``fedsa``, as its release, ``examples`` otherwise).
        seed: Seed for sampling and FLoRA's re-initialisation.
        residual_rank: Truncate residuals to this rank (lossy, with error feedback).
        side_rank: Keep the accumulated base delta (what side branches hold) at this rank
            at most (lossy, with error feedback): each round's residual moves it to the
            best rank-``side_rank`` approximation of the exact accumulated delta.
        max_update_norm: Reject uploads whose change from the global state is larger.
        client_layers: Per client, the LoRA layer info of the adapter it trains when it
            differs from the global one (heterogeneous ranks; see
            :mod:`fedexlora.core.hetero`). Supported with ``fedex`` and ``flora``.
    """

    def __init__(
        self,
        state: AdapterState,
        layers: Mapping[str, LayerInfo],
        *,
        method: str = "fedex",
        num_clients: int = 1,
        fraction: float = 1.0,
        weighting: str | None = None,
        seed: int = 0,
        residual_rank: int | None = None,
        side_rank: int | None = None,
        max_update_norm: float | None = None,
        client_layers: Mapping[int, Mapping[str, LayerInfo]] | None = None,
    ):
        self.state = state.clone()
        self.layers = dict(layers)
        self.method = method
        self.spec = get_method(method)  # an unknown name: a clear error here
        self.num_clients = num_clients
        self.fraction = fraction
        self.weighting = weighting or self.spec.weighting
        self.seed = seed
        self.residual_rank = residual_rank
        self.side_rank = side_rank
        self.max_update_norm = max_update_norm
        self.round = 0
        self.version = 0
        self.history: dict[int, dict[str, Residual]] = {}  # v -> residuals from v to v+1
        self.last_sizes: dict[str, tuple[int, int]] = {}  # latest residual: (bytes, dense)
        self.client_version: dict[int, int] = {}  # base version each client holds
        self.feedback: dict[str, Residual] = {}  # lossy mode: residual kept back
        self.record = DeltaRecord(self.layers)  # everything folded since W0, per layer
        self.client_layers = {int(c): dict(v) for c, v in (client_layers or {}).items()}
        if self.client_layers and not self.spec.hetero_ranks:
            hetero = " or ".join(repr(m) for m in method_names(hetero_ranks=True))
            raise ValueError(f"heterogeneous client ranks need method {hetero}, got {method!r}")
        self.remainder: dict[int, dict[str, Residual]] = {}  # hetero: T_i each client holds
        self.sent: dict[int, AdapterState] = {}  # hetero: the view each client trains from
        self.client_rank: dict[int, int] = {}  # HetLoRA: the rank a client pruned itself to
        self._busy = 0.0  # the server's seconds in the current round, so far
        self.last_round_seconds = 0.0  # the server's own seconds in the latest round

    # -- sampling and payloads -------------------------------------------------------
    def sample(self, rnd: int) -> list[int]:
        """The clients taking part in round ``rnd`` (sorted), seeded by (seed, round)."""
        m = self.sample_size()
        if m >= self.num_clients:
            return list(range(self.num_clients))
        g = torch.Generator().manual_seed(self.seed * 100_003 + rnd)
        return sorted(torch.randperm(self.num_clients, generator=g)[:m].tolist())

    def _uploaded(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients upload A and B in round ``rnd`` (the factors the server updates)."""
        return self.spec.uploaded(rnd)

    def upload_template(self, rnd: int | None = None) -> AdapterState:
        """What a valid upload in round ``rnd`` contains (default: the coming round).

        FFA-LoRA clients send no A; RoLoRA's send only the factor the round trains;
        FedSA-LoRA's send no B and no task head (each keeps its own).
        """
        train_A, train_B = self._uploaded(self.round + 1 if rnd is None else rnd)
        if train_A and train_B:
            return self.state
        return AdapterState(
            factors={
                k: (A if train_A else None, B if train_B else None)
                for k, (A, B) in self.state.factors.items()
            },
            extra=self.state.extra if self.spec.shares_head else {},
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

    @_timed
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
        since = self.client_version.get(client_id)
        residuals = None if since is None else self.catch_up(since)
        if residuals and self.record.nbytes() < _nbytes(residuals):
            residuals = None  # the whole delta is smaller than the catch-up
        reset = residuals is None
        if reset:
            residuals = self.deltas()
            self.remainder.pop(client_id, None)  # heterogeneous ranks: nothing folded
        state = self.state
        if self.spec.sends_uploaded_parts_only(reset):  # it holds the rest (or keeps its own)
            state = self.upload_template(self.round + 1)
        if reset:
            self.client_rank.pop(client_id, None)  # a client that starts over: its full rank
        if client_id in self.client_layers:
            state, residuals = self._hetero_view(client_id, residuals)
        if client_id in self.client_rank:  # HetLoRA: what it pruned stays pruned
            state = cut_rank(state, self.client_rank[client_id])
            if client_id in self.sent:
                self.sent[client_id] = state
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
        )

    def sample_size(self) -> int:
        """Clients per round (:func:`fedexlora.core.sampling.sample_size`, as DP plans)."""
        return sample_size(self.num_clients, self.fraction)

    def expected_absence(self) -> float:
        """Rounds a client waits, on average, between two samplings (1 when all are)."""
        return max(1.0, self.num_clients / self.sample_size())

    @property
    def base_delta(self) -> dict[str, Residual]:
        """The base deltas the server holds itself (:attr:`record`'s ``kept``)."""
        return self.record.kept

    @property
    def delta_source(self) -> Callable[[str], Residual] | None:
        """Reads what the global model holds folded (:class:`DeltaRecord`'s ``source``).

        Set by an engine that folds every outcome into a model it holds: the server then
        keeps no dense copy of it.
        """
        return self.record.source

    @delta_source.setter
    def delta_source(self, source: Callable[[str], Residual] | None) -> None:
        self.record.source = source

    @property
    def outgrown(self) -> set[str]:
        """The layers whose base delta only the model holds."""
        return self.record.outgrown

    def delta(self, name: str) -> Residual | None:
        """Module ``name``'s base delta: everything folded into it since ``W0``, or None."""
        return self.record.get(name)

    def deltas(self) -> dict[str, Residual]:
        """Every nonzero base delta (:meth:`delta`): a reset payload's residuals."""
        return {k: r for k, r in self.record.all().items() if r is not None and not r.is_zero}

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

    def _hetero_view(self, c: int, glob: dict[str, Residual]):
        """Client ``c``'s factors, and its residual: catch-up plus the change of ``T_c``.

        Everything is expressed in the client's own LoRA scale.
        """
        gen = torch.Generator().manual_seed(self.seed * 65_537 + self.round * 101 + c)
        layers_c = self.client_layers[c]
        view, t_new = client_view(
            self.state,
            self.layers,
            layers_c,
            generator=gen,
            slices=self.spec.hetero_slices,
            orthonormal_A=self.spec.hetero_orthonormal_A,
        )
        if self.spec.hetero_drops_tail:  # FlexLoRA, HetLoRA: the truncation, nothing else
            t_new = {}
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

    # -- state for checkpoints -------------------------------------------------------
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

    # -- aggregation -----------------------------------------------------------------
    @_timed
    def aggregate(
        self,
        uploads: Sequence[ClientUpload],
        *,
        generator: torch.Generator | None = None,
        effective: bool = True,
    ) -> RoundOutcome:
        """Validates uploads, aggregates the accepted ones, and advances the round.

        If every upload is rejected (or none arrived), the global state is unchanged and
        the returned residuals are empty.

        Args:
            uploads: The round's client uploads.
            generator: Seeded generator for ``flora``'s fresh A.
            effective: Also compute :attr:`RoundOutcome.effective_deviation` from the
                new factors (``{}`` when off). Both engines measure it on the model
                instead (:func:`fedexlora.bridge.steps.apply_outcome`) and turn it off.
        """
        self.record.check_all()  # the engine has folded the last round into its model
        self.round += 1
        template = self.upload_template(self.round)
        accepted, rejected = [], {}
        for up in uploads:
            expect = self.sent.get(up.client_id, template)
            reason = validate_upload(
                up, expect, max_update_norm=self.max_update_norm, reference=expect
            )
            if reason is None:
                accepted.append(up)
            else:
                rejected[up.client_id] = reason
        if not accepted:
            return RoundOutcome({}, [], rejected, {}, {}, previous=self.state, unchanged=True)
        if self.weighting == "examples":
            weights = [float(example_count(u.num_examples)[0]) for u in accepted]
        else:
            weights = None
        if generator is None:
            generator = self.spec.round_generator(self.seed, self.round)
        if self.spec.prunes_rank:  # HetLoRA: a client's zero tail is the rank it pruned to
            for u in accepted:
                used = used_rank(u.state)
                full = self.client_layers.get(u.client_id, self.layers)
                if used < min(info.rank for info in full.values()):
                    self.client_rank[u.client_id] = used
        states = [self._to_global(u) for u in accepted]
        agg = aggregate_states(
            states,
            weights,
            self.method,
            global_state=self.state,
            generator=generator,
            effective=effective,
        )
        residuals = self._add_remainders(agg.residuals, accepted, agg.weights)
        return self._commit(
            agg.state,
            residuals,
            accepted=[u.client_id for u in accepted],
            rejected=rejected,
            deviation=agg.deviation,
            effective_deviation=agg.effective_deviation,
            weights={u.client_id: float(w) for u, w in zip(accepted, agg.weights)},
        )

    @_timed
    def aggregate_secure(
        self,
        sums: SecureSums | None,
        clients: Sequence[int],
        *,
        rejected: Mapping[int, str] | None = None,
        protocol_seconds: float = 0.0,
    ) -> RoundOutcome:
        """One round from securely summed uploads: the server sees only sums.

        ``sums`` holds the weighted means of the clients' uploads (and, for a method
        with ``secure_products``, of their products ``B_i A_i``), read from the sum of
        their secure vectors (:mod:`fedexlora.core.secure`, :mod:`fedexlora.secagg`).
        A linear method's aggregate of the means equals its aggregate of the uploads;
        FedEx-LoRA's residual is ``sum_i p_i B_i A_i - B̄ Ā``, formed here from the sums.
        The uploads were validated by their clients (the server cannot see them), and
        the outcome has no per-client weights.

        Args:
            sums: The means, or ``None`` when the round could not be summed (the global
                model is unchanged).
            clients: The clients whose vectors are in the sums.
            rejected: Client id -> why it is not in the sums (a dropout).
            protocol_seconds: The server's own seconds in this round's secure aggregation
                protocol (key routing, unmasking, decoding: :attr:`SecureRound.seconds
                <fedexlora.secagg.rounds.SecureRound.seconds>`), counted in the round's
                :attr:`last_round_seconds`.
        """
        from fedexlora.core.secure import secure_refusal

        why = secure_refusal(self.spec)
        if why:
            raise ValueError(why)
        if not (math.isfinite(protocol_seconds) and protocol_seconds >= 0):
            raise ValueError(f"protocol_seconds must be finite and >= 0, got {protocol_seconds!r}")
        self._busy += float(protocol_seconds)
        self.record.check_all()
        self.round += 1
        rejected = dict(rejected or {})
        if sums is None or not clients:
            return RoundOutcome({}, [], rejected, {}, {}, previous=self.state, unchanged=True)
        generator = self.spec.round_generator(self.seed, self.round)
        agg = aggregate_states(
            [sums.state], None, self.method, global_state=self.state, generator=generator,
            effective=False,
        )  # fmt: skip
        residuals = dict(agg.residuals)
        deviation: dict[str, float] = {}
        for name, ideal in sums.products.items():
            A, B = agg.state.factors[name]
            dense = ideal - B.double() @ A.double()
            shape = (int(dense.shape[0]), int(dense.shape[1]))
            out = torch.float64 if A.dtype == torch.float64 else torch.float32
            residuals[name] = Residual(shape=shape, dense=dense.to(out), stored_rank=min(shape))
            den = float(ideal.norm())
            deviation[name] = float(dense.norm()) / den if den > 0 else 0.0
        outcome = self._commit(
            agg.state,
            residuals,
            accepted=sorted(int(c) for c in clients),
            rejected=rejected,
            deviation=deviation,
            effective_deviation={},
            weights={},
        )
        outcome.secure = {
            "clipped": int(sums.clipped),
            "train_loss": sums.loss,
            "num_examples": sums.examples,
        }
        return outcome

    def _commit(
        self,
        state: AdapterState,
        residuals: dict[str, Residual],
        *,
        accepted: list[int],
        rejected: dict[int, str],
        deviation: dict[str, float],
        effective_deviation: dict[str, float],
        weights: dict[int, float],
    ) -> RoundOutcome:
        """Takes the round's new state and residuals (truncated or capped as configured)."""
        feedback_norm = {}
        capped: dict[str, Residual] = {}
        if self.residual_rank is not None:
            residuals, feedback_norm = self._truncate(residuals)
        elif self.side_rank is not None:
            residuals, capped, feedback_norm = self._cap_side(residuals)
        new_state = state
        train_A, train_B = self._uploaded(self.round)
        if self.spec.keeps_global_factors(self.round):
            # keep the frozen global factor bit for bit (latent, Fed-SB: A = I; RoLoRA;
            # FedSA-LoRA's B, which the clients keep)
            new_state = AdapterState(
                factors={
                    k: (
                        A if train_A else self.state.factors[k][0],
                        B if train_B else self.state.factors[k][1],
                    )
                    for k, (A, B) in new_state.factors.items()
                },  # fmt: skip
                extra=new_state.extra if self.spec.shares_head else self.state.extra,
            )
        previous, self.state = self.state, new_state
        nonzero = {k: r for k, r in residuals.items() if not r.is_zero}
        if nonzero:
            self.history[self.version] = nonzero
            self.last_sizes = {k: (r.nbytes, self._dense_nbytes(k, r)) for k, r in nonzero.items()}
            for k, r in nonzero.items():
                if k in capped:  # side_rank: the capped delta itself, not a growing sum
                    self.record.set(k, capped[k])
                else:
                    self.record.add(k, r)
            self.version += 1
            self._prune()
        return RoundOutcome(
            residuals=nonzero,
            accepted=accepted,
            rejected=rejected,
            deviation=deviation,
            effective_deviation=effective_deviation,
            feedback_norm=feedback_norm,
            weights=weights,
            previous=previous,
        )

    def ideal_update(
        self, name: str, uploads: Sequence[ClientUpload], outcome: RoundOutcome
    ) -> torch.Tensor:
        """The ideal update of module ``name`` in this round, dense fp64 ``(d, n)``.

        ``sum_i p_i (T_i + s_i B_i A_i)`` over the accepted uploads, in weight space (the
        LoRA scale applied): the average of the clients' effective models minus the base
        they started from. ``T_i`` is what a client of another rank held folded
        (heterogeneous ranks); FFA-LoRA clients use the frozen global A. Call it after
        :meth:`aggregate` and before the next :meth:`payload_for`.
        """
        by_id = {u.client_id: u for u in uploads}
        Us, Vs, remainders = [], [], []
        for cid, p in outcome.weights.items():
            A, B = by_id[cid].state.factors[name]
            held = self.state if outcome.previous is None else outcome.previous
            if A is None:  # the frozen A the clients trained against (FedSVD's moves on)
                A = held.factors[name][0]
            if B is None:  # RoLoRA's rounds that train A: the frozen, shared B
                B = held.factors[name][1]
            scale = self.client_layers.get(cid, self.layers)[name].scale  # the client's own
            Us.append(B.double() * (p * scale))  # (d, r_i)
            Vs.append(A.double())  # (r_i, n)
            T = self.remainder.get(cid, {}).get(name)
            if T is not None:
                remainders.append(T.scaled(p))
        total = torch.cat(Us, 1) @ torch.cat(Vs, 0)  # one matmul: (d, sum r_i) @ (sum r_i, n)
        for T in remainders:
            total += T.to_dense().double()
        return total

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
