"""What a federated LoRA method is, as the rest of the package needs to know it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedexlora.core.factors import Residual

__all__ = ["Aggregate", "MethodSpec"]

# The server math of one layer: stacked client factors A (k, r, n) and B (k, d, r) in
# fp64, normalised weights p (k,) -> the new global A (r, n), B (d, r) and the residual
# (d, n) to fold into the base, before the LoRA scale. Keyword arguments: ``out_dtype``
# (the dtype results are returned in), ``generator`` (seeded randomness), ``atol``, and
# for a method that ``restarts``, ``start``: the global (A, B) the clients started from.
Aggregate = Callable[..., tuple[torch.Tensor, torch.Tensor, Residual]]


@dataclass(frozen=True)
class MethodSpec:
    """One method: what clients train and keep, what travels, and how the server aggregates.

    Attributes:
        name: The name users give (``--method``, ``aggregate(method=...)``).
        title: The method's usual name, e.g. ``FedEx-LoRA``.
        paper: The paper it follows (authors, venue, arXiv id).
        trains: What each client trains.
        keeps_local: What a client keeps and never sends.
        uploads: What a client sends the server each round.
        downloads: What the server sends a client each round.
        exact: Whether the global model equals the ideal average of the client updates.
        linear: Whether the aggregation is a weighted sum of the clients' uploads (secure
            aggregation can then compute it from sums alone).
        secure_products: Under secure aggregation each client also sends its weighted
            product ``w_i B_i A_i`` per layer, so that the server forms ``sum_i p_i B_i A_i``
            from sums alone (FedEx-LoRA). A method that is neither ``linear`` nor this
            cannot run under secure aggregation.
        bytes_per_round: Bytes sent in one round as a formula of ``d`` and ``n`` (a layer's
            output and input sizes), ``r`` (the rank) and ``k`` (clients), fp32 numbers.
        aggregate: The server math (:data:`Aggregate`); ``None`` for a method without one.
        federated: ``False`` for the pooled, one-party reference (``centralized``).
        server_method: The method whose server math runs it, when not its own.
        frozen_A: A is shared, frozen and never uploaded (clients train B, or a core).
        refactors_A: With ``frozen_A``: the server re-factors the update every round and
            sends the new shared A with B (FedSVD); otherwise A is sent once.
        alternating: Odd rounds train B (A frozen), even rounds A (B frozen); clients
            upload only the factor they trained (RoLoRA).
        latent: Clients train an ``r x r`` core between frozen A and B (Fed-SB); the
            server sees it in latent coordinates (``A = I``, ``B = R``).
        personal_B: Each client keeps its own B: it trains A and B but uploads only A,
            and receives only the global A (FedSA-LoRA). There is no global model: the
            run evaluates each client's own (global A, its B), and reports no deviation.
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
        prunes_rank: Clients prune their own rank (HetLoRA): they regularize the tail of
            their adapter, cut it when its norm shrinks, and the server keeps sending them
            the cut rank (zeros beyond it).
        residual_rank: The residual may be truncated to a rank with error feedback.
        fresh_adapter: The global adapter restarts every round (a seeded fresh A, B = 0).
        flower: Runs under the Flower engine.
        effective_is_deviation: The update applied is the averaged factors' product, so
            its deviation from the ideal is the factor-averaging deviation itself.
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
    personal_B: bool = False
    latent: bool = False
    hetero_ranks: bool = False
    hetero_drops_tail: bool = False
    hetero_slices: bool = False
    prunes_rank: bool = False
    residual_rank: bool = False
    fresh_adapter: bool = False
    restarts: bool = False
    secure_products: bool = False
    lora_init: str | None = None
    flower: bool = True
    effective_is_deviation: bool = False
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
        if self.personal_B and (self.frozen_A or self.alternating or self.hetero_ranks):
            raise ValueError(f"method {self.name!r}: `personal_B` trains A and B at one rank")
        if (self.hetero_slices or self.prunes_rank) and not self.hetero_ranks:
            raise ValueError(f"method {self.name!r}: rank slicing and pruning need `hetero_ranks`")
        if self.secure_products and self.linear:
            raise ValueError(f"method {self.name!r}: a linear method needs no products")
        if self.hetero_drops_tail and not self.hetero_ranks:
            raise ValueError(f"method {self.name!r}: `hetero_drops_tail` needs `hetero_ranks`")

    def trained(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients train (and upload) A and B in round ``rnd``."""
        if self.alternating:
            return rnd % 2 == 0, rnd % 2 == 1
        return not self.frozen_A, True

    def uploaded(self, rnd: int) -> tuple[bool, bool]:
        """Whether clients upload A and B in round ``rnd`` (what they train, less B kept local)."""
        train_A, train_B = self.trained(rnd)
        return train_A, train_B and not self.personal_B

    @property
    def server(self) -> str:
        """The name of the method whose server math runs this one."""
        return self.server_method or self.name
