"""``bench comm`` counts what the engines send: a real run's metrics.jsonl, method by method."""

import json

import pytest
from typer.testing import CliRunner

from fedexlora.core.methods import REGISTRY
from fedexlora.core.units import format_bytes
from fedexlora.experiments.bench import (
    bench_app,
    comm_methods,
    comm_table,
    embedded_shape,
    roberta_base_shape,
    shape_from_model,
)

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=7)

FEDERATED = [m for m, spec in REGISTRY.items() if spec.federated]
RANK, CLIENTS, LABELS, SB_RANK = 4, 3, 3, 4
# q and v are 32 x 32; intermediate.dense maps 32 -> 48: a layer that is not square, where
# A and B differ in size (RoLoRA's round 2 uploads A alone)
TARGETS = ["query", "value", "intermediate.dense"]


def _by_method(rows):
    return {r["method"]: r for r in rows}


@pytest.fixture(scope="module")
def predicted(tiny_bert_dir):
    """``comm_table`` of the tiny model as the runs below train it."""
    from fedexlora.bridge.models import load_model

    model, _ = load_model(
        tiny_bert_dir, causal=False, num_labels=LABELS, r=RANK, target_modules=TARGETS
    )
    shape, rank = shape_from_model(model, "tiny")
    assert rank == RANK
    return _by_method(comm_table(shape, rank, CLIENTS, fedsb_rank=SB_RANK))


def test_comm_lists_every_federated_method():
    assert set(FEDERATED) <= set(comm_methods())


@pytest.mark.parametrize("method", FEDERATED)
def test_comm_equals_the_bytes_a_real_run_writes(method, tiny_cfg, tmp_path, predicted):
    """Round 2 of a real run: bytes_down and bytes_up in metrics.jsonl are the table's."""
    from fedexlora.run.inprocess import run_experiment

    # Arrange: the tiny model, all clients every round, as comm_table assumes
    cfg = tiny_cfg.replace(
        methods=[method],
        rounds=2,
        num_clients=CLIENTS,
        lora_r=RANK,
        target_modules=TARGETS,
        fedsb_rank=SB_RANK,
        fedsb_init="random",
        max_train=30,
        max_test=6,
    )

    # Act
    run_experiment(cfg, tmp_path, progress=False)

    # Assert
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = next(r for r in map(json.loads, lines) if r["method"] == method and r["round"] == 2)
    want = predicted[method]
    assert (row["bytes_down"], row["bytes_up"]) == (want["down_total"], want["up_total"])
    assert row["bytes_down_max"] == want["down_per_client"]


def test_frlora_sends_its_residual_down():
    # RoBERTa-base q,v, r=4, k=3: FRLoRA folds B̄Ā - B0A0 (rank 2r, factored) into every
    # client's base, on top of (A0, B0) and what FedIT sends
    d = n = 768
    r, layers = 4, 24
    by = _by_method(comm_table(roberta_base_shape(), r, 3))
    frlora, fedit = by["frlora"], by["fedit"]
    assert frlora["residual_rank"] == {"query,value 768x768": 2 * r}
    assert frlora["factored"] is True
    assert frlora["residual_per_client"] == layers * 2 * r * (d + n) * 4
    assert frlora["down_per_client"] == fedit["down_per_client"] + frlora["residual_per_client"]
    assert frlora["up_per_client"] == fedit["up_per_client"]


def test_cli_counts_the_model_it_is_given(tiny_bert_dir):
    # Arrange: the tiny model with its default targets, as `fedexlora run` would load it
    args = ["comm", "--model", tiny_bert_dir, "--num-labels", str(LABELS), "--rank", "4"]
    args += ["--clients", "3", "--fedsb-rank", str(SB_RANK), "--shapes", "embedded"]
    shape = embedded_shape(RANK, model=tiny_bert_dir, num_labels=LABELS)
    want = comm_table(shape, RANK, CLIENTS, fedsb_rank=SB_RANK)

    # Act
    runner = CliRunner()
    as_json = runner.invoke(bench_app, [*args, "--json"])
    table = runner.invoke(bench_app, args)

    # Assert: the JSON rows are comm_table's; the table prints FRLoRA's residual
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == json.loads(json.dumps(want))
    assert table.exit_code == 0, table.output
    frlora = _by_method(want)["frlora"]
    line = next(ln for ln in table.output.splitlines() if ln.startswith("│ frlora"))
    cells = [c.strip() for c in line.split("│")[2:7]]  # down, up, down x3, up x3, residual
    keys = ("down_per_client", "up_per_client", "down_total", "up_total", "residual_per_client")
    assert cells == [format_bytes(frlora[k]) for k in keys]
    assert frlora["residual_per_client"] > 0


def _odd_b(rnd):
    from fedexlora.core.methods import RoundPlan

    return RoundPlan(train_A=False, upload_A=False) if rnd % 2 else RoundPlan()


def test_comm_equals_the_run_of_a_method_whose_plan_changes_by_round(
    tiny_cfg, tmp_path, monkeypatch, seen_updates
):
    """A toy method trains B alone in odd rounds (its round plan): B alone travels up then,
    round 1 leaves no residual, and ``bench comm`` predicts round 2 as the run sends it."""
    from fedexlora.bridge.models import load_model
    from fedexlora.core.methods import MethodSpec
    from fedexlora.core.methods.fedex import aggregate
    from fedexlora.run.inprocess import run_experiment

    # Arrange: the toy, registered for this test only, on FedEx-LoRA's server math
    toy = MethodSpec(
        name="toy_odd_b", title="odd-B (test)", paper="none", trains="B, then A and B",
        keeps_local="nothing", uploads="B_i in odd rounds, A_i and B_i in even ones",
        downloads="A, B, residual", exact=True, linear=False, bytes_per_round="-",
        aggregate=aggregate, round_plan=_odd_b,
    )  # fmt: skip
    monkeypatch.setitem(REGISTRY, toy.name, toy)
    model, _ = load_model(
        tiny_cfg.model, causal=False, num_labels=LABELS, r=RANK, target_modules=TARGETS
    )
    shape, _ = shape_from_model(model, "tiny")
    want = _by_method(comm_table(shape, RANK, CLIENTS))[toy.name]
    cfg = tiny_cfg.replace(
        methods=[toy.name], rounds=2, num_clients=CLIENTS, lora_r=RANK,
        target_modules=TARGETS, max_train=30, max_test=6,
    )  # fmt: skip
    seen, spy = seen_updates

    # Act
    run_experiment(cfg, tmp_path, progress=False, local_update=spy)

    # Assert: bytes up are the uploads', B and the head alone in round 1 (by hand: 4 r d
    # per layer, and the head), A too in round 2; round 2 is the table's, no residual
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = {r["round"]: r for r in rows if r["method"] == toy.name}
    head = 4 * (LABELS * model.config.hidden_size + LABELS)  # the classifier, fp32
    sides = [(g.d, g.n, g.count) for g in shape.layers]
    by_hand = {
        1: CLIENTS * (sum(4 * RANK * d * c for d, _, c in sides) + head),
        2: CLIENTS * (sum(4 * RANK * (d + n) * c for d, n, c in sides) + head),
    }
    for rnd in (1, 2):
        ups = [seen[(rnd, c)][2] for c in range(CLIENTS)]
        assert all((A is None) == (rnd == 1) for u in ups for A, _ in u.state.factors.values())
        assert rows[rnd]["bytes_up"] == sum(u.nbytes for u in ups) == by_hand[rnd]
    assert want["residual_per_client"] == 0
    assert (rows[2]["bytes_down"], rows[2]["bytes_up"]) == (want["down_total"], want["up_total"])
    assert rows[2]["bytes_down_max"] == want["down_per_client"]
