"""benchmarks/deviation.py reads the per-layer deviation of compare grids back correctly."""

import json
from pathlib import Path

import pytest

from conftest import load_script
from fedexlora.config import RunConfig


@pytest.fixture(scope="module")
def deviation():
    return load_script("benchmarks/deviation.py")


def _row(method, rnd, q0, v0, q1, v1):
    per_layer = {
        "bert.encoder.layer.0.attention.self.query": q0,
        "bert.encoder.layer.0.attention.self.value": v0,
        "bert.encoder.layer.1.attention.self.query": q1,
        "bert.encoder.layer.1.attention.self.value": v1,
    }
    return {"method": method, "round": rnd, "deviation": {"per_layer": per_layer}}


def _grid(root: Path, local_steps: int, runs: dict[str, list[dict]]) -> Path:
    for name, rows in runs.items():
        d = root / name
        d.mkdir(parents=True)
        cfg = RunConfig(task="bbc-news", rounds=3, local_steps=local_steps)
        (d / "config.toml").write_text(cfg.to_toml())
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_splits_fedit_deviation_by_kind_depth_and_round(deviation, tmp_path):
    # Arrange: two runs; the fedex rows must be ignored
    grid = _grid(
        tmp_path / "g",
        6,
        {
            "a": [_row("fedit", 1, 0.4, 0.2, 0.2, 0.0), _row("fedex", 1, 9, 9, 9, 9)],
            "b": [_row("fedit", 1, 0.2, 0.2, 0.2, 0.2), _row("fedit", 2, 0.1, 0.1, 0.1, 0.1)],
        },
    )

    # Act
    res = deviation.grid_deviation(grid)

    # Assert: means computed by hand
    assert res["runs"] == 2 and res["local_steps"] == ["6"]
    assert res["kind"]["Q"] == pytest.approx((0.4 + 0.2 + 0.2 + 0.2 + 0.1 + 0.1) / 6)
    assert res["kind"]["V"] == pytest.approx((0.2 + 0.0 + 0.2 + 0.2 + 0.1 + 0.1) / 6)
    assert res["depth"][0] == pytest.approx((0.4 + 0.2 + 0.2 + 0.2 + 0.1 + 0.1) / 6)
    assert res["depth"][1] == pytest.approx((0.2 + 0.0 + 0.2 + 0.2 + 0.1 + 0.1) / 6)
    assert res["round"][1] == pytest.approx((0.2 + 0.2) / 2)
    assert res["round"][2] == pytest.approx(0.1)


def test_grids_are_compared_over_shared_rounds(deviation, tmp_path, capsys):
    short = _grid(tmp_path / "short", 6, {"a": [_row("fedit", 1, *[0.1] * 4)]})
    long = _grid(
        tmp_path / "long",
        12,
        {"a": [_row("fedit", 1, *[0.3] * 4), _row("fedit", 2, *[0.01] * 4)]},
    )
    out_json = tmp_path / "dev.json"

    deviation.main([str(short), str(long), "--json", str(out_json)])

    text = capsys.readouterr().out
    assert "mean deviation, rounds 1-1" in text
    res = json.loads(out_json.read_text())
    assert [r["shared_rounds_mean"] for r in res] == pytest.approx([0.1, 0.3])


def test_no_rows_is_a_clear_error(deviation, tmp_path):
    grid = _grid(tmp_path / "g", 6, {"a": [_row("fedex", 1, *[0.1] * 4)]})
    with pytest.raises(SystemExit, match="no 'fedit' rows in any"):
        deviation.grid_deviation(grid)
