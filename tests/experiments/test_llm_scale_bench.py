"""benchmarks/llm_scale.py at a tiny block (hidden 64): what it measures is what is held.

- every byte it reports is the bytes of the tensors held or sent, computed here from the
  shapes (a side branch of rank q: q (d + n) fp32 numbers per layer);
- FedEx's side branch grows round by round, FedIT holds none and its server stays the same;
- FedEx's model is the ideal model, rebuilt here by hand from the uploads, and FedIT's
  is not.
"""

from __future__ import annotations

import pytest
import torch

from conftest import load_script

F32 = 4
ROUNDS = 3


def _script():
    return load_script("benchmarks/llm_scale.py")


@pytest.fixture(scope="module")
def bench():
    return _script()


@pytest.fixture(scope="module")
def block(bench, tmp_path_factory):
    # hidden 64; k/v 64 -> 16; gate/up 64 -> 128; down 128 -> 64
    shape = bench.BlockShape(hidden=64, intermediate=128, heads=4, kv_heads=1, head_dim=16)
    return bench.save_block(shape, tmp_path_factory.mktemp("llm-scale") / "block")


def _run(bench, block, precision="bf16", *, fraction=0.1, r=2):
    """The rows, and per round the event with each model's side-branch bytes then."""
    from fedexlora.bridge.fold import side_nbytes

    events = []

    def keep(ev):
        ev.side_nbytes = {"fedex": side_nbytes(ev.fedex), "fedit": side_nbytes(ev.fedit)}
        events.append(ev)

    rows = bench.simulate(block, precision, fraction, r, ROUNDS, on_round=keep)
    return rows, events


def _shapes(model):
    from fedexlora.bridge.adapters import layer_info

    return {name: info.shape for name, info in layer_info(model).items()}


def test_bytes_reported_are_the_bytes_of_the_tensors_held_and_sent(bench, block):
    # Arrange: 20 clients at fraction 0.1 sample k = 2 a round; r = 2 adds rank
    # (k - 1) r = 2 a round to every side branch (all stay factored in 3 rounds)
    rows, events = _run(bench, block)
    shapes = _shapes(events[0].fedex)
    factors = sum(2 * (d + n) * F32 for d, n in shapes.values())  # A and B at r = 2
    for row, ev in zip(rows, events):
        # Act: what the benchmark reports, against bytes from the shapes
        side = sum(row.round * 2 * (d + n) * F32 for d, n in shapes.values())
        # Assert
        assert row.k == 2 and len(row.up_bytes) == 2
        assert row.side_bytes == side == ev.side_nbytes["fedex"]  # the library's count
        assert row.adapter_bytes == factors
        assert row.up_bytes == [factors, factors]
        assert [b for b, _ in row.down_fedit] == [factors, factors]  # FedIT: factors only
        for (b, _), payload in zip(row.down_fedex, ev.payloads["fedex"]):
            assert b == payload.nbytes  # the library's count of the same payload
            assert b <= len(payload.to_bytes()) <= b + 64 * 1024  # the wire: plus a header
            residual = sum(r.numel() * F32 for r in payload.to_flat().values()) - factors
            assert b == factors + residual
    # bf16 base: seven weights of d x n, 2 bytes each
    assert rows[0].base_bytes == sum(2 * d * n for d, n in shapes.values())


def test_fedex_side_branch_grows_with_rounds_and_fedit_holds_none(bench, block):
    rows, events = _run(bench, block, fraction=0.2)  # k = 4
    side = [row.side_bytes for row in rows]
    assert all(a < b for a, b in zip(side, side[1:])), side
    assert [ev.side_nbytes["fedit"] for ev in events] == [0] * ROUNDS
    assert len({row.server_fedit for row in rows}) == 1  # FedIT's server: the factors
    assert all(row.server_fedex > row.server_fedit for row in rows)
    ranks = [row.side_rank["q_proj"] for row in rows]
    assert ranks == [3 * 2 * t for t in range(1, ROUNDS + 1)]  # (k - 1) r a round


def _base(layer, precision):
    w = layer.get_base_layer().weight
    if precision == "nf4":
        import bitsandbytes.functional as F

        return F.dequantize_4bit(w.data, w.quant_state).double()
    return w.detach().double()


def _side_dense(layer):
    side = getattr(layer, "fedex_side", None)
    if side is None:
        return 0.0
    if side.dense is not None:
        return side.dense.double()
    return side.U.double() @ side.V.double()


def _advance_ideal(ideal: torch.Tensor, ev, name: str, s: float) -> None:
    """The round's step of the ideal model, by hand: ``- s B A + sum_i p_i s B_i A_i``
    (``p_i = 1/k``), from the factors the clients started from and their uploads."""
    A0, B0 = (t.double() for t in ev.previous.factors[name])
    mean = sum(u.state.factors[name][1].double() @ u.state.factors[name][0].double()
               for u in ev.uploads) / len(ev.uploads)  # fmt: skip
    ideal += s * (mean - B0 @ A0)


def _effective(lyr, precision: str, s: float) -> torch.Tensor:
    """A layer's weight as the forward pass applies it: base, side branch and adapter."""
    A = lyr.lora_A["default"].weight.detach().double()
    B = lyr.lora_B["default"].weight.detach().double()
    return _base(lyr, precision) + _side_dense(lyr) + s * (B @ A)


@pytest.mark.parametrize("precision", ["bf16", "nf4"])
def test_fedex_model_is_the_ideal_rebuilt_by_hand_and_fedit_is_not(bench, block, precision):
    if precision == "nf4":
        pytest.importorskip("bitsandbytes")
    from fedexlora.bridge.layers import lora_layers

    # Arrange: the pretrained weights W0, read from a fresh copy of the block
    fresh = lora_layers(bench.load_block(block, precision, 2, 4.0))
    w0 = {name: _base(layer, precision) for name, layer in fresh.items()}
    ideal = {name: w0[name].clone() for name in w0}  # B starts at zero: W0 is the model
    worst = {"fedex": 0.0, "fedit": float("inf")}

    def check(ev):
        for name, layer in lora_layers(ev.fedex).items():
            s = float(layer.scaling["default"])
            _advance_ideal(ideal[name], ev, name, s)
            total = torch.linalg.norm(ideal[name] - w0[name])
            for method, model in (("fedex", ev.fedex), ("fedit", ev.fedit)):
                lyr = lora_layers(model)[name]
                assert torch.equal(_base(lyr, precision), w0[name])  # the base is untouched
                got = _effective(lyr, precision, s)
                rel = float(torch.linalg.norm(got - ideal[name]) / total)
                pick = max if method == "fedex" else min
                worst[method] = pick(worst[method], rel)

    # Act
    bench.simulate(block, precision, 0.2, 2, ROUNDS, alpha=4.0, on_round=check)
    # Assert: FedEx to fp32's rounding; FedIT's averaged factors miss the update by far more
    assert worst["fedex"] <= 1e-5, worst
    assert worst["fedit"] >= 1e-3, worst


def test_table_scales_bytes_to_every_block(bench, block):
    rows, _ = _run(bench, block)
    table = bench.memory_table(rows, [1, ROUNDS], blocks=32)
    lines = table.splitlines()
    assert len(lines) == 2 + 2  # header, rule, two rounds
    last = rows[-1]
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    assert cells[:4] == ["bf16", "2", "2", str(ROUNDS)]
    assert cells[5] == f"{32 * last.side_bytes / 1e9:.3f}"
    beside = (last.side_bytes + last.adapter_bytes) / last.adapter_bytes
    assert cells[7] == f"{beside:.1f}x"


def test_a_driven_precision_is_the_ideal_where_it_is_timed_and_measured(bench, block):
    """nf4 driven by bf16's rounds: synced where timed, it is the ideal model on its own
    4-bit base; at a measured round it applies the outcome itself, within 1e-5."""
    pytest.importorskip("bitsandbytes")
    from fedexlora.bridge.layers import lora_layers

    fresh = lora_layers(bench.load_block(block, "nf4", 2, 4.0))
    w0 = {name: _base(layer, "nf4") for name, layer in fresh.items()}
    ideal = {name: w0[name].clone() for name in w0}
    worst = []

    def check(ev):
        shadow = lora_layers(ev.shadows["nf4"]["fedex"])
        for name, layer in lora_layers(ev.fedex).items():
            s = float(layer.scaling["default"])
            _advance_ideal(ideal[name], ev, name, s)
            lyr = shadow[name]
            assert torch.equal(_base(lyr, "nf4"), w0[name])
            got = _effective(lyr, "nf4", s)
            total = torch.linalg.norm(ideal[name] - w0[name])
            worst.append(float(torch.linalg.norm(got - ideal[name]) / total))

    rows = bench.simulate(block, ["bf16", "nf4"], 0.2, 2, ROUNDS, alpha=4.0, reps=1,
                          timed=range(1, ROUNDS + 1), deviation=[2], on_round=check)  # fmt: skip
    assert len(worst) == ROUNDS * 7 and max(worst) <= 1e-5, worst
    nf4 = [row for row in rows if row.precision == "nf4"]
    assert [row.driven_by for row in nf4] == ["bf16"] * ROUNDS
    assert all(row.step_fedex is not None for row in nf4)
    measured = [row for row in nf4 if row.deviation_fedex is not None]
    assert [row.round for row in measured] == [2]
    assert measured[0].deviation_fedex <= 1e-5 and measured[0].deviation_fedit >= 1e-3
    assert measured[0].base_bytes < rows[0].base_bytes  # its own (4-bit) base
