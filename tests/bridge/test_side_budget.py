"""``--side-budget``: the side branch held within a fraction of each layer's base bytes.

Exact while the budget holds the accumulated residual; beyond it, the best low-rank part
with the rest kept as error feedback, and no round further from its ideal than FedIT's
model would be at the same uploads. Checked on the model's effective weights against
the ideal and FedIT's model, both computed here by hand from what the clients uploaded.
"""

import pytest
import torch

pytestmark = pytest.mark.slow(seconds=60)


def _run(cfg, seen_updates):
    from fedexlora.bridge.fold import base_nbytes, effective_weight
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    seen, spy = seen_updates
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    layers = lora_layers(model, "default")
    weights = [{k: effective_weight(layer) for k, layer in layers.items()}]
    states = []

    def after_round(row, server, mdl):
        weights.append({k: effective_weight(layer) for k, layer in layers.items()})
        states.append(server.state.clone())

    rows, _, server = run_method(
        cfg, "fedex", prepare(cfg, tok, task), model=model, progress=False,
        local_update=spy, after_round=after_round,
    )  # fmt: skip
    base = sum(base_nbytes(layer) for layer in layers.values())
    gaps = []  # per round and layer: (the model's gap, FedIT's gap), relative to the update
    for rnd in range(1, len(rows) + 1):
        ups = [seen[(rnd, c)] for c in range(cfg.num_clients)]
        n = torch.tensor([float(u.num_examples) for _, _, u in ups], dtype=torch.float64)
        p = n / n.sum()
        for k, layer in layers.items():
            s = float(layer.scaling["default"])
            before, after = weights[rnd - 1][k], weights[rnd][k]
            prod = [a.factors[k][1].double() @ a.factors[k][0].double() for _, a, _ in ups]
            start = ups[0][0].factors[k][1].double() @ ups[0][0].factors[k][0].double()
            ideal = before + s * (sum(pi * m for pi, m in zip(p, prod)) - start)
            A, B = states[rnd - 1].factors[k]  # the averaged factors: FedIT's global ones
            fedit = before + s * (B.double() @ A.double() - start)
            update = float((ideal - before).norm())
            gaps.append(
                (float((after - ideal).norm()) / update, float((fedit - ideal).norm()) / update)
            )
    return rows, base, gaps, server


def test_a_budget_that_holds_the_residuals_stays_exact(tiny_cfg, seen_updates):
    cfg = tiny_cfg.replace(methods=["fedex"], dtype="bf16", side_budget=100.0, rounds=3,
                           lr=2e-2)  # fmt: skip
    rows, _, gaps, server = _run(cfg.validate(), seen_updates)
    assert all(v is None for v in server.side_rank.values())  # every layer uncapped
    assert max(g for g, _ in gaps) <= 1e-5
    assert all(not r["approximate"] and r["side_budget"] == 100.0 for r in rows)  # nothing cut


def test_a_tight_budget_holds_its_bytes_and_is_never_worse_than_fedit(
    tiny_cfg, seen_updates, tmp_path, task_identity
):
    from test_flower_parity import _close, _flower

    cfg = tiny_cfg.replace(methods=["fedex"], dtype="bf16", side_budget=0.25, rounds=4,
                           lr=2e-2).validate()  # fmt: skip
    rows, base, gaps, server = _run(cfg, seen_updates)
    assert set(server.side_rank.values()) == {2}  # floor(0.25 * bytes / (4 (d + n)))
    for r in rows:
        assert 0 < r["side_bytes"] <= 0.25 * base, r["round"]
        assert r["approximate"] and r["approximation_gap"]["max"] > 0
    for g, fedit in gaps:
        assert g <= fedit * (1 + 1e-3) + 1e-6, (g, fedit)
    assert max(g for g, _ in gaps) > 1e-3  # the budget binds: not exact, and labelled so
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, rows)
    assert [r["side_bytes"] for r in flower] == [r["side_bytes"] for r in rows]


def test_bad_budget_input_is_named(tiny_cfg):
    errs = tiny_cfg.replace(side_budget=0.0).errors()
    assert any("`side_budget`" in e for e in errs)
    errs = tiny_cfg.replace(dtype="bf16", side_budget=0.5, side_rank=8).errors()
    assert any("two lossy modes" in e for e in errs)
    errs = tiny_cfg.replace(side_budget=0.5, fp32_side_branch=False).errors()
    assert any("`side_budget` bounds the side branch" in e for e in errs)


def test_the_server_never_catches_up_further_from_the_round_than_fedit():
    """Round 1 holds the stronger of two directions (cap 1) and keeps the other back;
    round 2's residual adds to the one held back until it is the stronger: catching up
    would swap the held direction and miss the round's ideal by more than its residual,
    so the held delta stays and the residual joins the feedback."""
    from fedexlora.core.factors import Residual
    from fedexlora.server.lossy import LossyModes, _fro

    e = torch.eye(4, dtype=torch.float64)

    def outer(c, i, j):
        return Residual((4, 4), U=c * e[:, i : i + 1], V=e[j : j + 1])

    class Held(LossyModes):
        def __init__(self):
            self.base_delta, self.feedback, self.side_rank = {}, {}, {"w": 1}

    srv = Held()
    R1 = Residual.concat([outer(1.0, 0, 0), outer(0.9, 1, 1)])
    out, capped, _ = srv._cap_side({"w": R1})
    assert torch.allclose(capped["w"].to_dense(), outer(1.0, 0, 0).to_dense())
    srv.base_delta = dict(capped)
    R2 = outer(0.5, 1, 1)
    out, capped, norms = srv._cap_side({"w": R2})
    assert "w" not in out  # nothing folded: the model moves by nothing, FedIT's gap ||R2||
    assert torch.allclose(capped["w"].to_dense(), outer(1.0, 0, 0).to_dense())
    assert norms["w"] == pytest.approx(1.4)  # 0.9 + 0.5 held back, nothing lost
    assert _fro(srv.feedback["w"]) == pytest.approx(1.4)


def test_a_resume_keeps_what_the_budget_held_back(tiny_cfg, tmp_path):
    """A run under a binding budget, crashed in round 3 and resumed, writes the rows of
    the run that never stopped: the server's feedback and every cap come back."""
    from conftest import crash_then_resume, without_timings
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], dtype="bf16", side_budget=0.25, rounds=4,
                           lr=2e-2).validate()  # fmt: skip
    straight = run_experiment(cfg, tmp_path / "straight", progress=False)

    resumed = crash_then_resume(cfg, tmp_path / "resumed", crash_round=3)

    assert straight[-1]["approximation_gap"]["max"] > 0  # the budget binds
    assert [without_timings(r) for r in resumed] == [without_timings(r) for r in straight]
