"""The examples run, and their global model equals the ideal computed by hand."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from conftest import load_script
from fedexlora.bridge.layers import lora_layers

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=8)

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str):
    return load_script(rel)


def _weights(model) -> dict[str, torch.Tensor]:
    """``W + s B A`` of every LoRA layer, read straight from peft, in fp64."""
    out = {}
    for name, layer in lora_layers(model).items():
        W = layer.get_base_layer().weight.detach().double()
        A = layer.lora_A["default"].weight.detach().double()
        B = layer.lora_B["default"].weight.detach().double()
        out[name] = W + float(layer.scaling["default"]) * B @ A
    return out


def hand_ideal(w0: dict, history, scale: float) -> dict[str, torch.Tensor]:
    """``M_t = M_{t-1} - s B̄_{t-1} Ā_{t-1} + sum_i p_i s B_i A_i`` from the uploads."""
    M = {n: w.clone() for n, w in w0.items()}
    prev = {n: 0.0 for n in w0}
    for _outcome, uploads in history:
        n_ex = [u.num_examples for u in uploads]
        p = [k / sum(n_ex) for k in n_ex]
        for n in M:
            As = [u.state.factors[n][0].double() for u in uploads]
            Bs = [u.state.factors[n][1].double() for u in uploads]
            M[n] = M[n] - prev[n] + sum(pi * scale * B @ A for pi, A, B in zip(p, As, Bs))
            prev[n] = (
                scale * sum(pi * B for pi, B in zip(p, Bs)) @ sum(pi * A for pi, A in zip(p, As))
            )
    return M


def test_hf_trainer_example_is_exact(tiny_bert_dir, tiny_csv, tmp_path):
    import pandas as pd

    ex = _load("examples/hf_trainer/train.py")
    df = pd.read_csv(tiny_csv)
    df["label"] = df["label"].astype("category").cat.codes
    full = Dataset.from_pandas(df)
    shards = [full.shard(3, i) for i in range(3)]
    w0 = _weights(ex.lora_model(tiny_bert_dir, 3))
    glob, server, clients, history = ex.federate(
        tiny_bert_dir, shards, 3, rounds=3, steps=4, out=str(tmp_path / "out")
    )
    assert [len(h[1]) for h in history] == [3, 3, 3]
    got, want = _weights(glob), hand_ideal(w0, history, scale=8 / 4)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    print(f"max relative error {err:.2e} of the total update")
    assert err < 1e-5, err
    # and each party's own model, given its next payload, is that same global model
    from fedexlora import apply_payload

    for c, model in enumerate(clients):
        apply_payload(model, server.payload_for(c))
        mine = _weights(model)
        gap = max(
            float(torch.linalg.norm(mine[n] - want[n]) / torch.linalg.norm(want[n])) for n in want
        )
        assert gap < 1e-6, (c, gap)


@pytest.mark.integration
def test_flower_app_example_is_exact(tiny_bert_dir, tiny_csv, monkeypatch, task_identity):
    """The user's own ServerApp and ClientApp, fedex-lora's strategy between them.

    Over the in-process grid of ``test_flower.py``: one Flower Context per node and every
    message through Flower's protobuf, as between processes. Flower's simulation runtime
    (Ray, a SuperLink) runs fedex-lora's own apps in ``test_flower_simulation.py`` and
    ``test_scale.py``; the apps are what this example adds.
    """
    from flwr.app import Context, RecordDict

    from test_flower import InProcessGrid

    app_dir = ROOT / "examples" / "flower_app"
    monkeypatch.syspath_prepend(str(app_dir))
    settings = {"model": tiny_bert_dir, "task": tiny_csv, "num-rounds": 3, "local-steps": 4}
    monkeypatch.setenv("FLOWER_APP_CONFIG", json.dumps(settings))
    from fedexlora_flower_app import client_app, server_app, task

    w0 = _weights(task.new_model(task.settings({})))
    grid = InProcessGrid(client_app.app, 3)
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config={})
    server_app.app(grid, ctx)
    assert sorted(grid.trained) == [(r, c) for r in (1, 2, 3) for c in (0, 1, 2)]
    run = server_app.LAST_RUN
    assert [sorted(o.accepted) for o, _ in run["rounds"]] == [[0, 1, 2]] * 3
    got, want = _weights(run["model"]), hand_ideal(w0, run["rounds"], scale=8 / 4)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    print(f"max relative error {err:.2e} of the total update")
    assert err < 1e-5, err
    # and every client really started from the global model: the same clients, trained
    # in-process by the API loop on models we hold, give the same global model
    from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info, make_upload

    cfg = task.settings({})
    ref = task.new_model(cfg)
    server = Server(get_state(ref), layer_info(ref), num_clients=3)
    clients = [task.new_model(cfg) for _ in range(3)]
    shards = [task.load_shard(cfg, i, 3) for i in range(3)]
    for rnd in range(1, 4):
        uploads = []
        for i in server.sample(rnd):
            apply_payload(clients[i], server.payload_for(i))
            task.train(clients[i], shards[i], 4, float(cfg["lr"]), seed=1000 * rnd + i)
            uploads.append(make_upload(clients[i], len(shards[i][2]), client_id=i))
        apply_outcome(ref, server, server.aggregate(uploads), uploads)
    want = _weights(ref)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    print(f"max relative error {err:.2e} of the total update")
    assert err < 1e-5, err
