"""A round's ``server_seconds`` is the server's own work in it, clear or secure.

Every bound is a comparison with times measured in the same run (the steps the round must
cover, measured inside the server's timed calls, or the whole round around it), never a
wall-clock limit.
"""

import math
import time

import pytest
import torch

from fedexlora.core.messages import ClientUpload
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.secagg import protocol
from fedexlora.secagg.protocol import ClientSession
from fedexlora.secagg.rounds import SecureRound, client_reply, client_session_reply
from fedexlora.server import aggregation as aggregation_module
from fedexlora.server.server import Server


def _server(k=3, r=3, d=40, n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = {f"l{i}": LayerInfo(2.0, False, r, (d, n)) for i in range(2)}
    factors = {
        name: (torch.randn(r, n, generator=g), torch.randn(d, r, generator=g) * 0.1)
        for name in layers
    }
    state = AdapterState(factors=factors, extra={"head": torch.randn(3, generator=g)})
    return Server(state, layers, method="fedex", num_clients=k, seed=1), g


def _upload(server, c, rnd, g):
    flat = {
        key: t + 0.05 * torch.randn(t.shape, generator=g)
        for key, t in server.upload_template(rnd).to_flat().items()
    }
    return ClientUpload(c, AdapterState.from_flat(flat), 10 + 7 * c, 0.5 + c)


class _Stopwatch:
    """Seconds spent in each wrapped function, per call.

    Wrap steps that run inside the server's own timed calls (its aggregation math,
    SecAgg+'s unmasking), not those calls themselves: the wrapper's overhead would then
    fall outside what the server can count.
    """

    def __init__(self):
        self.calls: dict[str, list[float]] = {}

    def wrap(self, monkeypatch, owner, name):
        orig = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.calls.setdefault(name, []).append(time.perf_counter() - t0)

        monkeypatch.setattr(owner, name, timed)


def _secure_round(server, rnd, g):
    """One secure round over in-process client sessions, as an engine runs it.

    Returns the round's wall seconds (first payload to the server's outcome), the secure
    round, and the seconds its ``exchange`` spent in the clients.
    """
    clients = [0, 1, 2]
    t0 = time.perf_counter()
    sround = SecureRound(server.upload_template(rnd), "fedex", clients, seed=rnd)
    sessions = {c: ClientSession(c) for c in clients}
    setups = sround.setup()
    in_clients = [0.0]

    def exchange(stage, messages):
        t = time.perf_counter()
        if stage == "setup":
            messages = setups
        out = {c: client_session_reply(sessions[c], stage, m) for c, m in messages.items()}
        in_clients[0] += time.perf_counter() - t
        return out

    sround.keys(exchange)
    collecting = sround.collect()
    masked = {}
    for c in clients:
        server.payload_for(c)
        up = _upload(server, c, rnd, g)
        masked[c] = client_reply(sessions[c], setups[c], collecting[c], up, seed=0, rnd=rnd)
    sums = sround.finish(masked, exchange)
    server.aggregate_secure(sums, sorted(sround.session.survivors), protocol_seconds=sround.seconds)
    return time.perf_counter() - t0, sround, in_clients[0]


def _watch_aggregation(monkeypatch) -> _Stopwatch:
    watch = _Stopwatch()
    watch.wrap(monkeypatch, protocol.ServerSession, "take_unmask")
    watch.wrap(monkeypatch, aggregation_module, "aggregate_states")
    watch.wrap(monkeypatch, Server, "_commit")
    return watch


def test_a_secure_round_counts_its_unmasking_and_aggregation(monkeypatch):
    watch = _watch_aggregation(monkeypatch)
    server, g = _server()
    for rnd in (1, 2):
        wall, sround, in_clients = _secure_round(server, rnd, g)
        i = rnd - 1
        covered = sum(watch.calls[k][i] for k in ("take_unmask", "aggregate_states", "_commit"))
        assert server.round == rnd
        assert sround.seconds >= watch.calls["take_unmask"][i]
        assert server.last_round_seconds >= covered, (rnd, server.last_round_seconds, covered)
        # the clients' replies are their work, and each round only its own: what the
        # server counts fits in the round's wall time less the clients' share of it
        assert sround.seconds <= wall - in_clients
        assert server.last_round_seconds <= wall - in_clients


def test_a_clear_round_counts_its_payloads_and_aggregation(monkeypatch):
    watch = _Stopwatch()
    watch.wrap(monkeypatch, aggregation_module, "aggregate_states")
    watch.wrap(monkeypatch, Server, "_commit")
    server, g = _server()
    for rnd in (1, 2):
        t0 = time.perf_counter()
        ups = []
        for c in server.sample(rnd):
            server.payload_for(c)
            ups.append(_upload(server, c, rnd, g))
        server.aggregate(ups, effective=False)
        wall = time.perf_counter() - t0
        i = rnd - 1
        covered = watch.calls["aggregate_states"][i] + watch.calls["_commit"][i]
        assert covered <= server.last_round_seconds <= wall


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_protocol_seconds_must_be_a_duration(bad):
    server, _ = _server()
    with pytest.raises(ValueError, match="protocol_seconds must be finite and >= 0"):
        server.aggregate_secure(None, [], protocol_seconds=bad)
    assert server.round == 0


def test_a_secure_run_reports_the_rounds_server_seconds(tiny_cfg, monkeypatch):
    """The in-process engine: each row's ``server_seconds`` holds its round's unmasking
    and aggregation (measured here), and fits in the round's ``seconds``."""
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    watch = _watch_aggregation(monkeypatch)
    cfg = tiny_cfg.replace(methods=["fedex"], secure_aggregation=True, rounds=2).validate()
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    rows, _, _ = run_method(cfg, "fedex", prepare(cfg, tok, task), progress=False, model=model)
    assert [r["accepted"] for r in rows] == [[0, 1, 2]] * 2
    for i, row in enumerate(rows):
        covered = sum(watch.calls[k][i] for k in ("take_unmask", "aggregate_states", "_commit"))
        assert covered <= row["server_seconds"] <= row["seconds"], (row["round"], covered)
