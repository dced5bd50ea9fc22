"""HetLoRA: heterogeneous ranks, zero-padded, sparsity-weighted, truncated, self-pruned.

Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024 (arXiv 2401.06432; no code released: this follows the paper's Fig. 2
and its public re-implementations). Client i trains rank ``r_i <= r``:

- it receives the plain truncation of the global adapter, ``A[:r_i]`` and ``B[:, :r_i]``
  (not an SVD: that is FlexLoRA), and what the truncation leaves out is dropped;
- its upload is zero-padded to ``r`` and aggregated with *sparsity weights*:
  ``p_i = ||B_i A_i||_F / Σ_j ||B_j A_j||_F`` per layer (no data-size term), applied to
  A and B separately (so the round is inexact, as FedIT's);
- it prunes its own rank: its loss gets ``λ ||B[:, t:r_i]||_F ||A[t:r_i]||_F`` with
  ``t = ⌊γ r_i⌋``, and when that tail's norm product ends the round smaller than it began,
  the tail is cut off (``r_i <- t``) for the rest of the run. (:data:`GAMMA`,
  :data:`LAMBDA`: the re-implementations' defaults.)
"""

from __future__ import annotations

import math

import torch

from fedexlora.core.factors import Residual, cut_rank, used_rank
from fedexlora.core.methods.spec import LocalHooks, LocalModel, MethodSpec

GAMMA = 0.99  # the fraction of its rank a client keeps when it prunes
LAMBDA = 0.01  # the weight of the tail's norm product in the local loss


def sparsity_weights(A, B) -> torch.Tensor:
    """``||B_i A_i||_F`` normalised over the clients (stacked fp64 factors)."""
    # ||B A||_F² = tr((BᵀB)(A Aᵀ)): no (d, n) product
    gram = torch.einsum("kdr,kds->krs", B, B) * torch.einsum("krn,ksn->krs", A, A)
    norms = gram.sum(dim=(1, 2)).clamp_min(0).sqrt()
    total = norms.sum()
    if total <= 0:  # every update is zero: any weights give the same average
        return torch.full_like(norms, 1.0 / norms.numel())
    return norms / total


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """A and B averaged with the sparsity weights (``p`` is not used); no residual."""
    del p, out_dtype, generator, atol
    k, r, n = A.shape
    d = B.shape[1]
    w = sparsity_weights(A, B)
    A_new = torch.einsum("k,krn->rn", w, A)
    B_new = torch.einsum("k,kdr->dr", w, B)
    return A_new, B_new, Residual.zero(d, n, dtype=A.dtype, device=A.device)


def pruning_tail(rank: int) -> int:
    """Where the tail a client of rank ``rank`` regularizes (and may cut) starts."""
    return math.floor(GAMMA * rank)


def prune_rank(model: LocalModel, rnd: int) -> LocalHooks:
    """The rank self-pruning of one client's round (``local_round``).

    ``penalty`` (added to the local loss) is ``λ ||B[:, t:r]|| ||A[t:r]||`` over the tail
    of the rank ``r`` the client uses, ``t = ⌊γ r⌋``; ``after`` (after training) cuts the
    adapter to rank ``t`` when that tail's norm product ended smaller than it began.
    """
    del rnd

    rank = used_rank(model.factors())
    cut = pruning_tail(rank)
    if not 1 <= cut < rank:
        return LocalHooks()
    with torch.no_grad():
        before = float(model.tail_norm(cut, rank))

    def after() -> None:
        with torch.no_grad():
            if float(model.tail_norm(cut, rank)) < before:  # the tail shrank: cut it off
                model.load(cut_rank(model.factors(), cut))

    return LocalHooks(penalty=lambda: LAMBDA * model.tail_norm(cut, rank), after=after)


def check(cfg) -> list[str]:
    """What HetLoRA cannot run with: its rank-pruning term lives in the builtin loss."""
    errs = []
    if cfg.trainer == "trl":
        errs.append(
            "`trainer` 'trl' cannot train method 'hetlora' (its rank-pruning regularizer is "
            "part of the builtin trainer's loss); fix: --trainer builtin"
        )
    if cfg.dp:
        errs.append(
            "`dp_epsilon`: DP-SGD cannot be combined with method 'hetlora' (its rank-pruning "
            "regularizer is not part of the per-sample gradients DP-SGD clips)"
        )
    return errs


SPEC = MethodSpec(
    name="hetlora",
    title="HetLoRA",
    paper="Cho et al., EMNLP 2024 (arXiv 2401.06432)",
    trains="A and B (each client at its own rank, pruned by itself)",
    keeps_local="nothing",
    uploads="A_i, B_i (zero-padded by the server)",
    downloads="the first r_i rows of A and columns of B",
    exact=False,
    linear=False,
    bytes_per_round="up 4kr(d+n); down 4kr(d+n)",
    aggregate=aggregate,
    hetero_ranks=True,
    hetero_drops_tail=True,
    hetero_slices=True,
    prunes_rank=True,
    local_round=prune_rank,
    check=check,
)
