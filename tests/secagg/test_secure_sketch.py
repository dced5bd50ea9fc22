"""FedEx under secure aggregation at the information floor: the one-pass sketch.

Each client sends two sketches of its product against public test matrices where they
are smaller than the product; the server rebuilds the residual from the sums and keeps
it factored at rank (k - 1) r, as the clear path does (docs/PRIVACY.md).
"""

import numpy as np
import pytest
import torch

from fedexlora.core.messages import ClientUpload
from fedexlora.core.secure import SecureLayout, client_vector, read_sums
from fedexlora.core.sketch import SketchPlan, sketch_matrices
from fedexlora.core.state import AdapterState
from fedexlora.secagg.encoding import Quantization


def _clients(k, r, d, n, seed=0):
    """``k`` clients' fp32 factors around a common start, and weights ``n_i / 2**20``."""
    g = torch.Generator().manual_seed(seed)
    A0, B0 = torch.randn(r, n, generator=g) / n**0.5, torch.randn(d, r, generator=g) * 1e-2
    ups = [
        (A0 + 1e-2 * torch.randn(r, n, generator=g), B0 + 1e-3 * torch.randn(d, r, generator=g))
        for _ in range(k)
    ]
    return ups, [(300 + 50 * i) / 2**20 for i in range(k)]


def _hand(ups, w):
    """The ideal ``Σ p_i B_i A_i`` and ``Ā``, ``B̄``, by hand in fp64."""
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    M = sum(pi * B.double() @ A.double() for pi, (A, B) in zip(p, ups))
    A_bar = sum(pi * A.double() for pi, (A, _) in zip(p, ups))
    B_bar = sum(pi * B.double() for pi, (_, B) in zip(p, ups))
    return M, A_bar, B_bar


def _summed(layout, ups, w, quant=None):
    """The means read from the clients' vectors, summed (through the quantization)."""
    vecs = [
        client_vector(layout, AdapterState(factors={"l": (A, B)}), wi, 1.0)
        for (A, B), wi in zip(ups, w)
    ]
    if quant is None:
        total = sum(vecs)
    else:
        rng = np.random.default_rng(0)
        ints = sum(quant.encode(v.numpy(), rng)[0] for v in vecs) % 2**32
        total = torch.from_numpy(quant.decode(ints, len(vecs)))
    return read_sums(layout, total, AdapterState(factors={"l": ups[0]}))


@pytest.mark.parametrize("d, n", [(120, 80), (80, 120)])  # and transposed
def test_the_residual_is_rebuilt_from_quantized_sums_of_sketches(d, n):
    k, r = 4, 3
    ups, w = _clients(k, r, d, n)
    template = AdapterState(factors={"l": ups[0]})
    plan = SketchPlan(k, seed=7)
    layout = SecureLayout.for_template(template, products=True, sketch=plan)
    (name, shape), = layout.sketches  # fmt: skip
    assert shape.transposed == (n > d) and shape.s == (k - 1) * r + plan.over
    assert layout.size < d * n  # smaller than the dense product
    quant = Quantization.for_clients(k)
    sums = _summed(layout, ups, w, quant)
    M, A_bar, B_bar = _hand(ups, w)
    A, B = sums.means["l"]  # fp64 (the state holds them in fp32)
    assert A.dtype == torch.float64 and torch.allclose(A, A_bar, atol=1e-10)
    U, V = sums.sketches["l"].residual(A, B, (k - 1) * r)
    assert U.shape == (d, (k - 1) * r) and V.shape == ((k - 1) * r, n)
    R = M - B_bar @ A_bar  # ~1e-3 of M
    err = torch.linalg.norm(B @ A + U @ V - M)
    assert err <= 1e-6 * torch.linalg.norm(R)
    # no worse than the dense products through the same quantization
    dense = _summed(SecureLayout.for_template(template, products=True), ups, w, quant)
    assert err <= torch.linalg.norm(dense.products["l"] - M)
    # a sketch narrower than the residual's rank (k - 1) r cannot hold it
    small = SecureLayout.for_template(template, products=True, sketch=SketchPlan(2, 7, over=2))
    sums = _summed(small, ups, w)
    U, V = sums.sketches["l"].residual(A, B, (k - 1) * r)
    assert torch.linalg.norm(B @ A + U @ V - M) > 1e-2 * torch.linalg.norm(R)


def test_test_matrices_are_public_deterministic_and_per_layer():
    shape = SketchPlan(3, 11).shape(200, 300, 4)
    assert shape is not None and shape.transposed and (shape.m, shape.c) == (300, 200)
    om, psi = sketch_matrices(11, "a", shape)
    assert om.shape == (200, shape.s) and psi.shape == (shape.s2, 300)
    again = sketch_matrices(11, "a", shape)
    assert torch.equal(om, again[0]) and torch.equal(psi, again[1])
    assert not torch.equal(om, sketch_matrices(11, "b", shape)[0])
    assert not torch.equal(om, sketch_matrices(12, "a", shape)[0])
    assert abs(float(om.var()) - 1) < 0.05 and abs(float(om.mean())) < 0.05
    # an integer hash, not a torch generator: pinned, so a torch upgrade cannot change it
    assert float(om[0, 0]) == pytest.approx(-1.3324527394927712, abs=0)
    # well conditioned: the columns of Ω are nearly orthogonal
    s = torch.linalg.svdvals(om / 200**0.5)
    assert float(s[0] / s[-1]) < 3


def test_dense_where_the_sketch_is_not_smaller():
    plan = SketchPlan(3, 0)
    assert plan.shape(32, 32, 4) is None  # s = 18, s2 = 28: no smaller than 32 x 32
    assert plan.shape(384, 384, 8).numbers < 384 * 384
    with pytest.raises(ValueError, match="oversampling must be >= 0"):
        SketchPlan(3, 0, over=-1)
    with pytest.raises(ValueError, match="at least one client"):
        SketchPlan(0, 0)


def _secure_upload_bytes(layers, k, r, head, seed=0):
    """One secure round of ``k`` clients through SecAgg+ (every stage, the masks, the
    quantization): the masked vectors' bytes, each client's clear upload's bytes, and
    the floor ``k r (d + n)`` per layer plus the head and counts in the vector's encoding.
    """
    from fedexlora.secagg.protocol import ClientSession
    from fedexlora.secagg.rounds import SecureRound, client_reply, client_session_reply

    g = torch.Generator().manual_seed(seed)
    factors = {
        f"l{i}": (torch.randn(r, n, generator=g) * 0.05, torch.randn(d, r, generator=g) * 0.01)
        for i, (d, n) in enumerate(layers)
    }
    template = AdapterState(factors=factors, extra={"head": torch.zeros(head)})
    ups = [
        ClientUpload(
            c,
            AdapterState.from_flat(
                {
                    key: t + 1e-3 * torch.randn(t.shape, generator=g)
                    for key, t in template.to_flat().items()
                }  # fmt: skip
            ),
            500,
            1.0,
        )
        for c in range(k)
    ]
    sessions = {c: ClientSession(c) for c in range(k)}

    def exchange(stage, msgs):
        return {c: client_session_reply(sessions[c], stage, m) for c, m in msgs.items()}

    rnd = SecureRound(template, "fedex", list(range(k)), seed=1)
    rnd.keys(exchange)
    setups, collect = rnd.setup(), rnd.session.collect()
    masked = {c: client_reply(sessions[c], setups[c], collect[c], up, seed=0, rnd=1)
              for c, up in enumerate(ups)}  # fmt: skip
    rnd.finish(masked, exchange)
    floor_numbers = 2 + head + sum(k * r * (d + n) for d, n in layers)  # weight, loss, head
    floor = 4 * (floor_numbers * rnd.quant.limbs + 1)  # the same limbs and clip count
    return [len(m) for m in masked.values()], ups[0].nbytes, floor


def test_bytes_up_at_minilm_shapes_are_within_twice_the_floor():
    # MiniLM's 12 adapted layers (q, v of 6 blocks), 384 x 384, r = 8, 3 clients, its head
    sizes, clear, floor = _secure_upload_bytes([(384, 384)] * 12, k=3, r=8, head=384 * 5 + 5)
    assert len(set(sizes)) == 1
    assert sizes[0] <= 2.0 * floor, sizes[0] / floor
    assert sizes[0] < 0.25 * 4 * 2 * 12 * 384 * 384  # far below the dense products' limbs
    assert clear < sizes[0]
