"""Fed-SB (--method fedsb): frozen shared A and B, a trained r x r core, exact averaging."""

import pytest
import torch


def _bases(model):
    from fedexlora.bridge.layers import lora_layers

    return {
        name: (
            layer.lora_A["default"].weight.detach().clone(),
            layer.lora_B["default"].basis.weight.detach().clone(),
        )
        for name, layer in lora_layers(model).items()
    }


def _effective(model):
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.bridge.layers import lora_layers

    return {name: effective_weight(layer) for name, layer in lora_layers(model).items()}


@pytest.mark.parametrize("init", ["gradient", "random"])
def test_fedsb_global_model_is_the_average_of_the_clients_models(tiny_cfg, init):
    """Each round's effective weights equal, by hand in fp64, W0 + s B (sum p_i R_i) A."""
    from fedexlora.bridge.fold import base_weight
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for

    cfg = tiny_cfg.replace(methods=["fedsb"], fedsb_rank=6, fedsb_init=init).validate()
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedsb")
    bases = _bases(model)
    other = _bases(new_model(cfg, task, "fedsb")[0])  # another process, e.g. a client
    for name, (A, B) in bases.items():
        assert torch.equal(A, other[name][0]) and torch.equal(B, other[name][1])
        assert A.shape == (6, A.shape[1]) and B.shape == (B.shape[0], 6)
        eye = torch.eye(6, dtype=torch.float64)
        assert torch.allclose(A.double() @ A.double().T, eye, atol=1e-5)  # orthonormal
        assert torch.allclose(B.double().T @ B.double(), eye, atol=1e-5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "lora" in n]
    assert trainable and all(n.endswith("core.weight") for n in trainable), trainable
    w0 = {name: base_weight(layer) for name, layer in lora_layers(model).items()}
    scale = {name: float(layer.scaling["default"]) for name, layer in lora_layers(model).items()}
    prep = prepare(cfg, tok, task)
    uploads, seen = [], []
    from fedexlora.run.client_step import local_update as real_update

    def keep(*args, **kwargs):  # what the server receives
        uploads.append(real_update(*args, **kwargs))
        return uploads[-1]

    def after_round(row, server, mdl):
        total = sum(u.num_examples for u in uploads)
        eff = _effective(mdl)
        for name, (A, B) in bases.items():
            R = sum(u.num_examples / total * u.state.factors[name][1].double() for u in uploads)
            ideal = w0[name] + scale[name] * (B.double() @ R @ A.double())
            err = (eff[name] - ideal).norm() / (ideal - w0[name]).norm()
            seen.append(float(err))
        for u in uploads:  # what a client sends: the r x r core only
            for name, (A, R) in u.state.factors.items():
                assert A is None and R.shape == (6, 6), (name, A, R.shape)
        uploads.clear()

    rows, model, _ = run_method(
        cfg, "fedsb", prep, progress=False, model=model, after_round=after_round,
        local_update=keep,
    )  # fmt: skip
    assert len(seen) == len(bases) * cfg.rounds
    assert max(seen) < 1e-5, seen
    after = _bases(model)
    for name in bases:  # A and B never moved
        assert torch.equal(after[name][0], bases[name][0])
        assert torch.equal(after[name][1], bases[name][1])


def test_fedsb_gradient_init_is_the_svd_of_a_sign_step(tiny_cfg):
    """The authors' init: B S A is the rank-r SVD part of -lr/T sign(G), R = S / scale."""
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.build import new_model
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.local import encode, estimate_gradients

    cfg = tiny_cfg.replace(methods=["fedsb"], fedsb_rank=4, fedsb_init="gradient").validate()
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedsb")
    plain, _ = new_model(cfg.replace(methods=["fedex"]), task, "fedex")
    g = torch.Generator().manual_seed(cfg.seed)
    pick = torch.randperm(len(task.train), generator=g)[: cfg.fedsb_init_samples].tolist()
    data = encode(task.train.select(pick), tok, kind=task.kind, max_length=cfg.max_length)
    layers = lora_layers(plain)
    grads = estimate_gradients(
        plain, data, samples=len(data), batch_size=cfg.batch_size, seed=0, layers=layers
    )
    T = cfg.rounds * cfg.local_steps
    for name, layer in lora_layers(model).items():
        step = -(cfg.lr / T) * torch.sign(grads[name].double())
        U, S, Vh = torch.linalg.svd(step)
        best = U[:, :4] @ torch.diag(S[:4]) @ Vh[:4]  # Eckart-Young: the best rank 4
        s = float(layer.scaling["default"])
        got = s * layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
        assert torch.allclose(got, best, atol=1e-6 * float(S[0])), name
        assert float(layer.scaling["default"]) == pytest.approx(1.0)  # alpha = r


def test_fedsb_refusals(tiny_cfg):
    from fedexlora.config import ConfigError

    with pytest.raises(ConfigError, match="fedsb_init. gradient reads the clients"):
        tiny_cfg.replace(methods=["fedsb"], fedsb_init="gradient", dp_epsilon=3.0).validate()
    with pytest.raises(ConfigError, match="Flower engine does not collect"):
        tiny_cfg.replace(methods=["fedsb"], engine="flower").validate()
    with pytest.raises(ConfigError, match="fedsb_init. must be one of"):
        tiny_cfg.replace(methods=["fedsb"], fedsb_init="svd").validate()
    assert tiny_cfg.replace(dp_epsilon=3.0).fedsb_init_resolved == "random"
    assert tiny_cfg.fedsb_init_resolved == "gradient"


def test_fedsb_on_an_embedding_layer_is_one_clear_line_before_anything_is_written(
    tiny_bert_dir, tiny_csv, tmp_path
):
    """Fed-SB's core sits between two linear factors: a targeted embedding is refused by
    name (it was a bare ``KeyError: 'default'``), and the run directory is not made."""
    from typer.testing import CliRunner

    from fedexlora.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "run", "--model", tiny_bert_dir, "--task", tiny_csv, "--method", "fedsb",
        "--fedsb-rank", "4", "--target-modules", "query,word_embeddings", "--clients", "2",
        "--rounds", "1", "--local-steps", "1", "--max-length", "16",
        "--min-partition-size", "5", "--out", str(out), "--no-progress",
    ], env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert (
        "module 'base_model.model.bert.embeddings.word_embeddings' is a LoRA embedding layer"
        in text
    )
    assert "Fed-SB adapts linear layers only" in text and "Traceback" not in res.output
    assert not out.exists()
