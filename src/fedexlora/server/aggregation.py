"""One round on the server: uploads validated and aggregated, the outcome committed.

:class:`Aggregation` is the part of :class:`~fedexlora.server.Server` that ends a round:
:meth:`~Aggregation.aggregate` checks each upload against what its client was sent,
weights the accepted ones and runs the method's server math; the secure variant
(:meth:`~Aggregation.aggregate_secure`) starts from sums it cannot take apart. Both hand
the new global state and residuals to :meth:`~Aggregation._commit`, which applies the
lossy modes (:mod:`fedexlora.server.lossy`), keeps frozen factors bit for bit, extends
the residual history and the base delta, and advances the base version.
:meth:`~Aggregation.ideal_update` is the update the clients' own models average to, which
engines measure the model against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from fedexlora.core.aggregation import Residual
from fedexlora.core.dora import dora_key, dora_modules, dora_residual
from fedexlora.core.messages import ClientUpload, RoundOutcome, example_count, validate_upload
from fedexlora.core.secure import SecureSums
from fedexlora.core.state import AdapterState, aggregate_states
from fedexlora.server.timing import timed

__all__ = ["Aggregation"]


class Aggregation:
    """Validation, aggregation (clear or secure) and commit of :class:`~fedexlora.server.Server`."""

    @timed
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
        seen = set()
        awaiting, self.awaiting = self.awaiting, set()
        for up in uploads:
            if up.client_id in seen:  # one upload a client a round: the first one counts
                rejected.setdefault(up.client_id, "a second upload from this client this round")
                continue
            seen.add(up.client_id)
            if up.client_id not in awaiting:  # unknown, not sampled, or last round's again
                rejected[up.client_id] = (
                    "this client was not sent this round's payload (Server.payload_for), "
                    "so its upload is not from this round's global model"
                )
                continue
            expect = self.sent.get(up.client_id, template)
            reason = validate_upload(
                up, expect, max_update_norm=self.max_update_norm, reference=expect,
                scales={n: info.scale for n, info in self.layers.items()},
            )  # fmt: skip
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
        self._note_pruned_ranks(accepted)  # HetLoRA: the rank a client pruned its own to
        states = [self._to_global(u) for u in accepted]
        agg = aggregate_states(
            states,
            weights,
            self.method,
            global_state=self.state,
            generator=generator,
            effective=effective,
        )
        residuals = self._add_remainders(
            _dora_residuals(agg.residuals, states, agg.weights), accepted, agg.weights
        )
        return self._commit(
            agg.state,
            residuals,
            accepted=[u.client_id for u in accepted],
            rejected=rejected,
            deviation=agg.deviation,
            effective_deviation=agg.effective_deviation,
            weights={u.client_id: float(w) for u, w in zip(accepted, agg.weights)},
        )

    @timed
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
        FedEx-LoRA's residual is ``sum_i p_i B_i A_i - B̄ Ā``, formed here from the sums
        (rebuilt from the layer's sketches, :mod:`fedexlora.core.sketch`, or from its
        dense product) and kept factored at rank ``(k - 1) r`` for the ``k`` clients in
        the sum, as the clear path keeps it: the download is the clear run's.
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
        dora = dora_modules(self.state.extra)
        if dora:
            raise ValueError(
                f"module {dora[0]!r} uses DoRA (use_dora=True), which secure aggregation "
                "cannot aggregate exactly (the residual needs each client's row scale); "
                "run without secure aggregation or set use_dora=False"
            )
        if not (math.isfinite(protocol_seconds) and protocol_seconds >= 0):
            raise ValueError(f"protocol_seconds must be finite and >= 0, got {protocol_seconds!r}")
        self._busy += float(protocol_seconds)
        self.record.check_all()
        self.round += 1
        self.awaiting = set()
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
        q = (len(clients) - 1) * self._secure_rank()  # the clear path's rank bound
        for name in [*sums.products, *sums.sketches]:
            A, B = agg.state.factors[name]
            out = torch.float64 if A.dtype == torch.float64 else torch.float32
            residuals[name], deviation[name] = _secure_residual(sums, name, A, B, q, out)
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

    def _secure_rank(self) -> int:
        """The LoRA rank of the global factors (one rank: secure runs refuse client ranks)."""
        ranks = {int(A.shape[0]) for A, _ in self.state.factors.values() if A is not None}
        if len(ranks) > 1:
            raise ValueError(f"secure aggregation needs one LoRA rank, got {sorted(ranks)}")
        return ranks.pop() if ranks else 0

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
        plan = self.spec.plan(self.round)
        train_A, train_B = plan.uploaded
        if plan.keeps_global_factors:
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
                extra=new_state.extra if plan.upload_extra else self.state.extra,
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


def _secure_residual(
    sums: SecureSums, name: str, A: torch.Tensor, B: torch.Tensor, q: int, out: torch.dtype
) -> tuple[Residual, float]:
    """Layer ``name``'s residual from the sums, and FedEx's deviation ``||R|| / ||B̄ Ā + R||``.

    Factored at rank ``q`` (the clear path's), or dense where that is smaller.
    """
    from fedexlora.core.sketch import residual_from_dense

    d, n = int(B.shape[0]), int(A.shape[1])
    dense_smaller = name not in sums.sketches and q * (d + n) >= d * n
    if name in sums.means and not dense_smaller:
        # factored: against the fp64 means, the residual has rank <= q exactly (against the
        # fp32 state's, fp32's rounding would add 2 r directions the cut to q drops)
        A, B = sums.means[name]
    if name in sums.sketches:
        U, V = sums.sketches[name].residual(A, B, q)  # (d, q), (q, n), fp64
    elif dense_smaller:  # the clear path's rule; against the state's means, exactly
        ideal = sums.products[name]
        dense = ideal - B.double() @ A.double()
        den = float(ideal.norm())
        dev = float(dense.norm()) / den if den > 0 else 0.0
        return Residual(shape=(d, n), dense=dense.to(out), stored_rank=min(d, n)), dev
    else:
        U, V = residual_from_dense(sums.products[name], A, B, q)
    num = _fro2(U, V)
    Bd, Ad = B.double(), A.double()
    den = (
        float(torch.sum((Bd.T @ Bd) * (Ad @ Ad.T)))
        + 2 * float(torch.sum((Bd.T @ U) * (Ad @ V.T)))
        + num
    )  # ||B̄ Ā + U V||^2 from r- and q-wide products
    dev = math.sqrt(num / den) if den > 0 else 0.0
    if U.shape[1] == 0:
        return Residual.zero(d, n, dtype=out), dev
    return Residual((d, n), U=U.to(out).contiguous(), V=V.to(out).contiguous(), ordered=True), dev


def _fro2(U: torch.Tensor, V: torch.Tensor) -> float:
    """``||U V||_F^2`` from the ``(q, q)`` Gram matrices."""
    return float(torch.sum((U.T @ U) * (V @ V.T)).clamp_min(0))


def _dora_residuals(residuals: dict[str, Residual], states, weights) -> dict[str, Residual]:
    """The DoRA layers' residuals in place of FedEx's (:func:`fedexlora.core.dora.dora_residual`).

    A DoRA layer is one whose row scale the clients upload among their extras; only a
    method whose spec says ``dora`` gets here with one (the server's constructor).
    """
    out = dict(residuals)
    for name in dora_modules(states[0].extra):
        key = dora_key(name)
        R = dora_residual(
            [s.extra[key] for s in states],
            [s.factors[name][0] for s in states],
            [s.factors[name][1] for s in states],
            weights,
            module=name,
        )
        out[name] = R.to(torch.float32)  # as FedEx's own residuals
    return out
