import json

import pytest
import typer
from typer.testing import CliRunner

from fedexlora.experiments.bench import (
    LayerShape,
    ModelShape,
    bench_app,
    comm_methods,
    comm_table,
    embedded_shape,
    llama7b_shape,
    roberta_base_shape,
)

F32 = 4


def _by_method(rows):
    return {r["method"]: r for r in rows}


def test_roberta_factored_residual_is_48x_smaller_than_dense():
    # Arrange: the paper's GLUE setting, RoBERTa-base q/v, r=4, k=3
    d = n = 768
    r, k, layers = 4, 3, 24

    # Act
    by = _by_method(comm_table(roberta_base_shape(), r, k))

    # Assert: every figure from first principles
    ab = (r * n + d * r) * F32
    ours, dense = by["fedex"], by["fedex-dense"]
    assert ours["residual_rank"] == {"query,value 768x768": (k - 1) * r}
    assert ours["factored"] is True
    assert ours["down_per_client"] == layers * (ab + (k - 1) * r * (d + n) * F32)
    assert dense["down_per_client"] == layers * (ab + d * n * F32)
    assert dense["residual_per_client"] == layers * d * n * F32
    assert ours["up_per_client"] == dense["up_per_client"] == layers * ab
    assert ours["residual_dense_over_factored"] == pytest.approx(48.0)
    assert ours["down_total"] == k * ours["down_per_client"]
    assert ours["up_total"] == k * ours["up_per_client"]
    assert by["fedit"]["down_per_client"] == by["fedit"]["up_per_client"] == layers * ab
    assert by["ffa"]["down_per_client"] == by["ffa"]["up_per_client"] == layers * d * r * F32
    assert by["flora"]["residual_rank"] == {"query,value 768x768": k * r}
    assert by["flora"]["down_per_client"] == layers * (ab + k * r * (d + n) * F32)
    assert by["full-ft"]["down_per_client"] == by["full-ft"]["up_per_client"] == layers * d * n * 4
    assert [r["method"] for r in comm_table(roberta_base_shape(), r, k)] == list(comm_methods())


def test_residual_falls_back_to_dense_when_factors_are_larger():
    # (k-1) r (d + n) >= d n: 4 clients at r=8 on 16x16 -> rank 16 factored is 512 > 256
    shape = ModelShape("small", (LayerShape("w", 16, 16, 1),))
    by = _by_method(comm_table(shape, 8, 4))
    assert by["fedex"]["factored"] is False
    assert by["fedex"]["residual_per_client"] == 16 * 16 * F32
    assert by["fedex"]["residual_dense_over_factored"] == pytest.approx(1.0)


def test_one_client_has_no_residual():
    by = _by_method(comm_table(roberta_base_shape(), 4, 1))
    assert by["fedex"]["residual_per_client"] == 0
    assert by["fedex"]["down_per_client"] == by["fedit"]["down_per_client"]


def test_llama_shape_counts_every_linear_layer():
    shape = llama7b_shape()
    assert shape.num_layers == 7 * 32
    params = sum(g.count * g.d * g.n for g in shape.layers)
    assert params == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # 6.48e9 adapted weights


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`rank` must be positive, got 0"):
        comm_table(roberta_base_shape(), 0, 3)
    with pytest.raises(ValueError, match="`clients` must be positive, got 0"):
        comm_table(roberta_base_shape(), 4, 0)


def _cli():
    app = typer.Typer()
    app.add_typer(bench_app, name="bench")

    @app.command()
    def other() -> None:  # a second command, as in the real CLI
        pass

    return app


def test_cli_json_and_table():
    runner = CliRunner()
    res = runner.invoke(_cli(), ["bench", "comm", "--shapes", "roberta-base", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert _by_method(rows)["fedex"]["residual_dense_over_factored"] == pytest.approx(48.0)
    res = runner.invoke(_cli(), ["bench", "comm", "--shapes", "roberta-base"])
    assert res.exit_code == 0, res.output
    assert "RoBERTa-base" in res.output and "48.0x" in res.output
    res = runner.invoke(_cli(), ["bench", "comm", "--shapes", "gpt5"])
    assert res.exit_code == 2
    assert "unknown ['gpt5']" in res.output


def test_fedsb_rank_is_at_most_a_layers_side_as_in_a_run():
    """Fed-SB's core is at most a layer's smaller side (a run refuses more): an explicit
    rank beyond it is refused, the default (64) is brought down to it."""
    small = ModelShape("small", (LayerShape("w", 16, 24, 2),))
    by = _by_method(comm_table(small, 4, 3))
    assert by["fedsb"]["rank"] == 16
    assert by["fedsb"]["up_per_client"] == 2 * 16 * 16 * F32  # each layer's 16 x 16 core
    with pytest.raises(ValueError, match=r"`--fedsb-rank` 17 exceeds a 16 x 24 layer's smaller"):
        comm_table(small, 4, 3, fedsb_rank=17)
    res = CliRunner().invoke(
        _cli(), ["bench", "comm", "--shapes", "roberta-base", "--fedsb-rank", "769"]
    )
    assert res.exit_code == 2 and "use --fedsb-rank 768 or less" in " ".join(res.output.split())


def test_a_head_of_no_classes_is_refused(model_never_loads):
    res = CliRunner().invoke(
        _cli(), ["bench", "comm", "--shapes", "embedded", "--num-labels", "-1"]
    )
    assert res.exit_code == 2, res.output
    assert "`--num-labels` must be >= 1, got -1" in res.output


@pytest.mark.integration
def test_embedded_shape_is_minilm_qv_with_a_five_class_head():
    shape = embedded_shape(8)
    assert shape.layers == (LayerShape("query,value", 384, 384, 12),)
    assert sorted(shape.extra) == [(5,), (5, 384)]
    by = _by_method(comm_table(shape, 8, 3))
    head = (5 * 384 + 5) * F32
    ab = 12 * 2 * 8 * 384 * F32
    assert by["fedex"]["extra_bytes"] == head
    assert by["fedex"]["down_per_client"] == head + ab + 12 * 16 * 768 * F32
