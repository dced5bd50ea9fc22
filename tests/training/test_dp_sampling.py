"""DP's plan is made for the clients the server actually samples.

Both ask :func:`fedexlora.core.sampling.sample_size`: with 5 clients at fraction 0.5 the
server samples 3 a round (half up), and each client's budget is planned for its share of
3 in 5, not 2 in 5 (Python's ``round``, half to even), which had clients refused before
they had trained their share.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from fedexlora.core.sampling import sample_size
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.server.server import Server
from fedexlora.training.privacy import planned_rounds


def _server(num_clients: int, fraction: float) -> Server:
    layers = {"l": LayerInfo(1.0, False, 2, (3, 4))}
    state = AdapterState(factors={"l": (torch.zeros(2, 4), torch.zeros(3, 2))})
    return Server(state, layers, num_clients=num_clients, fraction=fraction)


@pytest.mark.parametrize(
    "clients, fraction, per_round",
    [(5, 0.5, 3), (10, 0.25, 3), (3, 0.5, 2), (7, 0.5, 4), (10, 0.05, 1), (4, 0.1, 1),
     (20, 0.3, 6), (5, 1.0, 5)],
)  # fmt: skip
def test_plan_and_server_sample_the_same_clients_per_round(clients, fraction, per_round):
    server = _server(clients, fraction)
    assert sample_size(clients, fraction) == server.sample_size() == per_round
    assert len(server.sample(1)) == per_round
    for rounds in (1, 4, 10, 25):
        cfg = SimpleNamespace(rounds=rounds, num_clients=clients, fraction=fraction)
        # each client is planned for its expected share of the server's samplings
        assert planned_rounds(cfg) == math.ceil(rounds * per_round / clients)


def test_dp_refuses_only_clients_beyond_their_share_and_budget(tiny_cfg):
    """``--dp-epsilon 8 --clients 5 --fraction 0.5``: no client is refused before it has
    spent its budget or trained its share of the rounds, and none spends beyond it."""
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=8.0, dp_delta=1e-3, num_clients=5,
                           fraction=0.5, rounds=5, local_steps=1).validate()  # fmt: skip
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    rows, _, _ = run_method(cfg, "fedex", prepare(cfg, tok, task), progress=False, model=model)
    per_round = {len(r["sampled"]) for r in rows}
    assert per_round == {3}  # what the server sampled, read from the run
    share = math.ceil(cfg.rounds * 3 / cfg.num_clients)  # 3 rounds of 5 per client
    times: dict[int, int] = {}
    steps = {c: 0 for c in range(cfg.num_clients)}
    for row in rows:
        clients = row["privacy"]["clients"]
        for c in row["sampled"]:
            times[c] = times.get(c, 0) + 1
            if c in row["privacy"]["refused"]:
                assert steps[c] == clients[str(c)]["planned_steps"], (row["round"], c)
                assert times[c] > share, f"client {c} refused at its sampling {times[c]}"
        for cid, rec in clients.items():
            assert rec["planned_steps"] == share * cfg.local_steps
            assert rec["steps"] <= rec["planned_steps"]
            assert rec["epsilon"] <= cfg.dp_epsilon * (1 + 1e-6), (row["round"], cid)
            steps[int(cid)] = rec["steps"]
    assert max(times.values()) >= share, "the seed must sample a client its full share"
    assert all(steps[c] == min(t, share) for c, t in times.items())
