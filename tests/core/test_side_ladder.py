"""The side branch's fold: exact, appended, and re-factored only on the ladder's rungs."""

from __future__ import annotations

import pytest
import torch

from fedexlora.core import side as side_module
from fedexlora.core.factors import Residual, centred_residual
from fedexlora.core.side import SideBranch, passes_rung


def _round_residual(g: torch.Generator, d: int, n: int, k: int, r: int) -> Residual:
    """One round's ``Σ p_i B_i A_i − B̄ Ā`` of ``k`` clients in general position (fp64)."""
    A = torch.randn(k, r, n, generator=g, dtype=torch.float64) * 0.01
    B = torch.randn(k, d, r, generator=g, dtype=torch.float64) * 0.01
    return centred_residual(A, B, torch.full((k,), 1.0 / k, dtype=torch.float64))


def _count_refactors(monkeypatch) -> list[int]:
    """Patches ``Residual.from_factors`` (the side branch's re-factor) to log its columns."""
    calls: list[int] = []
    real = Residual.from_factors

    def counted(U, V, **kw):
        calls.append(int(U.shape[1]))
        return real(U, V, **kw)

    monkeypatch.setattr(side_module.Residual, "from_factors", staticmethod(counted))
    return calls


def test_the_fold_is_exact_against_the_hand_sum_and_refactors_only_on_rungs(monkeypatch):
    d, n, k, r, rounds = 96, 80, 3, 2, 30  # 4 new directions a round; dense from rank 43
    side = SideBranch(d, n)
    calls = _count_refactors(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ideal = torch.zeros(d, n, dtype=torch.float64)
    for t in range(rounds):
        R = _round_residual(g, d, n, k, r)
        ideal += R.to_dense()
        side.add(R)
        if side.dense is None:  # factored: every round's directions are kept
            assert side.rank == 4 * (t + 1)
        err = (side.to_dense() - ideal).norm() / ideal.norm()
        assert err < 1e-6, f"round {t + 1}: the side branch is {err:.1e} off the hand sum"
    assert side.dense is not None  # it outgrew dense, and holds the sum all the same
    # ranks 4, 8, ..., 40 factored: re-factored only where 4 more columns passed a rung;
    # 44 columns would be dense: the held 40 are reduced first (a second call off a rung)
    rungs = sum(passes_rung(q, q + 4) for q in range(4, 40, 4))
    assert len(calls) == rungs + (1 if passes_rung(40, 44) else 2)
    assert rungs < 9  # of the 9 factored folds after the first


def test_redundant_directions_are_dropped_at_the_next_rung():
    """Every round folds the same rank-3 direction: the columns held stay near 3."""
    d, n = 200, 150
    g = torch.Generator().manual_seed(1)
    U = torch.randn(d, 3, generator=g, dtype=torch.float64)
    V = torch.randn(3, n, generator=g, dtype=torch.float64)
    side = SideBranch(d, n)
    held = []
    for t in range(40):
        side.add(Residual((d, n), U=U * (1 + 0.1 * t), V=V))
        held.append(side.rank)
        want = sum(1 + 0.1 * s for s in range(t + 1)) * (U @ V)
        assert torch.allclose(side.to_dense(), want, rtol=1e-5, atol=1e-6 * want.abs().max())
    assert max(held) <= 3 * side_module.REFACTOR_GROWTH + 3  # a rung plus one round's
    assert held[-1] <= held[0] * side_module.REFACTOR_GROWTH + 3


def test_a_branch_rebuilt_from_its_tensors_folds_bit_for_bit_as_the_straight_one():
    """A resumed client's branch (``set`` from the saved U, V) re-factors where the
    straight one does: the rung depends on the columns alone."""
    d, n, k, r = 120, 100, 2, 3
    g = torch.Generator().manual_seed(2)
    residuals = [_round_residual(g, d, n, k, r) for _ in range(12)]
    straight = SideBranch(d, n)
    for R in residuals:
        straight.add(R)
    resumed = SideBranch(d, n)
    for R in residuals[:5]:
        resumed.add(R)
    rebuilt = SideBranch(d, n)
    rebuilt.set(Residual((d, n), U=resumed.U.clone(), V=resumed.V.clone()))
    for R in residuals[5:]:
        rebuilt.add(R)
    assert torch.equal(rebuilt.U, straight.U) and torch.equal(rebuilt.V, straight.V)


@pytest.mark.parametrize(
    ("before", "after", "passes"),
    [(0, 5, True), (5, 5, False), (808, 809, False), (808, 1009, False), (1009, 1010, True)],
)
def test_the_rungs_are_the_powers_of_the_growth(before, after, passes):
    # 1.25**30 = 807.8, 1.25**31 = 1009.7
    assert passes_rung(before, after) is passes


def test_a_dense_branch_adds_with_the_bits_of_a_sum_formed_apart_and_leaves_its_input():
    d, n = 30, 20
    g = torch.Generator().manual_seed(4)
    side = SideBranch(d, n)
    saved = torch.randn(d, n, generator=g)  # a client's saved state, which set() aliases
    before = saved.clone()
    side.set(Residual((d, n), dense=saved))
    R = _round_residual(g, d, n, 2, 2)
    want = (saved.double() + R.to_dense()).float()
    side.add(R)
    assert torch.equal(side.dense, want)
    assert torch.equal(saved, before)  # the saved state is not changed by the fold


def test_between_rungs_a_branch_goes_dense_only_if_its_rank_needs_it():
    """Rank 88 of 200 x 200 (dense from 100 columns), then 4 columns a round inside the
    same span: the branch stays factored at rank 88."""
    d = n = 200
    g = torch.Generator().manual_seed(5)
    U = torch.randn(d, 88, generator=g, dtype=torch.float64)
    V = torch.randn(88, n, generator=g, dtype=torch.float64)
    side = SideBranch(d, n)
    side.add(Residual((d, n), U=U, V=V))
    want = U @ V
    for t in range(6):
        cols = slice(4 * t, 4 * t + 4)
        side.add(Residual((d, n), U=U[:, cols] * 0.5, V=V[cols]))
        want = want + 0.5 * U[:, cols] @ V[cols]
        assert side.dense is None, f"round {t + 2}: dense at rank 88"
        assert side.rank <= 88 * side_module.REFACTOR_GROWTH + 4
    assert torch.allclose(side.to_dense(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
