"""A ClientApp process holds one model whichever partitions it serves (issue #58).

A client without its own model in the process's cache takes another partition's (or a
spare) and restores its own state into it, as the in-process engine's clients share one
model. The reused model must be the client's model, bit for bit, in every tensor: the
one a deployment's fresh process builds from the pretrained weights and the client's
state (``FEDEXLORA_CLIENT_MODEL_CACHE=0``).

Over the in-process grid of ``test_flower.py`` (the real ClientApp and strategy, every
message through Flower's protobuf): every train message of rounds 2 and 3 after the
first is served by the model another partition left.
"""

import pytest
import torch

from fedexlora.bridge.layers import lora_layers
from fedexlora.run.inprocess import run_experiment
from test_flower_parity import _close, _flower

pytestmark = pytest.mark.slow(seconds=12)


def _whole(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model (parameters, buffers, side branches) and each adapted
    layer's effective weight."""
    from fedexlora.bridge.fold import effective_weight

    out = {f"sd.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for n, layer in lora_layers(model).items():
        out[f"eff.{n}"] = effective_weight(layer).detach().clone()
    return out


@pytest.mark.parametrize("prec", [dict(dtype="fp32"), dict(dtype="bf16")], ids=["fp32", "bf16"])
def test_a_reused_model_is_the_clients_own_bit_for_bit(
    tiny_cfg, tmp_path, prec, monkeypatch, task_identity
):
    from fedexlora.flower import client_app
    from fedexlora.run.build import new_model
    from fedexlora.run.client import OwnModel

    monkeypatch.setattr(client_app, "_MAX_MODELS", 1)
    monkeypatch.setattr(client_app, "_MODELS", type(client_app._MODELS)())
    served, compared, real = [], [], client_app._client_model

    def checked(cfg, task, method, context, pid, since, spare, store, fingerprint):
        model = real(cfg, task, method, context, pid, since, spare, store, fingerprint)
        served.append((id(model), pid, since))
        if since >= 0:  # what a fresh process builds: pretrained weights + the state
            fresh = new_model(cfg, task, method)[0]
            adapter = client_app.client_adapter_name(cfg, method, pid)
            client_app._activate(fresh, adapter)
            OwnModel(fresh, adapter, cfg).restore(store.load(pid, since))
            want, got = _whole(fresh), _whole(model)
            assert want.keys() == got.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), (pid, since, k)
            compared.append(pid)
        return model

    monkeypatch.setattr(client_app, "_client_model", checked)
    # lr large enough that every round folds a residual that changes the weights' bits
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=3, lr=2e-2, **prec)
    rows, _ = _flower(cfg.replace(engine="flower"), tmp_path / "flower")
    # one model in the process, passed from partition to partition
    assert len({m for m, _, _ in served}) == 1
    assert len(client_app._MODELS) == 1
    assert sorted(compared) == [0, 0, 1, 1, 2, 2]  # rounds 2 and 3, every client
    # and the clients trained the in-process engine's global model: the same run
    _close(rows, run_experiment(cfg, tmp_path / "local", progress=False))
