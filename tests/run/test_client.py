"""The one Client: apply, train, reply, keep and resume, over the memory and disk stores.

Each engine builds a :class:`fedexlora.run.client.Client` for every client of a round:
the in-process engine on its one shared model (``SharedModel``, a ``MemoryStore``), the
Flower ClientApp on the client's own model (``OwnModel``, its Context over a
``DiskStore``). These tests drive the Client directly on tiny BERT, and check the whole
adapter (every tensor) against what it must be, not the client's own report.
"""

import ast
from pathlib import Path

import torch

from fedexlora.bridge.adapters import get_state, set_state
from fedexlora.core.messages import Payload
from fedexlora.core.methods import get_method
from fedexlora.run.build import new_model, new_server, prepare
from fedexlora.run.client import Client, OwnModel, SharedModel
from fedexlora.run.client_step import local_update
from fedexlora.run.client_store import DiskStore, MemoryStore
from fedexlora.run.restore import load_task_for
from fedexlora.training.privacy import Budget

SRC = Path(__file__).resolve().parents[2] / "src" / "fedexlora"
METHOD = "fedsa"  # personalized: each client keeps its B and head


def _run(tiny_cfg):
    cfg = tiny_cfg.replace(methods=[METHOD], local_steps=2)
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, METHOD)
    prep = prepare(cfg, tok, task)
    return cfg, model, prep


def _flat(model, **parts):
    return {k: v.detach().clone() for k, v in get_state(model, **parts).to_flat().items()}


def _equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_memory_store_client_applies_trains_replies_and_keeps_its_own_parts(tiny_cfg):
    cfg, model, prep = _run(tiny_cfg)
    server = new_server(cfg, METHOD, model)
    store = MemoryStore()
    client = Client(
        cfg, METHOD, 0, prep.train.subset(prep.parts[0]),
        SharedModel(model, server, cfg, METHOD), store, prep=prep,
    )  # fmt: skip
    assert client.update is local_update  # the default training step
    payload = server.payload_for(0)
    assert payload.reset
    client.apply(payload)
    _equal(_flat(model), server.state.to_flat())  # the shared model: the global state
    up = client.train(1)
    assert client.reply(up) is up  # in the clear: the upload itself
    client.keep(payload.version)
    kept = get_method(METHOD).kept_parts()
    trained = _flat(model, **kept)
    _equal(store.states[0], trained)  # it keeps its B and head, as trained
    assert not torch.equal(
        trained[next(iter(trained))], server.state.to_flat()[next(iter(trained))]
    )
    # another client used the shared model meanwhile; client 0 comes back (not a reset)
    set_state(model, server.state)
    again = server.payload_for(0)
    assert not again.reset
    client.apply(again)
    want = {**server.state.to_flat(), **trained}  # the global parts, its own kept ones
    _equal(_flat(model), want)
    # a reset payload starts over: the global model, nothing of its own
    client.apply(Payload(round=2, version=again.version, state=server.state, reset=True))
    _equal(_flat(model), server.state.to_flat())


def test_disk_store_client_resumes_bit_for_bit_in_a_fresh_model(tiny_cfg, tmp_path):
    cfg, model, prep = _run(tiny_cfg)
    server = new_server(cfg, METHOD, model)
    task = load_task_for(cfg)
    own, _ = new_model(cfg, task, METHOD)  # the client's own model (Flower's holder)
    store = DiskStore(tmp_path / METHOD)
    data = prep.train.subset(prep.parts[1])
    client = Client(cfg, METHOD, 1, data, OwnModel(own, "default", cfg), store, prep=prep)
    payload = server.payload_for(1)
    client.apply(payload, since=-1)
    up = client.train(1)
    assert client.reply(up) is up
    for v in (1, 2, 3):
        client.keep(v)
    assert store.versions(1) == [2, 3]  # the last two versions, on disk
    # a fresh process: a pretrained model, the state read back from the disk
    fresh, _ = new_model(cfg, task, METHOD)
    again = Client(
        cfg, METHOD, 1, data, OwnModel(fresh, "default", cfg), DiskStore(tmp_path / METHOD)
    )
    fresh_sd = fresh.state_dict()
    assert any(not torch.equal(t, fresh_sd[k]) for k, t in own.state_dict().items())
    again.holder.restore(again.store.load(1, 3))
    for k, t in own.state_dict().items():
        assert torch.equal(t, fresh.state_dict()[k]), k
    assert again.store.load(1, 1) is None  # dropped from disk
    client.keep(4, keep=False)  # told to keep nothing: it forgets its states
    assert store.versions(1) == []


def test_a_spent_dp_budget_refuses_and_the_store_keeps_the_record(tiny_cfg, tmp_path):
    cfg, model, prep = _run(tiny_cfg)
    server = new_server(cfg, METHOD, model)
    calls = []

    def update(cfg_, method, model_, data, rnd, client, **kw):
        calls.append((rnd, client, kw["dp"]))
        return local_update(cfg_, method, model_, data, rnd, client, **{**kw, "dp": None})

    for store in (MemoryStore(), DiskStore(tmp_path)):
        budget = Budget(2, 1.0, 0.1, 1.0, planned_steps=3)  # room for one round of 2 steps
        client = Client(
            cfg, METHOD, 2, prep.train.subset(prep.parts[2]),
            SharedModel(model, server, cfg, METHOD), store, prep=prep, update=update,
            budget=budget,
        )  # fmt: skip
        assert client.want == 2 and not client.refuses()
        client.apply(server.payload_for(2))
        client.train(1)
        assert calls[-1] == (1, 2, budget)  # the seam gets the client's budget
        assert budget.steps == 2 and client.refuses()  # 2 + 2 > 3: spent
        assert store.dp_record(2) == budget.record() == {
            "noise_multiplier": 1.0, "sample_rate": 0.1, "planned_steps": 3, "steps": 2,
        }  # fmt: skip


def _calls(name: str) -> set[str]:
    """The modules of src/fedexlora that call (or construct) ``name``."""
    out = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == name:
                    out.add(str(path.relative_to(SRC)))
    return out


def test_both_engines_run_the_one_client_and_its_one_secure_side():
    # every client of either engine is a Client
    assert _calls("Client") == {"run/inprocess.py", "flower/client_app.py"}
    # the client side of SecAgg+ is SecureClient's, on both engines; no one else answers
    # a stage or masks an upload
    assert _calls("SecureClient") == {"run/secure_round.py", "flower/client_app.py"}
    assert _calls("client_session_reply") == {"run/secure_client.py"}
    assert _calls("client_reply") == set()  # only SecureClient.masked's default holds it
    assert _calls("masked") >= {"run/client.py"}
    # a spent DP budget is refused in one place
    assert _calls("allows") == {"run/client.py"}
    assert _calls("refuses") == {"run/inprocess.py", "flower/client_app.py"}


def test_the_server_weighs_the_adapters_its_clients_saved_and_names_the_missing(tmp_path):
    """Clients write their adapters (meta: round, client, examples); the server adds each
    weight to what is there and names the clients whose adapter is elsewhere."""
    import json

    from fedexlora.run.layout import RunLayout

    layout = RunLayout(tmp_path)
    for c in (0, 2):
        layout.client_adapter(1, c).mkdir(parents=True)
        layout.client_adapter_meta(1, c).write_text(json.dumps({"num_examples": 10 + c}))
    missing = layout.weigh_client_adapters(1, {0: 0.25, 1: 0.5, 2: 0.25})
    assert missing == [1]
    assert json.loads(layout.client_adapter_meta(1, 0).read_text()) == {
        "num_examples": 10,
        "weight": 0.25,
    }
    assert json.loads(layout.client_adapter_meta(1, 2).read_text())["weight"] == 0.25
    assert not layout.client_adapter(1, 1).exists()  # nothing made up for the missing
