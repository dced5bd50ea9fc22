"""Upload validation: bad or hostile uploads are rejected and never reach the global model."""

import math
import re
import warnings

import pytest
import torch

from fedexlora import aggregate_states
from fedexlora.core.state import AdapterState
from fedexlora.server import ClientUpload, Server


def _state(seed, d=6, n=5, r=2):
    g = torch.Generator().manual_seed(seed)
    return AdapterState(
        factors={
            "l0": (torch.randn(r, n, generator=g), torch.randn(d, r, generator=g)),
            "l1": (torch.randn(r, d, generator=g), torch.randn(n, r, generator=g)),
        },
        extra={"head.weight": torch.randn(3, d, generator=g)},
    )


def _server(**kw):
    """A server of 3 clients that has sent each of them round 1's payload."""
    from fedexlora.core.state import LayerInfo

    layers = {"l0": LayerInfo(1.0, False, 2, (6, 5)), "l1": LayerInfo(1.0, False, 2, (5, 6))}
    server = Server(_state(0), layers, num_clients=3, **kw)
    for c in range(3):
        server.payload_for(c)
    return server


def _bad(kind):
    s = _state(9)
    if kind == "missing key":
        del s.factors["l1"]
    elif kind == "extra key":
        s.extra["evil.weight"] = torch.zeros(2)
    elif kind == "wrong shape":
        s.factors["l0"] = (torch.zeros(2, 7), s.factors["l0"][1])
    elif kind == "wrong rank":
        s.factors["l0"] = (torch.zeros(3, 5), torch.zeros(6, 3))
    elif kind == "int dtype":
        s.extra["head.weight"] = torch.zeros(3, 6, dtype=torch.int64)
    elif kind == "nan":
        s.factors["l0"][1][0, 0] = float("nan")
    elif kind == "inf":
        s.extra["head.weight"][1, 1] = float("inf")
    elif kind == "huge norm":
        s.factors["l1"] = (s.factors["l1"][0] * 1e4, s.factors["l1"][1])
    elif kind == "overflowing product":  # finite factors whose B A is not finite in fp32
        s.factors["l0"] = (s.factors["l0"][0] * 1e20, s.factors["l0"][1] * 1e20)
    elif kind == "float8 dtype":
        s.extra["head.weight"] = s.extra["head.weight"].to(torch.float8_e4m3fn)
    return s


CASES = [
    ("missing key", 10, "missing keys \\['lora.l1.A'"),
    ("extra key", 10, "unexpected keys \\['extra.evil.weight'\\]"),
    ("wrong shape", 10, "lora.l0.A: shape \\(2, 7\\), expected \\(2, 5\\)"),
    ("wrong rank", 10, "lora.l0.A: shape \\(3, 5\\)"),
    ("int dtype", 10, "dtype torch.int64, expected one of fp64, fp32, bf16, fp16"),
    ("float8 dtype", 10, "dtype torch.float8_e4m3fn, expected one of fp64, fp32, bf16"),
    ("overflowing product", 10, "lora.l0: its update B A is too large to aggregate"),
    ("nan", 10, "lora.l0.B: contains NaN or Inf"),
    ("inf", 10, "extra.head.weight: contains NaN or Inf"),
    ("huge norm", 10, "exceeds max_update_norm 100"),
    ("zero examples", 0, "num_examples must be a positive integer, got 0"),
    ("negative examples", -4, "num_examples must be a positive integer, got -4"),
    ("bool examples", True, "got True \\(a bool\\)"),
    ("fraction examples", 2.5, "got 2.5 \\(a fraction\\)"),
    ("nan examples", float("nan"), "got nan \\(not finite\\)"),
    ("text examples", "10", "got '10' \\(text\\)"),
    ("overflowing examples", 10**400, "\\(not a number a float holds\\)"),
]


@pytest.mark.parametrize("kind,n_examples,match", CASES, ids=[c[0] for c in CASES])
def test_bad_upload_is_rejected_and_aggregation_is_exact_over_the_rest(kind, n_examples, match):
    server = _server(max_update_norm=100.0)
    good = [ClientUpload(0, _state(1), 30), ClientUpload(2, _state(2), 50)]
    bad = ClientUpload(1, _bad(kind), n_examples)
    outcome = server.aggregate([good[0], bad, good[1]])
    assert outcome.accepted == [0, 2]
    assert list(outcome.rejected) == [1]
    assert re.search(match, outcome.rejected[1]), outcome.rejected[1]
    ref = aggregate_states([g.state for g in good], [30, 50], "fedex")
    for name in ref.state.factors:
        assert torch.equal(server.state.factors[name][1], ref.state.factors[name][1])
        assert torch.equal(outcome.residuals[name].to_dense(), ref.residuals[name].to_dense())
    assert torch.equal(server.state.extra["head.weight"], ref.state.extra["head.weight"])


@pytest.mark.parametrize(
    "count", [40, __import__("numpy").int64(40), 40.0, torch.tensor(40)], ids=str
)
def test_integer_valued_counts_are_accepted_and_weigh_as_integers(count):
    server = _server()
    outcome = server.aggregate([ClientUpload(0, _state(1), 10), ClientUpload(1, _state(2), count)])
    assert outcome.accepted == [0, 1] and not outcome.unchanged
    assert outcome.weights == pytest.approx({0: 0.2, 1: 0.8})


def test_a_second_upload_from_one_client_in_a_round_is_rejected():
    """Two uploads claiming one client counted it twice, and the weights (keyed by client)
    summed to less than 1: the first counts, the second is named in ``rejected``."""
    server = _server()
    first, second, other = _state(1), _state(4), _state(2)
    outcome = server.aggregate([ClientUpload(0, first, 30), ClientUpload(0, second, 30),
                                ClientUpload(2, other, 50)])  # fmt: skip
    assert outcome.accepted == [0, 2]
    assert outcome.rejected == {0: "a second upload from this client this round"}
    assert sum(outcome.weights.values()) == pytest.approx(1.0)
    ref = aggregate_states([first, other], [30, 50], "fedex")
    for name in ref.state.factors:
        assert torch.equal(outcome.residuals[name].to_dense(), ref.residuals[name].to_dense())


def test_an_upload_from_a_client_not_sent_this_rounds_payload_is_rejected():
    """Through the Python API ``aggregate`` took any client id: one outside the
    federation, one not sampled, one whose upload came again a round later. Each is now
    rejected, the rest aggregated as if it had never come."""
    server = _server()  # round 1's payloads went to clients 0, 1, 2
    one, two = ClientUpload(0, _state(1), 30), ClientUpload(1, _state(2), 50)
    outcome = server.aggregate([one, two, ClientUpload(5, _state(4), 70)])
    assert outcome.accepted == [0, 1] and list(outcome.rejected) == [5]
    assert "not sent this round's payload" in outcome.rejected[5]
    ref = aggregate_states([one.state, two.state], [30, 50], "fedex")
    for name in ref.state.factors:
        assert torch.equal(outcome.residuals[name].to_dense(), ref.residuals[name].to_dense())
    server.payload_for(1)  # round 2 samples client 1 only
    three = ClientUpload(1, _state(3), 50)
    outcome = server.aggregate([one, three])  # client 0's round-1 upload again
    assert outcome.accepted == [1] and list(outcome.rejected) == [0]
    outcome = server.aggregate([three])  # round 3: nobody was sent a payload
    assert outcome.unchanged and list(outcome.rejected) == [1]
    saved = server.state_dict()
    server.payload_for(2)
    server.load_state_dict(saved)  # back to before that payload: it was never sent
    assert list(server.aggregate([ClientUpload(2, _state(5), 10)]).rejected) == [2]


@pytest.mark.parametrize("client", [3, -1, 1.0, "1"], ids=str)
def test_a_payload_for_a_client_outside_the_federation_is_refused(client):
    server = _server()
    error = ValueError if isinstance(client, int) else TypeError
    with pytest.raises(error, match="the server has 3 clients|client_id must be an integer"):
        server.payload_for(client)


def test_all_rejected_changes_nothing():
    server = _server()
    before = server.state.clone()
    outcome = server.aggregate([ClientUpload(0, _bad("nan"), 5), ClientUpload(1, _state(3), 0)])
    assert outcome.accepted == [] and len(outcome.rejected) == 2
    assert outcome.unchanged  # the outcome says so itself, not only the CLI
    assert outcome.residuals == {}
    for k, v in before.to_flat().items():
        assert torch.equal(server.state.to_flat()[k], v)
    assert server.version == 0


def _faulty_clients(tamper):
    """A client step for the in-process engine whose every upload passes
    ``tamper(round, client, upload)`` on its way from the client to the server."""
    from fedexlora.run.client_step import local_update as real_update

    def local_update(cfg, method, model, data, rnd, client, **kwargs):
        return tamper(rnd, client, real_update(cfg, method, model, data, rnd, client, **kwargs))

    return local_update


def test_engine_records_rejections_and_warns(tiny_cfg, tmp_path):
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.report import read_metrics

    def tamper(rnd, client, up):
        if client == 1:
            A, B = next(iter(up.state.factors.values()))
            B[0, 0] = math.nan
        return up

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run_experiment(cfg, tmp_path, progress=False, local_update=_faulty_clients(tamper))
    assert any("rejected client 1" in str(w.message) for w in caught)
    on_disk = read_metrics(tmp_path / "metrics.jsonl")
    for r in on_disk:
        assert r["accepted"] == [0, 2] and "NaN or Inf" in r["rejected"]["1"]
        assert r["effective_deviation"]["max"] < 1e-5
        assert all(math.isfinite(v) for v in r["metrics"].values())
    assert "rejected client 1" in (tmp_path / "summary.md").read_text()
    assert rows == on_disk


def test_engine_all_rejected_round_says_so(tiny_cfg, tmp_path):
    from fedexlora.run.inprocess import run_experiment

    def tamper(rnd, client, up):
        up.num_examples = 0
        return up

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    rows = run_experiment(cfg, tmp_path, progress=False, local_update=_faulty_clients(tamper))
    assert rows[0]["accepted"] == [] and rows[0]["note"] == (
        "every upload was rejected; the global model is unchanged"
    )
