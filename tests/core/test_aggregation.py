import pytest
import torch

from fedexlora import Residual, aggregate, deviation


def _factors(k, d, r, n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    As = [torch.randn(r, n, generator=g, dtype=dtype) for _ in range(k)]
    Bs = [torch.randn(d, r, generator=g, dtype=dtype) for _ in range(k)]
    return As, Bs


def _ideal(As, Bs, w):
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    return sum(pi * B.double() @ A.double() for pi, A, B in zip(p, As, Bs))


@pytest.mark.parametrize("k,d,r,n", [(3, 24, 4, 40), (5, 50, 2, 17), (2, 9, 3, 64)])
def test_fedex_is_exact_in_fp64_and_low_rank(k, d, r, n):
    As, Bs = _factors(k, d, r, n)
    w = [float(i + 1) ** 2 for i in range(k)]  # uneven weights
    res = aggregate(As, Bs, weights=w, method="fedex")
    got = res.B @ res.A + res.residual.to_dense()
    ideal = _ideal(As, Bs, w)
    assert torch.allclose(got, ideal, rtol=1e-10, atol=1e-10)
    assert res.residual.rank <= (k - 1) * r
    assert torch.linalg.matrix_rank(res.residual.to_dense()) <= (k - 1) * r


def test_residual_is_the_centred_product_and_factored_when_smaller():
    As, Bs = _factors(3, 64, 2, 80)
    res = aggregate(As, Bs, method="fedex")
    R = res.residual
    assert R.is_factored and R.rank == 4  # (k - 1) r with k = 3, r = 2
    assert R.nbytes == R.rank * (64 + 80) * 8
    dense = _ideal(As, Bs, [1, 1, 1]) - res.B @ res.A
    assert torch.allclose(R.to_dense(), dense, atol=1e-10)


def test_residual_falls_back_to_dense_when_dense_is_smaller():
    As, Bs = _factors(10, 6, 4, 5)  # rank bound 36 >> min(6, 5)
    R = aggregate(As, Bs, method="fedex").residual
    assert not R.is_factored
    assert R.nbytes == 6 * 5 * 8
    assert torch.allclose(
        aggregate(As, Bs, method="fedex").B @ aggregate(As, Bs, method="fedex").A + R.to_dense(),
        _ideal(As, Bs, [1] * 10),
        atol=1e-10,
    )


def test_identical_clients_give_zero_residual():
    As, Bs = _factors(1, 20, 3, 30)
    res = aggregate(As * 4, Bs * 4, method="fedex")
    assert res.residual.rank == 0 and res.residual.nbytes == 0
    assert torch.equal(res.residual.to_dense(), torch.zeros(20, 30, dtype=torch.float64))


def test_fedit_is_inexact_and_deviation_measures_it():
    As, Bs = _factors(3, 30, 4, 20)
    res = aggregate(As, Bs, method="fedit")
    ideal = _ideal(As, Bs, [1, 1, 1])
    rel = torch.linalg.norm(res.B @ res.A - ideal) / torch.linalg.norm(ideal)
    assert rel > 0.1
    assert res.residual.rank == 0
    assert deviation(As, Bs) == pytest.approx(rel.item(), rel=1e-9)


def test_ffa_averages_B_and_keeps_shared_A():
    As, Bs = _factors(3, 12, 2, 10)
    shared = [As[0]] * 3
    res = aggregate(shared, Bs, weights=[1, 2, 3], method="ffa")
    assert torch.equal(res.A, As[0])
    assert torch.allclose(res.B @ res.A, _ideal(shared, Bs, [1, 2, 3]), atol=1e-12)
    with pytest.raises(ValueError, match="ffa requires every client to share the frozen A"):
        aggregate(As, Bs, method="ffa")
    # Fed-SB aggregates by the same rule, and its error names Fed-SB
    with pytest.raises(ValueError, match="fedsb requires every client to share the frozen A"):
        aggregate(As, Bs, method="fedsb")


def test_flora_folds_exact_merge_and_reinitialises():
    As, Bs = _factors(4, 16, 2, 12)
    w = [3, 1, 1, 5]
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    res = aggregate(As, Bs, weights=w, method="flora", generator=g1)
    again = aggregate(As, Bs, weights=w, method="flora", generator=g2)
    assert torch.equal(res.B, torch.zeros(16, 2, dtype=torch.float64))
    assert torch.equal(res.A, again.A) and res.A.abs().sum() > 0
    assert torch.allclose(res.residual.to_dense(), _ideal(As, Bs, w), atol=1e-10)


@pytest.mark.parametrize("method", ["fedex", "fedit", "ffa", "flora"])
def test_no_mutation_and_fp32_compute_for_half_inputs(method):
    As, Bs = _factors(3, 8, 2, 6, dtype=torch.bfloat16)
    if method == "ffa":
        As = [As[0].clone() for _ in range(3)]
    before = [t.clone() for t in As + Bs]
    res = aggregate(As, Bs, method=method, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(As + Bs, before))
    assert res.A.dtype == torch.float32 and res.B.dtype == torch.float32
    assert res.residual.to_dense().dtype == torch.float32


def test_fp32_exactness_at_realistic_size():
    As, Bs = _factors(3, 256, 8, 384, dtype=torch.float32)
    res = aggregate(As, Bs, weights=[100, 250, 40])
    ideal = _ideal(As, Bs, [100, 250, 40])
    err = torch.linalg.norm((res.B @ res.A + res.residual.to_dense()).double() - ideal)
    assert err / torch.linalg.norm(ideal) < 1e-6


@pytest.mark.parametrize(
    "As,Bs,weights,match",
    [
        ([], [], None, "nothing to aggregate"),
        ([torch.zeros(2, 3)], [torch.zeros(4, 2), torch.zeros(4, 2)], None, "1 A factors but 2 B"),
        ([torch.zeros(2, 3)], [torch.zeros(4, 3)], None, "rank mismatch"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(4, 2)] * 2, None, "client 1: A"),
        ([torch.zeros(2, 3)] * 2, [torch.zeros(4, 2), torch.zeros(5, 2)], None, "client 1: B"),
        ([torch.zeros(2, 3)] * 2, [torch.zeros(4, 2)] * 2, [1.0, -1.0], "non-negative"),
        ([torch.zeros(2, 3)] * 2, [torch.zeros(4, 2)] * 2, [0.0, 0.0], "must not sum to 0"),
        ([torch.zeros(2, 3)] * 2, [torch.zeros(4, 2)] * 2, [1.0], "one entry per client"),
        ([torch.zeros(3)], [torch.zeros(4, 2)], None, "must be 2-D"),
    ],
)
def test_bad_input_errors(As, Bs, weights, match):
    with pytest.raises(ValueError, match=match):
        aggregate(As, Bs, weights=weights)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown aggregation `method` 'fedavg'"):
        aggregate([torch.zeros(2, 3)], [torch.zeros(4, 2)], method="fedavg")


def test_truncate_and_concat_roundtrip():
    As, Bs = _factors(4, 40, 3, 50)
    R = aggregate(As, Bs).residual
    kept, rest = R.truncate(2)
    assert kept.rank == 2
    assert torch.allclose(kept.to_dense() + rest.to_dense(), R.to_dense(), atol=1e-10)
    total = Residual.concat([kept, rest])
    assert torch.allclose(total.to_dense(), R.to_dense(), atol=1e-10)
    assert total.rank == R.rank
    # best rank-2 approximation: error equals the tail singular values
    s = torch.linalg.svdvals(R.to_dense())
    assert torch.linalg.norm(rest.to_dense()) == pytest.approx(s[2:].norm().item(), rel=1e-8)
