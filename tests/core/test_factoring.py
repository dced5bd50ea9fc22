"""The residual's exact factoring without QR or SVD, the fold in place, any device.

Every check is against an ideal computed here in fp64 from the clients' factors
(``sum_i p_i B_i A_i``), never against what the library reports of itself.
"""

import pytest
import torch

from fedexlora import Residual, aggregate
from fedexlora.core.factors import centred_residual


def _clients(k, d, r, n, seed=0, spread=0.1):
    """fp32 clients near a shared adapter, as after local training."""
    g = torch.Generator().manual_seed(seed)
    A0 = torch.randn(r, n, generator=g) / n**0.5
    B0 = torch.randn(d, r, generator=g) / d**0.5
    As = [A0 + spread * torch.randn(r, n, generator=g) / n**0.5 for _ in range(k)]
    Bs = [B0 + spread * torch.randn(d, r, generator=g) / d**0.5 for _ in range(k)]
    return As, Bs


def _ideal64(As, Bs, w):
    p = torch.tensor(w, dtype=torch.float64)
    p = p / p.sum()
    return sum(pi * B.double() @ A.double() for pi, A, B in zip(p, As, Bs))


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


CASES = {
    "square": (10, 64, 4, 64, None),
    "tall": (4, 96, 4, 24, None),
    "wide": (4, 24, 4, 96, None),
    "k=2": (2, 48, 8, 40, None),
    "k above d/r (dense)": (12, 16, 4, 20, None),
    "a zero-weight client": (5, 40, 4, 32, [1.0, 0.0, 2.0, 3.0, 0.5]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fp32_factoring_is_exact_against_an_fp64_ideal(case):
    k, d, r, n, w = CASES[case]
    As, Bs = _clients(k, d, r, n)
    w = w or [float(i + 1) for i in range(k)]
    res = aggregate(As, Bs, weights=w, method="fedex")
    assert res.A.dtype == res.B.dtype == torch.float32
    got = res.B.double() @ res.A.double() + res.residual.to_dense().double()
    assert _rel(got, _ideal64(As, Bs, w)) <= 1e-6
    live = sum(1 for x in w if x > 0)
    R = res.residual
    bound = (live - 1) * r
    # the byte bound: rank <= (k' - 1) r, dense exactly where dense is smaller
    assert R.is_factored == (bound * (d + n) < d * n)
    if R.is_factored:
        assert R.U.shape == (d, bound) and R.V.shape == (bound, n)
        assert R.nbytes == bound * (d + n) * 4
    else:
        assert R.nbytes == d * n * 4


def test_duplicate_clients_cost_nothing_and_identical_ones_give_zero():
    As, Bs = _clients(3, 40, 4, 30)
    dup_A, dup_B = [As[0], As[1], As[1], As[2]], [Bs[0], Bs[1], Bs[1], Bs[2]]
    w = [1.0, 1.0, 1.0, 1.0]
    res = aggregate(dup_A, dup_B, weights=w)
    got = res.B.double() @ res.A.double() + res.residual.to_dense().double()
    assert _rel(got, _ideal64(dup_A, dup_B, w)) <= 1e-6
    assert res.residual.rank <= 3 * 4
    same = aggregate([As[0]] * 4, [Bs[0]] * 4)
    assert same.residual.is_zero and same.residual.nbytes == 0
    one = aggregate(As[:1], Bs[:1])
    assert one.residual.is_zero


def test_factoring_does_not_depend_on_which_client_is_the_pivot():
    """The pivot is the heaviest client; any other gives the same residual."""
    As, Bs = _clients(4, 32, 4, 28, seed=3)
    A = torch.stack(As).double()
    B = torch.stack(Bs).double()
    for w in ([4.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 4.0], [1.0, 5.0, 2.0, 1.0]):
        p = torch.tensor(w, dtype=torch.float64) / sum(w)
        R = centred_residual(A, B, p).to_dense()
        B_bar = torch.einsum("k,kdr->dr", p, B)
        A_bar = torch.einsum("k,krn->rn", p, A)
        assert torch.allclose(R, _ideal64(As, Bs, w) - B_bar @ A_bar, atol=1e-12)


def test_truncating_the_unordered_factors_is_the_svd_optimum():
    """The fast factors are not SVD-ordered; truncation orders them first (Eckart-Young)."""
    As, Bs = _clients(5, 50, 4, 40, seed=1)
    R = aggregate([a.double() for a in As], [b.double() for b in Bs]).residual
    assert R.is_factored and not R.ordered
    kept, rest = R.truncate(5)
    dense = R.to_dense()
    X, S, Yh = torch.linalg.svd(dense)
    best = (X[:, :5] * S[:5]) @ Yh[:5]
    assert torch.allclose(kept.to_dense(), best, atol=1e-10)
    assert torch.allclose(kept.to_dense() + rest.to_dense(), dense, atol=1e-10)


def test_concat_without_reduction_is_exact_and_dense_when_smaller():
    g = torch.Generator().manual_seed(0)
    parts = [
        Residual((30, 20), U=torch.randn(30, 3, generator=g), V=torch.randn(3, 20, generator=g))
        for _ in range(3)
    ]
    total = sum(p.to_dense() for p in parts)
    cat = Residual.concat(parts, reduce=False)
    assert cat.is_factored and cat.rank == 9
    assert torch.equal(cat.U, torch.cat([p.U for p in parts], 1))
    many = Residual.concat(parts * 4, reduce=False)  # rank 36 > 30*20/50: dense
    assert not many.is_factored
    assert torch.allclose(many.to_dense(), 4 * total, atol=1e-4)
    mixed = Residual.concat([many, parts[0]], reduce=False)
    assert torch.allclose(mixed.to_dense(), 4 * total + parts[0].to_dense(), atol=1e-4)


def test_an_fp32_layer_folds_in_place_and_rebuilds_bit_for_bit_from_its_state(tiny_bert_dir):
    """Each fold is one ``addmm_`` into the weight; the state (the residuals while smaller
    than the weight, then the weight) rebuilds the very bits; the sum is exact."""
    from fedexlora.bridge.fold import effective_weight, fold_residuals, load_side_state, side_state
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.bridge.models import load_model

    def fresh():
        return load_model(
            tiny_bert_dir, causal=False, num_labels=3, r=4, alpha=8, dropout=0.0,
            target_modules=["query", "value"],
        )[0]  # fmt: skip

    model = fresh()
    name, layer = next(iter(lora_layers(model).items()))
    w0 = effective_weight(layer, lora=False)
    d, n = w0.shape
    scale = float(layer.scaling["default"])
    g = torch.Generator().manual_seed(0)
    ideal = torch.zeros(d, n, dtype=torch.float64)
    states = []
    for _ in range(12):
        U = torch.randn(d, 3, generator=g) * 1e-2
        V = torch.randn(3, n, generator=g)
        fold_residuals(model, {name: Residual((d, n), U=U, V=V)})
        ideal += scale * (U.double() @ V.double())
        states.append((side_state(model), layer.get_base_layer().weight.detach().clone()))
    kinds = [sorted(k.rsplit(".", 1)[1] for k in st if name in k) for st, _ in states]
    assert kinds[0] == ["U", "V"] and kinds[1] == ["U", "V", "splits"]  # the residuals
    assert kinds[-1] == ["weight"]  # 36 (d + n) > d n: the weight itself
    for state, weight in (states[1], states[-1]):
        again = fresh()
        load_side_state(again, state)
        got = lora_layers(again)[name].get_base_layer().weight
        assert torch.equal(got, weight)  # the very bits
    got = effective_weight(layer, lora=False) - w0
    assert float((got - ideal).norm() / ideal.norm()) <= 1e-5


def test_aggregate_keeps_the_factors_device():
    """Every tensor ``aggregate`` returns lives on the factors' device (``meta`` here: a
    device other than the CPU, where any tensor made on the CPU would be caught)."""
    k, d, r, n = 4, 32, 4, 24
    As = [torch.empty(r, n, device="meta") for _ in range(k)]
    Bs = [torch.empty(d, r, device="meta") for _ in range(k)]
    for method in ("fedex", "fedit", "flora"):
        gen = torch.Generator().manual_seed(0) if method == "flora" else None
        res = aggregate(As, Bs, weights=[1.0, 2.0, 3.0, 4.0], method=method, generator=gen)
        tensors = [res.A, res.B, *res.residual.tensors().values()]
        assert all(t.device.type == "meta" for t in tensors), method
        assert res.A.shape == (r, n) and res.B.shape == (d, r)
    res = aggregate(As, Bs, method="fedex")
    assert res.residual.shape == (d, n) and res.residual.U.shape == (d, (k - 1) * r)
