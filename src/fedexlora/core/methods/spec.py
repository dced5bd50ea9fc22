"""What a federated LoRA method is, as the rest of the package needs to know it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.plan import RoundPlan

__all__ = [
    "EXACT_BOUND",
    "FP32_UNIT_ROUNDING",
    "ROUNDING_MARGIN",
    "Aggregate",
    "LocalHooks",
    "LocalModel",
    "MethodSpec",
    "RoundPlan",
]

# The server math of one layer: stacked client factors A (k, r, n) and B (k, d, r) in
# fp64, normalised weights p (k,) -> the new global A (r, n), B (d, r) and the residual
# (d, n) to fold into the base, before the LoRA scale. Keyword arguments: ``out_dtype``
# (the dtype results are returned in), ``generator`` (seeded randomness), ``atol``, and
# for a method that ``restarts``, ``start``: the global (A, B) the clients started from.
Aggregate = Callable[..., tuple[torch.Tensor, torch.Tensor, Residual]]


class LocalModel(Protocol):
    """What a method's :attr:`MethodSpec.local_round` may do to a client's model.

    The peft bridge gives it (:class:`fedexlora.bridge.adapters.LoraHandle`); this layer
    never imports peft. It cannot freeze or unfreeze a factor: what a client trains is
    the method's round plan (:meth:`MethodSpec.plan`), which the client step applies
    after the hook is set up.
    """

    def factors(self) -> Any:
        """The adapter's factors now (a :class:`fedexlora.core.state.AdapterState`)."""

    def load(self, state: Any) -> None:
        """Loads factors into the adapter (an ``AdapterState``)."""

    def tail_norm(self, start: int, stop: int) -> torch.Tensor:
        """``Σ_layers ||B[:, start:stop]||_F ||A[start:stop]||_F``, differentiable."""


@dataclass
class LocalHooks:
    """What a method adds to one client's local round (:attr:`MethodSpec.local_round`).

    Attributes:
        penalty: A term added to the local loss at every step (``None``: none).
        after: Called once training is done, before the upload is read (``None``: none).
    """

    penalty: Callable[[], torch.Tensor] | None = None
    after: Callable[[], None] | None = None


EXACT_BOUND = 1e-3
"""How far from the ideal an exact method's model may be, relative to the round's update.

Float rounding is all an exact method may add (:attr:`MethodSpec.exact`). With the
residuals beside the weights (a side branch) it is about 1e-7 of the update. Folded into
fp32 weights it is 6e-8 of a weight, so its share of the update grows as the update
shrinks: measured 4e-6, 4e-5 and 2e-4 on a tiny BERT at learning rates 1e-3, 1e-4 and
1e-5 (one local step), 1.3e-5 on the main job (MiniLM, the default 1e-3). An aggregation
that is not exact loses far more (FedIT's averaged factors: 1e-2 and up). Folded fp32
rounding reaches 1e-3 only when a round moves the weights by under about 6e-5 of
themselves (6e-8 / 1e-3); so over the bound a run checks the method's math
(:meth:`MethodSpec.math_deviation`) before it blames rounding.
"""
FP32_UNIT_ROUNDING = 2.0**-24
"""fp32's unit roundoff: one rounding of a weight ``w`` is off by at most ``2^-24 |w|``."""
ROUNDING_MARGIN = 10.0
"""How many times fp32's unit rounding of the weights (relative to the round's update) a
model folded into fp32 weights may be off before the gap is not rounding: one fold rounds
each weight once (at most the unit rounding, about 0.6 of it in the norm), the adapter's
own product once more; 10 leaves room and still catches any departure of a method."""


@dataclass(frozen=True)
class MethodSpec:
    """One method: what clients train and keep, what travels, and how the server aggregates.

    In what follows a round's accepted clients ``i`` upload factors ``A_i``, ``B_i`` of each
    LoRA layer (a factor a client does not upload is the global one it started from),
    ``p_i`` are the server's normalised weights (``weighting``: examples, or uniform) and
    ``s`` is the layer's LoRA scale. The *ideal* update of a layer is ``sum_i p_i B_i A_i``
    and the ideal global model the weighted average of the clients' own models,
    ``W' = W - s B A + sum_i p_i (T_i + s B_i A_i)``, where ``W`` is the global effective
    weight (base, folded residuals or side branch, adapter ``s B A``) the round started
    from and ``T_i`` what a lower-rank client holds folded beyond its rank (0 at one rank).

    Attributes:
        name: The name users give (``--method``, ``aggregate(method=...)``): lower-case
            letters, digits and ``_``, unique in the registry.
        title: The method's usual name, e.g. ``FedEx-LoRA`` (tables, messages).
        paper: The paper it follows (authors, venue, arXiv id).
        trains: What each client trains (``fedexlora methods``; documentation only).
        keeps_local: What a client keeps and never sends (documentation only).
        uploads: What a client sends the server each round (documentation only; what
            really travels is the round plan's, :meth:`plan`).
        downloads: What the server sends a client each round (documentation only).
        exact: A promise on the server math and on every run of the method. The math:
            :attr:`aggregate`'s new global factors and residual satisfy
            ``B A + R = sum_i p_i B_i A_i`` for every layer (in the method's own
            coordinates: latent ones for ``latent``), which :meth:`math_deviation`
            measures. The run: after every round the global model's effective weight is
            the ideal ``W'`` above, up to float rounding. Both engines measure it on the
            model each round (``effective_deviation``, relative to the round's update
            ``W' - W``). Over :data:`EXACT_BOUND` the run fails
            (:class:`fedexlora.run.layout.RunError`) if the math is not exact, or if the
            residuals live beside the weights (a side branch, where rounding is about
            1e-7), or if, folded into fp32 weights, it is also over
            :data:`ROUNDING_MARGIN` times the row's ``rounding_floor`` (fp32's unit
            rounding of the weights relative to the update); within it the figure is fp32's
            rounding of a small update, which ``summary.md`` gives. Lossy modes
            (``residual_rank``, ``side_rank``) lift the promise. ``False``: the model
            departs from the ideal by design (FedIT's averaged factors, FlexLoRA's
            truncation); the run reports how far, and never fails for it.
        linear: The server math of the weighted means is the server math of the
            uploads: ``aggregate([sum_i p_i A_i], [sum_i p_i B_i], [1])`` returns the
            same global factors and residual as ``aggregate(A, B, p)`` (over the
            factors clients upload; ``tests/core/methods/test_registry.py`` checks it). Secure
            aggregation, which shows the server only sums, can then run it. It says
            nothing of exactness: FedIT is linear and inexact, FedEx-LoRA exact and not
            linear.
        secure_products: Under secure aggregation each client also sends its weighted
            product ``w_i B_i A_i`` per layer (as two sketches of it where they are
            smaller, :mod:`fedexlora.core.sketch`), so that the server forms
            ``sum_i p_i B_i A_i`` from sums alone (FedEx-LoRA). A method that is neither
            ``linear`` nor this cannot run under secure aggregation. Excludes ``linear``.
        dora: Aggregates DoRA layers (``use_dora=True``) exactly: clients upload each
            layer's row scale ``D_i`` as an extra, and the residual becomes
            ``sum_i (p_i D_i / Dbar) B_i A_i - Bbar Abar`` (:mod:`fedexlora.core.dora`).
            Other methods refuse DoRA models.
        bytes_per_round: Bytes sent in one round as a formula of ``d`` and ``n`` (a layer's
            output and input sizes), ``r`` (the rank) and ``k`` (clients), fp32 numbers
            (``fedexlora methods``; the run counts the tensors really sent).
        aggregate: The server math (:data:`Aggregate`); ``None`` for a method without one.
        federated: ``False`` for the pooled, one-party reference (``centralized``).
        server_method: The method whose server math runs it, when not its own.
        frozen_A: A is shared, frozen and never uploaded (clients train B, or a core).
        refactors_A: With ``frozen_A``: the server re-factors the update every round and
            sends the new shared A with B (FedSVD); otherwise A is sent once.
        alternating: Odd rounds train B (A frozen), even rounds A (B frozen); clients
            upload only the factor they trained (RoLoRA).
        latent: Clients train an ``r x r`` core between frozen A and B (Fed-SB); the
            server sees it in latent coordinates (``A = I``, ``B = R``). Needs
            ``frozen_A``.
        keeps: The parts of the adapter each client keeps for itself, of ``"A"``, ``"B"``
            and ``"head"`` (the task head and other trainable extras): it trains them,
            never uploads them, and is never sent the global ones (after its first round;
            FedSA-LoRA keeps B and the head). The engines honour it generically: they
            keep each client's parts between its rounds, and since there is then no one
            global model (:attr:`personalized`), evaluate each client's own model on its
            own test split and report no deviation.
        hetero_ranks: Clients may train adapters of different ranks (``client_ranks``).
        hetero_drops_tail: A client of a lower rank gets the truncation of the global
            adapter and nothing else (FlexLoRA); otherwise what the truncation leaves out
            is folded into that client's base, so it holds the global model exactly.
        restarts: Every round the global adapter returns to the factors the clients
            started it from, and what the round's aggregate adds is folded into the base
            (FRLoRA); the server math gets those factors as ``start=(A0, B0)``.
        lora_init: peft's ``init_lora_weights`` for the adapter (``"pissa"``: A and B
            from the principal singular vectors of the pretrained weight, which keeps
            the rest as its base); ``None`` is peft's default.
        hetero_slices: A client of a lower rank gets the first ``r_i`` rows of A and
            columns of B (HetLoRA), not the leading SVD components.
        hetero_orthonormal_A: A client of a lower rank gets the leading SVD components
            of ``s_g B̄ Ā = U Σ Vᵀ`` as FlexLoRA's release gives them: ``A = V_rᵀ``
            (orthonormal rows), ``B = U_r Σ_r / s_i``; otherwise each factor carries
            ``sqrt(Σ_r / s_i)``.
        prunes_rank: Clients prune their own rank (HetLoRA): they regularize the tail of
            their adapter, cut it when its norm shrinks, and the server keeps sending them
            the cut rank (zeros beyond it).
        round_plan: What clients train, upload and keep in a round, given the round
            (:class:`~fedexlora.core.methods.plan.RoundPlan`), for a method whose
            rounds the flags above do not describe. ``None``: the plan follows
            ``frozen_A``, ``refactors_A``, ``alternating`` and ``keeps``
            (:meth:`plan`). It replaces those factor flags (a method gives one or the
            other), and its kept parts must be ``keeps``.
        local_round: What the method does to a client's model in a round beyond plain
            training, given the model (:class:`LocalModel`) and the round: add a loss
            term and cut the rank after (HetLoRA). It cannot change what trains (the
            round plan's, applied after it). ``None``: plain training. Every engine's
            client step calls it (:meth:`local_hooks`).
        prepare_model: What the method installs into a freshly loaded model beyond its
            LoRA adapter, given the model's setup (:class:`fedexlora.run.build.ModelSetup`:
            the run's configuration, and what the peft bridge can install): Fed-SB's
            frozen A and B around its core. ``None``: nothing. Every engine's model is
            built through it (:meth:`prepare`).
        residual_rank: The residual may be truncated to a rank with error feedback.
        fresh_adapter: The global adapter restarts every round (a seeded fresh A, B = 0).
        flower: Runs under the Flower engine.
        effective_is_deviation: The update applied is the averaged factors' product, so
            its deviation from the ideal is the factor-averaging deviation itself (the
            server reports that figure instead of computing it again).
        weighting: How the server weights the clients' uploads when the run does not say
            (``--weighting``): ``examples`` (each client's local dataset size) or
            ``uniform`` (FedSA-LoRA, whose release weights by the samples a client
            processes in the round: the same for every client at a fixed step count).
        check: The method's own validation of a run's configuration: given the
            :class:`fedexlora.config.RunConfig` (read by its field names: this layer does
            not import the configuration), each problem as one message that names the
            setting and the fix. ``RunConfig.errors()`` asks it of every method of the
            run; ``None``: the method adds no check of its own.
        baseline: The inexact method this one is measured against in reports.
        claims: Published claims a private comparison checks: ``(other method, text)``
            read as "this method ahead of the other".
    """

    name: str
    title: str
    paper: str
    trains: str
    keeps_local: str
    uploads: str
    downloads: str
    exact: bool
    linear: bool
    bytes_per_round: str
    aggregate: Aggregate | None = None
    federated: bool = True
    server_method: str | None = None
    frozen_A: bool = False
    refactors_A: bool = False
    alternating: bool = False
    keeps: tuple[str, ...] = ()
    latent: bool = False
    hetero_ranks: bool = False
    hetero_drops_tail: bool = False
    hetero_slices: bool = False
    hetero_orthonormal_A: bool = False
    prunes_rank: bool = False
    round_plan: Callable[[int], RoundPlan] | None = None
    local_round: Callable[[LocalModel, int], LocalHooks] | None = None
    prepare_model: Callable[[Any], None] | None = None
    residual_rank: bool = False
    fresh_adapter: bool = False
    restarts: bool = False
    secure_products: bool = False
    dora: bool = False
    lora_init: str | None = None
    flower: bool = True
    effective_is_deviation: bool = False
    weighting: str = "examples"
    check: Callable[[Any], list[str]] | None = None
    baseline: str | None = None
    claims: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"`name` must be lower-case letters, digits or _, got {self.name!r}")
        if self.federated and self.aggregate is None and self.server_method is None:
            raise ValueError(f"method {self.name!r}: a federated method needs `aggregate`")
        if self.latent and not self.frozen_A:
            raise ValueError(f"method {self.name!r}: a latent method keeps A frozen")
        if self.alternating and (self.frozen_A or self.hetero_ranks):
            raise ValueError(f"method {self.name!r}: `alternating` freezes A or B by round")
        if self.refactors_A and not self.frozen_A:
            raise ValueError(f"method {self.name!r}: `refactors_A` needs `frozen_A`")
        if not set(self.keeps) <= {"A", "B", "head"}:
            raise ValueError(
                f"method {self.name!r}: `keeps` takes 'A', 'B' and 'head', got {self.keeps!r}"
            )
        if set(self.keeps) >= {"A", "B"}:
            raise ValueError(f"method {self.name!r}: a client that keeps A and B shares nothing")
        if self.keeps and (self.frozen_A or self.alternating or self.hetero_ranks):
            raise ValueError(f"method {self.name!r}: `keeps` trains A and B at one rank")
        if (self.hetero_slices or self.prunes_rank) and not self.hetero_ranks:
            raise ValueError(f"method {self.name!r}: rank slicing and pruning need `hetero_ranks`")
        if self.secure_products and self.linear:
            raise ValueError(f"method {self.name!r}: a linear method needs no products")
        if self.hetero_drops_tail and not self.hetero_ranks:
            raise ValueError(f"method {self.name!r}: `hetero_drops_tail` needs `hetero_ranks`")
        if self.hetero_orthonormal_A and (self.hetero_slices or not self.hetero_ranks):
            raise ValueError(
                f"method {self.name!r}: `hetero_orthonormal_A` needs `hetero_ranks`, "
                "without `hetero_slices`"
            )
        if self.round_plan is not None and (self.frozen_A or self.alternating or self.latent):
            raise ValueError(
                f"method {self.name!r}: `round_plan` says what trains and travels each "
                "round; give it or `frozen_A`/`alternating`/`latent`, not both"
            )
        if self.server_method is not None and (
            self.round_plan is not None or self.frozen_A or self.alternating or self.keeps
        ):
            raise ValueError(
                f"method {self.name!r}: a method run on {self.server_method!r}'s server "
                "follows that method's round plan; give it its own `aggregate` to train, "
                "upload or keep other parts"
            )
        if self.weighting not in ("examples", "uniform"):
            raise ValueError(
                f"method {self.name!r}: `weighting` must be 'examples' or 'uniform', "
                f"got {self.weighting!r}"
            )

    def plan(self, rnd: int) -> RoundPlan:
        """Round ``rnd``'s plan: what clients train, upload and keep, what they are sent.

        The one source every engine's client step, the server and ``bench comm`` read.
        :attr:`round_plan`'s when the method gives one; otherwise from the flags: a
        ``frozen_A`` method trains and uploads B alone (and, unless it ``refactors_A``,
        sends A once); an ``alternating`` one B in odd rounds and A in even ones; the
        parts in ``keeps`` are trained and kept, never uploaded. The task head and other
        extras train every round.

        Raises:
            ValueError: If :attr:`round_plan`'s plan keeps other parts than ``keeps``.
        """
        if self.round_plan is not None:
            plan = self.round_plan(rnd)
            kept = {"A": plan.keep_A, "B": plan.keep_B, "head": plan.keep_extra}
            if {part for part, k in kept.items() if k} != set(self.keeps):
                raise ValueError(
                    f"method {self.name!r}: its round plan keeps "
                    f"{sorted(p for p, k in kept.items() if k)} in round {rnd}, but "
                    f"`keeps` is {sorted(self.keeps)}"
                )
            return plan
        if self.alternating:
            train_A, train_B = rnd % 2 == 0, rnd % 2 == 1
        else:
            train_A, train_B = not self.frozen_A, True
        keep_A, keep_B, keep_extra = ("A" in self.keeps, "B" in self.keeps, "head" in self.keeps)
        return RoundPlan(
            train_A=train_A,
            train_B=train_B,
            upload_A=train_A and not keep_A,
            upload_B=train_B and not keep_B,
            upload_extra=not keep_extra,
            keep_A=keep_A,
            keep_B=keep_B,
            keep_extra=keep_extra,
            refactors=self.refactors_A,
            sends_uploaded_only=(self.frozen_A and not self.refactors_A) or bool(self.keeps),
        )

    def trained(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients train A and B in round ``rnd`` (:meth:`plan`'s)."""
        return self.plan(rnd).trained

    def uploaded(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients upload A and B in round ``rnd`` (:meth:`plan`'s)."""
        return self.plan(rnd).uploaded

    @property
    def personalized(self) -> bool:
        """Whether clients keep parts of their own (:attr:`keeps`): no one global model."""
        return bool(self.keeps)

    @property
    def shares_head(self) -> bool:
        """Whether the task head (and other trainable extras) travels and is averaged.

        In every round: a method keeps the same parts every round (:meth:`plan`).
        """
        return self.plan(1).upload_extra

    def kept_parts(self) -> dict[str, bool]:
        """What a client keeps, as :func:`fedexlora.bridge.adapters.get_state` reads it.

        The same in every round (:meth:`plan` checks a method's own plan against
        :attr:`keeps`).
        """
        return self.plan(1).kept

    def sends_uploaded_parts_only(self, reset: bool, rnd: int = 1) -> bool:
        """Whether a client that holds the current base is sent only what clients upload.

        In round ``rnd`` (:attr:`RoundPlan.sends_uploaded_only`): it already holds the
        rest, a frozen A sent once (not re-factored every round), or the parts it keeps
        for itself. A client that starts over (``reset``) gets all.
        """
        return not reset and self.plan(rnd).sends_uploaded_only

    def round_generator(self, seed: int, rnd: int) -> torch.Generator | None:
        """The seeded randomness the server math needs in round ``rnd``, or ``None``.

        A method whose adapter restarts every round (``fresh_adapter``, FLoRA) draws the
        new A from the run's seed and the round, so every engine draws the same one.
        """
        if not self.fresh_adapter:
            return None
        return torch.Generator().manual_seed(seed * 7919 + rnd)

    def adapter_setup(self, rank: int, alpha: float, latent_rank: int) -> dict:
        """How a run loads this method's adapter (rank, alpha, a frozen A, peft's init).

        A latent method (Fed-SB) trains an ``r x r`` core at its own rank, ``alpha = r``;
        its frozen factors are set by its own install, not by freezing A here.
        """
        if self.latent:
            return {"r": latent_rank, "alpha": float(latent_rank), "freeze_A": False,
                    "init": self.lora_init}  # fmt: skip
        return {"r": rank, "alpha": alpha, "freeze_A": self.frozen_A, "init": self.lora_init}

    def keeps_global_factors(self, rnd: int) -> bool:
        """Whether the server keeps, bit for bit, the factors round ``rnd`` did not upload.

        :attr:`RoundPlan.keeps_global_factors`: a frozen A, Fed-SB's ``A = I``, RoLoRA's
        other factor, a B the clients keep; not when it re-factors both every round
        (FedSVD).
        """
        return self.plan(rnd).keeps_global_factors

    def server_math(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        p: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        generator: torch.Generator | None = None,
        atol: float = 1e-6,
        start: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Residual]:
        """:attr:`aggregate` on one layer's stacked fp64 factors, with what it needs.

        A method that ``restarts`` gets ``start``, the global ``(A, B)`` the clients
        started the round from (in ``A``'s dtype and device); the others never see it.

        Raises:
            ValueError: A method that restarts, called without ``start``.
        """
        assert self.aggregate is not None, f"method {self.name!r} has no server math"
        kw = {}
        if self.restarts:
            if start is None:
                raise ValueError(
                    f"method {self.name!r} needs `start`: the global (A, B) the clients "
                    "started the round from (it returns to them every round)"
                )
            kw["start"] = tuple(t.to(device=A.device, dtype=A.dtype) for t in start)
        return self.aggregate(A, B, p, out_dtype=out_dtype, generator=generator, atol=atol, **kw)

    def effective_deviation(self, factor_deviation: float, measure: Callable[[], float]) -> float:
        """The deviation of the update this method applies from the ideal, of one layer.

        For a method that applies the averaged factors' product
        (``effective_is_deviation``), the factor-averaging deviation it was given;
        otherwise ``measure()``.
        """
        return factor_deviation if self.effective_is_deviation else measure()

    def local_hooks(self, model: LocalModel, rnd: int) -> LocalHooks:
        """What this method adds to a client's local round ``rnd`` (:attr:`local_round`)."""
        return LocalHooks() if self.local_round is None else self.local_round(model, rnd)

    def prepare(self, setup: Any) -> None:
        """Installs what the method needs in a freshly loaded model (:attr:`prepare_model`)."""
        if self.prepare_model is not None:
            self.prepare_model(setup)

    @property
    def keeps_residual(self) -> bool:
        """Whether anything is kept beside the averaged factors' product.

        A residual, or the error a lossy mode holds back: what a side branch or its budget
        would bound. Not for a method whose applied update is that product itself (FedIT).
        """
        return not self.effective_is_deviation

    @property
    def shards_under_fsdp(self) -> bool:
        """Whether a client of this method can train sharded (``--distributed fsdp``).

        FSDP shards what is trainable once, when the worker group loads the model: a
        method that trains a latent core (Fed-SB) or other factors by round (RoLoRA's
        alternation, period 2) cannot.
        """
        return not self.latent and self.trained(1) == self.trained(2)

    @property
    def folds_into_model(self) -> bool:
        """Whether each outcome is folded into one global model in the model's coordinates.

        Not in latent coordinates, nor without a global model. Where it is, the server
        may read its base delta from that model instead of keeping a copy.
        """
        return not (self.latent or self.personalized)

    def synthetic_factors(
        self, d: int, n: int, rank: int, latent_rank: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random global ``(A, B)`` of one ``(d, n)`` layer in the server's coordinates.

        For benchmarks that drive a server without a model: a latent method's are
        ``(I, R)`` at its own rank.

        Raises:
            ValueError: If a latent method's rank exceeds the layer's smaller side, as a
                run refuses it (:mod:`fedexlora.bridge.latent`).
        """
        if self.latent:
            if latent_rank > min(d, n):
                raise ValueError(
                    f"`--fedsb-rank` {latent_rank} exceeds a {d} x {n} layer's smaller side; "
                    f"use --fedsb-rank {min(d, n)} or less"
                )
            return torch.eye(latent_rank), torch.randn(
                latent_rank, latent_rank, generator=generator
            )
        A = torch.randn(rank, n, generator=generator) / n**0.5
        B = torch.randn(d, rank, generator=generator) / d**0.5
        return A, B

    def used_ranks(self, states: dict[int, Any]) -> dict[int, int]:
        """Client -> the rank its upload uses, for a method whose clients prune their rank.

        ``states`` maps each accepted client to its upload's ``AdapterState``; a client
        that cut its tail uploads zeros beyond the rank it kept. Empty for the others.
        """
        if not self.prunes_rank:
            return {}
        from fedexlora.core.factors import used_rank

        return {c: used_rank(st) for c, st in states.items()}

    @property
    def hetero_cut(self) -> dict[str, bool]:
        """How a client of a lower rank gets the global adapter.

        As :func:`fedexlora.core.hetero.client_view` takes it: slices (``hetero_slices``)
        or the leading SVD components (orthonormal A for ``hetero_orthonormal_A``), and
        whether what the cut leaves out is dropped (``hetero_drops_tail``) or folded into
        the client's base.
        """
        return {
            "slices": self.hetero_slices,
            "orthonormal_A": self.hetero_orthonormal_A,
            "drop_tail": self.hetero_drops_tail,
        }

    @property
    def server(self) -> str:
        """The name of the method whose server math runs this one."""
        return self.server_method or self.name

    def math_deviation(self, seed: int = 0) -> float:
        """How far :attr:`aggregate` is from the ideal on random factors, relative to it.

        Three clients of unequal weights (1, 2, 4) with random factors shaped as this
        method's clients train them (a shared A for ``frozen_A`` and ``alternating``, an
        ``r x r`` core for ``latent``, the previous global factors for ``restarts``); in
        fp64, so float rounding is about 1e-15. Returns
        ``||B A + R - sum_i p_i B_i A_i|| / ||sum_i p_i B_i A_i||``: at most 1e-12 for an
        exact method's math.

        Raises:
            ValueError: If the method has no server math of its own (:attr:`server`'s).
        """
        if self.aggregate is None:
            raise ValueError(f"method {self.name!r} runs on {self.server!r}'s server math")
        g = torch.Generator().manual_seed(seed)
        k, d, r, n = 3, 7, 2, 5
        f64 = torch.float64
        if self.latent:
            A = torch.eye(r, dtype=f64).expand(k, r, r)
            B = torch.randn(k, r, r, generator=g, dtype=f64)
        else:
            A = torch.randn(k, r, n, generator=g, dtype=f64)
            if self.frozen_A or self.alternating:
                A = A[:1].expand(k, r, n)
            B = torch.randn(k, d, r, generator=g, dtype=f64)
        p = torch.tensor([1.0, 2.0, 4.0], dtype=f64) / 7
        kw = {"start": (A[0] * 0.5, B[0] * 0.5)} if self.restarts else {}
        A_new, B_new, residual = self.aggregate(
            A.contiguous(), B.contiguous(), p, out_dtype=f64, generator=g, **kw
        )
        ideal = torch.einsum("k,kdr,krn->dn", p, B, A)
        got = B_new.to(f64) @ A_new.to(f64) + residual.to_dense().to(f64)
        return float(torch.linalg.norm(got - ideal) / torch.linalg.norm(ideal))
