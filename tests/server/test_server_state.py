"""Server.state_dict / load_state_dict: a restored server carries on bit for bit."""

import json

import pytest
import torch

from fedexlora.core.aggregation import residuals_to_flat
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.server import ClientUpload, Server
from fedexlora.server.snapshot import ServerStateMismatch

SHAPES = {"l0": (6, 5), "l1": (5, 7), "l2": (4, 4)}

KINDS = {  # every kind of state the server keeps
    "fedex": {},
    "residual_rank": {"residual_rank": 1},  # lossy: feedback
    "side_rank": {"side_rank": 1},
    "flora": {"method": "flora"},  # re-initialised from a seeded generator each round
    "ffa": {"method": "ffa"},
    "fedit": {"method": "fedit"},
    "hetero": {"client_layers": {1: 1, 3: 1}},  # clients 1 and 3 train rank 1: remainders
    "rare": {"num_clients": 50, "fraction": 0.04},  # payloads say keep=False, resets
}


def _server(kind="fedex", rank=2, shapes=SHAPES, **over):
    g = torch.Generator().manual_seed(0)
    state = AdapterState(
        factors={
            n: (0.1 * torch.randn(rank, s[1], generator=g), torch.zeros(s[0], rank))
            for n, s in shapes.items()
        },
        extra={"head.weight": torch.randn(3, 4, generator=g)},
    )
    layers = {n: LayerInfo(2.0, False, rank, s) for n, s in shapes.items()}
    kw = {"num_clients": 6, "fraction": 0.5, "seed": 3, **KINDS[kind], **over}
    if "client_layers" in kw:
        kw["client_layers"] = {
            c: {n: LayerInfo(3.0, False, r, s) for n, s in shapes.items()}
            for c, r in kw["client_layers"].items()
        }
    return Server(state, layers, **kw)


def _rounds(server: Server, rounds: int) -> tuple[dict, list]:
    """Drives ``rounds`` rounds with uploads seeded by the round; returns all it saw."""
    seen, log = {}, []
    for rnd in range(server.round + 1, server.round + rounds + 1):
        g = torch.Generator().manual_seed(1000 + rnd)
        uploads = []
        for c in server.sample(rnd):
            p = server.payload_for(c)
            seen.update({f"{rnd}.payload{c}.{k}": v for k, v in p.to_flat().items()})
            log.append((rnd, c, p.round, p.version, p.reset, p.keep))
            start = server.sent.get(c, server.upload_template())
            factors = {
                n: (
                    None if A is None else A + 0.1 * torch.randn(A.shape, generator=g),
                    B + 0.1 * torch.randn(B.shape, generator=g),
                )
                for n, (A, B) in start.factors.items()
            }
            extra = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in start.extra.items()}
            n_ex = int(torch.randint(3, 40, (1,), generator=g))
            uploads.append(ClientUpload(c, AdapterState(factors, extra), n_ex))
        out = server.aggregate(uploads)
        seen.update(
            {f"{rnd}.{k}": v for k, v in residuals_to_flat("residual", out.residuals).items()}
        )
        seen.update({f"{rnd}.state.{k}": v for k, v in server.state.to_flat().items()})
        log.append((out.accepted, out.weights, out.deviation, out.feedback_norm, server.nbytes()))
        log.append((server.round, server.version, dict(server.client_version)))
    return seen, log


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _through_json(state: dict) -> dict:
    """What a checkpoint on disk gives back: the JSON part re-parsed, the tensors as read."""
    rest = {k: v for k, v in state.items() if k != "tensors"}
    return {**json.loads(json.dumps(rest)), "tensors": state["tensors"]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_restored_server_carries_on_identically(kind):
    original = _server(kind)
    _rounds(original, 3)
    state = original.state_dict()
    restored = _server(kind)
    restored.load_state_dict(_through_json(state))
    after = restored.state_dict()  # the same state back, tensors and all
    _same(state["tensors"], after["tensors"])
    assert {k: v for k, v in after.items() if k != "tensors"} == json.loads(
        json.dumps({k: v for k, v in state.items() if k != "tensors"})
    )
    want_t, want_log = _rounds(original, 3)
    got_t, got_log = _rounds(restored, 3)
    assert got_log == want_log  # payload kinds, weights, deviations, memory, versions
    _same(want_t, got_t)  # payloads, residuals and global states, bit for bit
    assert any(k.split(".")[1].startswith("payload") for k in want_t)


def test_state_dict_holds_every_part_and_copies():
    server = _server("hetero", residual_rank=1)
    _rounds(server, 3)
    state = server.state_dict()
    assert list(state) == [
        "round",
        "version",
        "method",
        "client_version",
        "history_versions",
        "remainder_clients",
        "last_sizes",
        "sent_clients",
        "client_rank",
        "tensors",
    ]
    heads = {k.split(".")[0] for k in state["tensors"]}
    assert {"state", "base_delta", "feedback", "remainder1", "sent1"} <= heads
    assert {f"history{v}" for v in state["history_versions"]} <= heads
    json.dumps({k: v for k, v in state.items() if k != "tensors"})  # JSON-able
    for t in state["tensors"].values():  # copies, not the server's own tensors
        t.zero_()
    assert server.state.to_flat()["extra.head.weight"].abs().sum() > 0
    restored = _server("hetero", residual_rank=1)
    fresh = server.state_dict()
    restored.load_state_dict(fresh)
    for t in fresh["tensors"].values():  # load copies too (assign=False)
        t.zero_()
    _same(restored.state_dict()["tensors"], server.state_dict()["tensors"])


def _loaded_state():
    server = _server("fedex")
    _rounds(server, 3)
    return server.state_dict()


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        ({"shapes": {"l0": (6, 5), "l1": (5, 7)}}, ServerStateMismatch, "state: unexpected \\["),
        ({"rank": 3}, ServerStateMismatch, r"state.lora.l0.A: shape \(2, 5\), expected \(3, 5\)"),
        (
            {"shapes": {**SHAPES, "l2": (4, 5)}},
            ServerStateMismatch,
            r"base_delta.l2: shape \(4, 4\), expected \(4, 5\)",
        ),
        ({"method": "fedit"}, ServerStateMismatch, "for method 'fedex', not 'fedit'"),
        ({"num_clients": 2}, ServerStateMismatch, "client [2-5]: the server has 2 clients"),
    ],
)
def test_load_state_dict_refuses_another_servers_state(target, error, message):
    state = _loaded_state()
    server = _server("fedex", **target)
    before = server.state_dict()
    with pytest.raises(error, match=message):
        server.load_state_dict(state)
    after = server.state_dict()  # untouched
    _same(before.pop("tensors"), after.pop("tensors"))
    assert before == after


def test_a_missing_module_is_named():
    state = _loaded_state()
    server = _server("fedex", shapes={**SHAPES, "l3": (3, 3)})
    with pytest.raises(ServerStateMismatch, match=r"state: missing \['lora.l3.A', 'lora.l3.B'\]"):
        server.load_state_dict(state)


def test_a_heterogeneous_view_of_another_rank_is_refused():
    source = _server("hetero")
    _rounds(source, 3)
    state = source.state_dict()
    assert state["sent_clients"]
    other = _server("hetero", client_layers={1: 2, 3: 2})  # the same clients at rank 2
    with pytest.raises(ServerStateMismatch, match=r"sent[13].lora.l0.A: shape \(1, 5\)"):
        other.load_state_dict(state)
    plain = _server("fedex")  # no heterogeneous clients at all
    with pytest.raises(ServerStateMismatch, match="client 1: a heterogeneous view"):
        plain.load_state_dict(state)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: s.pop("client_version"), r"lacks \['client_version'\]"),
        (lambda s: s.update(extra=1), r"unexpected keys \['extra'\]"),
        (lambda s: s.update(round="3"), "round must be a non-negative integer"),
        (lambda s: s["tensors"].update({"history99.l0.U": torch.zeros(6, 1)}), "history99"),
        (
            lambda s: s["tensors"].update({"base_delta.l1.U": torch.zeros(5, 1)}),
            r"need U and V, or dense; got \[\"base_delta.l1 \['U', 'dense'\]\"\]",
        ),
        (lambda s: s["tensors"].update({"base_delta.l0": torch.zeros(6, 5)}), "base_delta.l0"),
        (lambda s: s.update(version=s["round"] + 1), "is past round"),
        (lambda s: s.update(history_versions=[]), r"unexpected tensors \['history"),
        (lambda s: s["client_version"].update({"0": 99}), r"versions \[99\] are past"),
    ],
)
def test_load_state_dict_refuses_a_malformed_state(damage, message):
    state = _loaded_state()
    damage(state)
    server = _server("fedex")
    with pytest.raises(ValueError, match=message) as err:
        server.load_state_dict(state)
    assert not isinstance(err.value, ServerStateMismatch)
    assert server.round == 0 and not server.history and not server.base_delta


def _write_legacy_checkpoint(path, server):
    """The checkpoint layout written before Server.state_dict existed (the checkpoint
    module read the server's fields itself), frozen here so that old runs keep resuming."""
    from safetensors.torch import save_file

    flat = {f"state.{k}": v for k, v in server.state.to_flat().items()}
    flat.update(residuals_to_flat("base_delta", server.base_delta))
    flat.update(residuals_to_flat("feedback", server.feedback))
    for v, res in server.history.items():
        flat.update(residuals_to_flat(f"history{v}", res))
    for c, res in server.remainder.items():
        flat.update(residuals_to_flat(f"remainder{c}", res))
    path.mkdir(parents=True)
    save_file(
        {k: t.contiguous().clone() for k, t in flat.items()}, str(path / "tensors.safetensors")
    )
    info = {
        "format": 1,
        "round": server.round,
        "version": server.version,
        "method": server.method,
        "client_version": {str(k): v for k, v in server.client_version.items()},
        "history_versions": sorted(server.history),
        "remainder_clients": sorted(server.remainder),
        "last_sizes": {k: list(v) for k, v in server.last_sizes.items()},
        "files": {"tensors.safetensors": (path / "tensors.safetensors").stat().st_size},
        "note": "from before",
    }
    (path / "meta.json").write_text(json.dumps(info, indent=1))


@pytest.mark.parametrize("kind", ["fedex", "residual_rank", "side_rank", "ffa", "hetero", "rare"])
def test_checkpoints_written_before_state_dict_still_load(tmp_path, kind):
    from fedexlora.run.checkpoint import load_checkpoint

    original = _server(kind)
    _rounds(original, 4)
    _write_legacy_checkpoint(tmp_path / "round-0004", original)
    restored = _server(kind)
    assert load_checkpoint(tmp_path / "round-0004", restored)["note"] == "from before"
    want_t, want_log = _rounds(original, 3)
    got_t, got_log = _rounds(restored, 3)
    _same(want_t, got_t)
    if kind != "hetero":  # old checkpoints lack the views: their bytes count again once resent
        assert got_log == want_log


@pytest.mark.parametrize("kind", ["fedex", "hetero", "side_rank"])
def test_checkpoint_round_trip_through_disk(tmp_path, kind):
    from fedexlora.run.checkpoint import load_checkpoint, save_checkpoint

    original = _server(kind)
    _rounds(original, 3)
    path = save_checkpoint(tmp_path, original, meta={"rows": []})
    restored = _server(kind)
    assert load_checkpoint(path, restored)["rows"] == []
    want_t, want_log = _rounds(original, 3)
    got_t, got_log = _rounds(restored, 3)
    _same(want_t, got_t)
    assert got_log == want_log  # hetero too: the views are in the checkpoint now
    with pytest.raises(ValueError, match=r"own keys \['round'\]"):
        save_checkpoint(tmp_path, original, meta={"round": 1})


def test_checkpoint_of_another_model_is_refused_not_called_corrupt(tmp_path):
    from fedexlora.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    original = _server("fedex")
    _rounds(original, 2)
    path = save_checkpoint(tmp_path, original, meta={})
    with pytest.raises(CheckpointError, match="does not match the model: .*shape") as err:
        load_checkpoint(path, _server("fedex", rank=3))
    assert not err.value.corrupt
