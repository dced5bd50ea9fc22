"""The benchmark scripts behind docs/BENCHMARKS.md report what they measured.

- ``benchmarks/verify_export.py`` judges a merged (fp32) export by fp32's rounding of the
  weights it stores, as docs/LARGE_MODELS.md describes it, and still fails a wrong one;
- ``benchmarks/precision.py`` shows a round the run did not reach as missing, not 0 B;
- ``benchmarks/bf16_rounding.py`` measures the update lost to the storage dtype;
- ``benchmarks/side_fold.py`` times the side branch's fold on its ladder against one that
  re-factors every round.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import load_script
from fedexlora.core.factors import Residual


def _script(name: str):
    return load_script(f"benchmarks/{name}.py")


def _exit_code(mod, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [mod.__file__, *argv])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    return exc.value.code


def test_verify_export_judges_a_merged_export_by_fp32_rounding_of_its_weights(
    tiny_cfg, tmp_path, monkeypatch, capsys
):
    """A merged fp32 export over 1e-5 of the update but within fp32's rounding of its
    weights passes (docs: "exact to fp32 rounding"); one missing 1% of a layer's update
    fails."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fedexlora.run.export import export_model
    from fedexlora.run.inprocess import run_experiment

    # Arrange: lr 1e-4 keeps each round's update small next to the weight, so fp32's
    # rounding of the fold is over 1e-5 of the update (tests/bridge/test_precision.py uses 2e-2
    # to stay under it)
    verify = _script("verify_export")
    cfg = tiny_cfg.replace(
        methods=["fedex"], save_client_adapters=True, lr=1e-4, fp32_side_branch=False
    )
    run_experiment(cfg, tmp_path / "run", progress=False)
    merged = export_model(tmp_path / "run", tmp_path / "merged").path
    ideal, w0 = verify.ideal_from_client_adapters(tmp_path / "run", cfg)
    got = verify.exported(merged, cfg)
    assert verify.rel(got, ideal, w0) > 1e-5  # the case the docs describe: over --tol
    assert verify.rel_weight(got, ideal) <= verify.fp32_rounding_bound(cfg.rounds)
    bad = tmp_path / "bad"  # the same export with 1% of one layer's total update missing
    shutil.copytree(merged, bad)
    name = next(iter(ideal))
    key = name.removeprefix("base_model.model.") + ".weight"
    weights = load_file(str(bad / "model.safetensors"))
    weights[key] = weights[key] - 0.01 * (ideal[name] - w0[name]).to(weights[key].dtype)
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # Act
    good_code = _exit_code(verify, [str(tmp_path / "run"), str(merged)], monkeypatch)
    good_out = capsys.readouterr().out
    bad_code = _exit_code(verify, [str(tmp_path / "run"), str(bad)], monkeypatch)
    bad_out = capsys.readouterr().out
    # Assert
    assert good_code == 0, good_out
    assert "within fp32 rounding of the stored weights" in good_out
    assert bad_code == 1, bad_out
    assert "NOT exact" in bad_out


def test_verify_export_holds_an_adapter_export_to_the_update_bound():
    verify = _script("verify_export")
    # an adapter never rounds into a weight: fp32 rounding of the weight is no excuse
    assert verify.verdict("adapter", 2e-5, 1e-9, rounds=2, tol=1e-5) == ""
    assert verify.verdict("merged", 2e-5, 1e-9, rounds=2, tol=1e-5) != ""
    assert verify.verdict("merged", 2e-5, 1e-6, rounds=2, tol=1e-5) == ""
    assert verify.verdict("adapter", 9e-6, 1e-6, rounds=2, tol=1e-5) != ""


def test_precision_table_shows_rounds_not_reached_as_missing():
    precision = _script("precision")
    measured = {"1": 0, "3": 39_075_840}
    # round 1's zero is measured; round 10 was not reached in a 3-round run
    assert precision.side_cells(measured, rounds=3) == "0 B / 39.1 MB"
    assert precision.side_cells(measured, rounds=10) == "0 B / 39.1 MB / –"
    assert precision.side_cells({**measured, "10": 156_303_360}, rounds=10) == (
        "0 B / 39.1 MB / 156 MB"
    )
    assert precision.side_cells(None, rounds=10) == "none (folded into the weights)"  # fp32


def test_bf16_rounding_measures_the_update_lost_to_the_storage_dtype():
    bf16 = _script("bf16_rounding")
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    assert bf16.lost_fraction(w, 1e-3, torch.float64) == 0.0  # fp64 keeps all of it
    assert bf16.lost_fraction(w, 1e-3, torch.bfloat16) > 0.5  # bf16 loses most of it
    assert bf16.lost_fraction(w, 1e-1, torch.bfloat16) < 0.05  # not a large one


def test_side_fold_compares_the_ladder_with_a_refactor_every_round():
    """Both variants hold the hand sum; the every-round one really re-factors each round
    (a repeated direction is dropped at once), the ladder only on its rungs."""
    bench = _script("side_fold")
    d, n = 200, 150
    parts = bench.residuals(d, n, 3, 4, 6)  # 8 new columns a round: 48, factored
    g = torch.Generator().manual_seed(1)
    base = Residual((d, n), U=torch.randn(d, 40, generator=g, dtype=torch.float64),
                    V=torch.randn(40, n, generator=g, dtype=torch.float64))  # fmt: skip
    again = Residual((d, n), U=base.U[:, :2] * 0.5, V=base.V[:2])  # directions it holds
    for every, held in ((True, 40), (False, 42)):  # 40 -> 42 passes no power of 1.25
        res = bench.fold_all(d, n, parts, every_round=every)
        assert bench.relative_error(res["side"], parts) < 1e-6
        assert res["columns"] == 48
        res = bench.fold_all(d, n, [base, again], every_round=every)
        assert res["columns"] == held
        assert bench.relative_error(res["side"], [base, again]) < 1e-6


def test_side_branch_cost_compares_the_fold_with_the_side_branch(tiny_cfg):
    """Its two models differ as its docstring says: folded into the weights, and beside
    them (``RunConfig()`` resolves to the side branch, so both must be asked for)."""
    from fedexlora.bridge.fold import _side, fold_residuals
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.restore import load_task_for

    mod = _script("side_branch_cost")
    folded, side = mod.models(tiny_cfg.replace(methods=["fedex"]), load_task_for(tiny_cfg))
    res = {}
    for name, layer in lora_layers(folded).items():
        d, n = layer.get_base_layer().weight.shape
        res[name] = Residual((d, n), U=torch.ones(d, 1), V=torch.ones(1, n))
    before = {k: v.clone() for k, v in folded.state_dict().items() if "base_layer" in k}
    for m in (folded, side):
        fold_residuals(m, res)
    assert all(_side(layer) is None for layer in lora_layers(folded).values())
    assert any(not torch.equal(v, folded.state_dict()[k]) for k, v in before.items())
    assert all(_side(layer).rank == 1 for layer in lora_layers(side).values())


def test_distributed_client_table_gives_each_rank_its_share_of_one_process():
    """``benchmarks/distributed_client.py``: base + side per rank over one process's, and
    that times N (1.0 when sharded, N when every rank holds it all)."""
    mod = _script("distributed_client")
    row = dict(trained=8, peak=3e9, libs=1e9, step_s=1.0)
    rows = [
        dict(mode="one", N=1, rank=0, frozen=400, side=800, **row),
        dict(mode="ddp", N=2, rank=1, frozen=400, side=800, **row),
        dict(mode="fsdp", N=2, rank=1, frozen=200, side=420, **row),
    ]
    lines = mod.table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[6:8] for c in cells] == [
        ["1.0000", "1.0000"],
        ["1.0000", "2.0000"],
        ["0.5167", "1.0333"],
    ]
