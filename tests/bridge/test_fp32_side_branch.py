"""An fp32 base whose residuals stay beside it (``use_side_branch``, ``--fp32-side-branch``).

Folding each residual into an fp32 weight rounds the weight: about ``6e-8 |W|``, which is
1e-5 to 1e-3 of a small update. With the side branch the model is exact to fp32's rounding
of the update itself. Measured through the model's forward pass in fp64 (each layer fed the
identity), against the ideal computed by hand from the clients' factors.
"""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info, make_upload
from fedexlora.bridge.fold import use_side_branch
from fedexlora.bridge.layers import lora_layers

SCALE = 2.0  # lora_alpha / r


def _model(path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # pretrained-sized weights (|W| ~ 1), so fp32 rounds at ~6e-8
        for p in base.parameters():
            p.mul_(50.0)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, cfg)


@torch.no_grad()
def _forward_weights(model) -> dict[str, torch.Tensor]:
    """Each LoRA layer's effective ``(d, n)`` weight, read off its forward pass in fp64."""
    m = copy.deepcopy(model).double()
    out = {}
    for name, layer in lora_layers(m).items():
        n = layer.lora_A["default"].weight.shape[1]
        eye = torch.eye(n, dtype=torch.float64)
        out[name] = (layer(eye) - layer(torch.zeros_like(eye))).T
    return out


def _federate(path, *, beside: bool, rounds: int = 3, size: float = 2e-3):
    """3 clients, each moving its factors by ``size`` (relative) per round, by hand."""
    glob = _model(path)
    clients = [_model(path) for _ in range(3)]
    if beside:
        for m in [glob, *clients]:
            use_side_branch(m)
    w0 = _forward_weights(glob)
    server = Server(get_state(glob), layer_info(glob), num_clients=3)
    g = torch.Generator().manual_seed(1)
    ideal = {k: v.clone() for k, v in w0.items()}
    for rnd in range(1, rounds + 1):
        uploads = []
        for c in server.sample(rnd):
            apply_payload(clients[c], server.payload_for(c))
            with torch.no_grad():
                for layer in lora_layers(clients[c]).values():
                    for f in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                        f.add_(size * torch.randn(f.shape, generator=g))
            uploads.append(make_upload(clients[c], 10 * (c + 1), client_id=c))
        start = _forward_weights(glob)  # the global model before the round
        p = [u.num_examples / sum(u.num_examples for u in uploads) for u in uploads]
        for name in ideal:  # W_t = W_{t-1} - s B̄ Ā (the previous adapter) + Σ p_i s B_i A_i
            lay = lora_layers(glob)[name]
            prev = (
                SCALE
                * lay.lora_B["default"].weight.double()
                @ lay.lora_A["default"].weight.double()
            )
            new = sum(
                pi * SCALE * u.state.factors[name][1].double() @ u.state.factors[name][0].double()
                for pi, u in zip(p, uploads)
            )
            ideal[name] = start[name] - prev + new
        apply_outcome(glob, server, server.aggregate(uploads), uploads)
    got = _forward_weights(glob)
    return max(
        float(torch.linalg.norm(got[n] - ideal[n]) / torch.linalg.norm(ideal[n] - w0[n]))
        for n in ideal
    )


def test_fp32_side_branch_is_exact_where_folding_into_w_rounds(tiny_llama_dir):
    into_w = _federate(tiny_llama_dir, beside=False)
    beside = _federate(tiny_llama_dir, beside=True)
    print(f"relative error of the total update: into W {into_w:.1e}, beside {beside:.1e}")
    assert into_w > 1e-5  # the rounding this option removes is really there at this size
    assert beside < 1e-6, beside


def test_use_side_branch_refuses_a_model_that_already_folded(tiny_llama_dir):
    from fedexlora import Residual, fold_residuals

    model = _model(tiny_llama_dir)
    name, layer = next(iter(lora_layers(model).items()))
    d, n = layer.lora_B["default"].weight.shape[0], layer.lora_A["default"].weight.shape[1]
    fold_residuals(model, {name: Residual((d, n), U=torch.ones(d, 1), V=torch.ones(1, n))})
    with pytest.raises(ValueError, match="before the first round"):
        use_side_branch(model)


@pytest.mark.parametrize(
    "changes,beside",
    [
        ({}, True),  # an exact method on fp32: beside the weights
        (dict(methods=["fedit"]), False),  # no residual to keep
        (dict(methods=["fedit", "fedex"]), True),  # one exact method is enough
        (dict(dp_epsilon=8.0), False),  # DP-SGD's checks are for layers without one
        (dict(fp32_side_branch=False), False),  # the user's word wins
        (dict(methods=["fedit"], fp32_side_branch=True), True),
    ],
)
def test_the_side_branch_is_the_default_for_exact_methods(tiny_cfg, changes, beside):
    cfg = tiny_cfg.replace(**{"methods": ["fedex"], **changes})
    assert cfg.fp32_side_branch_resolved is beside
    assert cfg.resolved().fp32_side_branch is beside
    assert cfg.resolved_export_format == ("adapter" if beside else "merged")
    # a resumed run keeps how it ran when the setting is unset, not today's default
    old = tiny_cfg.replace(methods=["fedex"], fp32_side_branch=False)
    assert tiny_cfg.replace(methods=["fedex"]).resolved(old).fp32_side_branch is False


def test_a_default_first_run_is_exact_on_fp32_and_writes_how_it_ran(tiny_cfg, tmp_path, capsys):
    """``fedexlora run`` at its defaults, small updates: the side branch is on, the model
    within 1e-6 of the ideal, config.toml says so, and nothing about rounding is said."""
    from fedexlora.config import load_run_config
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], lr=1e-4)
    assert cfg.fp32_side_branch is None  # unset, as a first run leaves it
    rows = run_experiment(cfg, tmp_path, progress=False)
    printed = capsys.readouterr()
    assert max(r["effective_deviation"]["max"] for r in rows) < 1e-6
    assert "rounding" not in printed.out + printed.err
    assert "fp32 rounding" not in (tmp_path / "summary.md").read_text()
    assert load_run_config(tmp_path / "config.toml").fp32_side_branch is True
    # what every client holds beside its fp32 base, in each row: the last round's is the
    # restored global model's side branches
    from fedexlora.bridge.fold import side_nbytes
    from fedexlora.run.checkpoint import latest_checkpoint
    from fedexlora.run.restore import load_task_for, restore_model

    model = restore_model(
        cfg,
        load_task_for(cfg),
        "fedex",
        latest_checkpoint(tmp_path / "checkpoints" / "fedex"),
        None,
    )[0]
    assert [r["side_bytes"] > 0 for r in rows] == [True] * len(rows)
    assert rows[-1]["side_bytes"] == side_nbytes(model)
    # beside it, the adapter's own bytes: r (in + out) fp32 numbers per adapted layer
    from fedexlora.bridge.layers import lora_layers

    shapes = [layer.base_layer.weight.shape for layer in lora_layers(model).values()]
    assert shapes and all(
        r["adapter_bytes"] == 4 * cfg.lora_r * sum(map(sum, shapes)) for r in rows
    )


@pytest.mark.parametrize("beside", [False, True])
def test_fp32_rounding_is_a_line_of_the_summary_not_a_warning(tiny_cfg, tmp_path, capsys, beside):
    """A small update on an fp32 base: summary.md gives the rounding; nothing is printed.

    The run did nothing wrong (its aggregation is exact), so no note or warning on screen.
    """
    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], lr=1e-4, fp32_side_branch=beside)
    rows = run_experiment(cfg, tmp_path, progress=False)
    worst = max(r["effective_deviation"]["max"] for r in rows)
    printed = capsys.readouterr()
    line = [x for x in (tmp_path / "summary.md").read_text().splitlines() if "fp32 rounding" in x]
    assert "rounding" not in printed.out + printed.err and "note:" not in printed.out
    if beside:
        assert worst < 1e-6 and not line
    else:
        assert worst > 1e-5, worst
        assert line == [
            f"- fp32 rounding: fedex's model is up to {worst:.2g} of a round's update from the "
            "ideal: fp32's rounding of the residuals folded into the weights (6e-8 of a "
            "weight), larger the smaller the update. "
            "`--fp32-side-branch` keeps the residuals beside the weights instead, exact to "
            "about 1e-7, for one more matmul per LoRA layer in the forward pass, which grows "
            "with the residuals held (docs/LARGE_MODELS.md)."
        ]
