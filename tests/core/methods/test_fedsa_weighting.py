"""FedSA-LoRA weights its clients as its release does unless the run says otherwise.

The release (Pengxin-Guo/FedSA-LoRA, FederatedScope's ``ClientsAvgAggregator``) weights
each client by the samples it processed in the round: a fixed number of local steps of
one batch size in its configs (``batch_or_epoch: batch``), the same for every client, so
uniform. ``fedsa`` defaults to uniform weights; ``--weighting examples`` weights by
local dataset size; every other method keeps ``examples`` as its default."""

import dataclasses

import pytest
import torch

from fedexlora.core.methods import REGISTRY
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.server import ClientUpload, Server

SIZES = [10, 30, 60]  # local dataset sizes: far from uniform


def _round(method, weighting=None):
    """One round of three clients with different dataset sizes: (server's A, the uploads)."""
    info = {"m": LayerInfo(scale=2.0, fan_in_fan_out=False, rank=2, shape=(6, 5))}
    g = torch.Generator().manual_seed(0)
    state = AdapterState(factors={"m": (torch.randn(2, 5, generator=g), torch.zeros(6, 2))})
    server = Server(state, info, method=method, num_clients=3, weighting=weighting)
    uploads = []
    for c in server.sample(1):
        server.payload_for(c)
        A = torch.randn(2, 5, generator=g)
        B = None if "B" in REGISTRY[method].keeps else torch.randn(6, 2, generator=g)
        uploads.append(ClientUpload(c, AdapterState(factors={"m": (A, B)}), SIZES[c]))
    out = server.aggregate(uploads)
    assert sorted(out.accepted) == [0, 1, 2]
    return server, [u.state.factors["m"][0].double() for u in uploads]


def test_fedsa_averages_A_uniformly_unless_the_run_asks_for_dataset_sizes():
    server, As = _round("fedsa")
    assert server.weighting == "uniform"
    mean = sum(As) / len(As)
    assert torch.allclose(server.state.factors["m"][0].double(), mean, atol=1e-6)
    server, As = _round("fedsa", weighting="examples")
    p = torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    weighted = sum(pi * A for pi, A in zip(p, As))
    assert torch.allclose(server.state.factors["m"][0].double(), weighted, atol=1e-6)
    assert not torch.allclose(weighted, mean, atol=1e-3)  # the two weightings differ here


def test_other_methods_keep_dataset_size_weights_by_default():
    assert {m for m, s in REGISTRY.items() if s.weighting != "examples"} == {"fedsa"}
    server, As = _round("fedit")
    assert server.weighting == "examples"
    p = torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    weighted = sum(pi * A for pi, A in zip(p, As))
    assert torch.allclose(server.state.factors["m"][0].double(), weighted, atol=1e-6)


def test_a_method_spec_refuses_an_unknown_weighting():
    with pytest.raises(ValueError, match="`weighting` must be 'examples' or 'uniform'"):
        dataclasses.replace(REGISTRY["fedsa"], weighting="samples")


def test_run_config_leaves_the_weighting_to_each_method(tiny_cfg):
    """No ``weighting`` given: each method's server uses its own; one given: every server."""
    from fedexlora.run.build import new_model, new_server
    from fedexlora.run.restore import load_task_for

    cfg = tiny_cfg.replace(methods=["fedsa", "fedex"])
    assert cfg.weighting is None and not cfg.errors()
    assert "`weighting` must be one of" in " ".join(cfg.replace(weighting="size").errors())
    task = load_task_for(cfg)
    model, _ = new_model(cfg, task, "fedsa")
    assert new_server(cfg, "fedsa", model).weighting == "uniform"
    assert new_server(cfg, "fedex", model).weighting == "examples"
    forced = cfg.replace(weighting="examples")
    assert new_server(forced, "fedsa", model).weighting == "examples"
