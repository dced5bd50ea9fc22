"""``fedexlora run --trainer trl``: each client trains with TRL's ``SFTTrainer`` (#34).

The global model is checked against the ideal rebuilt by hand from the clients' saved
adapters and the pristine base (``benchmarks/verify_export.py``), on its effective weights.
"""

import json

import pytest
import tomli_w
import torch
from typer.testing import CliRunner

from fedexlora.bridge.adapters import effective_weight
from fedexlora.bridge.layers import lora_layers
from fedexlora.cli import app
from fedexlora.run.checkpoint import config_fingerprint, latest_checkpoint
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.restore import load_task_for, restore_model
from test_precision import _rel, ideal_from_client_adapters

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=19)


@pytest.fixture()
def trl_cfg(tiny_llama_dir, tiny_qa_jsonl):
    from fedexlora.config import RunConfig

    return RunConfig(
        model=tiny_llama_dir, task=tiny_qa_jsonl, methods=["fedex"], num_clients=3,
        partition="iid", rounds=2, local_steps=3, batch_size=4, lr=2e-2, max_length=32,
        lora_r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        max_test=4, max_new_tokens=4, trainer="trl", save_client_adapters=True,
        fp32_side_branch=True,
    )  # fmt: skip


@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_trl_clients_reach_the_hand_computed_ideal(trl_cfg, tmp_path, monkeypatch, quantization):
    """fp32 (residuals beside the weights) and nf4: TRL casts a quantized model's adapter
    to bf16, which ``train_sft`` undoes, or every client would start from a rounded model.
    """
    from fedexlora.training import sft

    if quantization:
        trl_cfg = trl_cfg.replace(quantization=quantization, fp32_side_branch=False)

    calls = []
    real = sft.train_sft
    monkeypatch.setattr(
        sft, "train_sft", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )  # TRL really trains every client, every round
    rows = run_experiment(trl_cfg, tmp_path, progress=False)
    assert len(calls) == 6 and all(c.max_steps == 3 and c.completion_only_loss for c in calls)
    assert [r["accepted"] for r in rows] == [[0, 1, 2]] * 2
    ideal, w0 = ideal_from_client_adapters(tmp_path, trl_cfg)
    task = load_task_for(trl_cfg)
    ckpt = latest_checkpoint(tmp_path / "checkpoints" / "fedex")
    model = restore_model(trl_cfg, task, "fedex", ckpt, config_fingerprint(trl_cfg))[0]
    got = {n: effective_weight(layer) for n, layer in lora_layers(model).items()}
    assert any(float(torch.linalg.norm(ideal[n] - w0[n])) > 0 for n in ideal)  # it trained
    assert _rel(got, ideal, w0) <= 1e-5
    assert all(r["effective_deviation"]["max"] <= 1e-5 for r in rows)
    assert all(r["train_loss"] > 0 for r in rows)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_trl_labels_are_the_completion_only(trl_cfg):
    """What TRL trains on: the prompt masked, exactly as the builtin trainer masks it."""
    from trl import SFTTrainer

    from fedexlora.run.build import new_model, prepare
    from fedexlora.training.sft import encoded_dataset, sft_config

    task = load_task_for(trl_cfg)
    model, tok = new_model(trl_cfg, task, "fedex")
    prep = prepare(trl_cfg, tok, task)
    data = prep.train.subset(range(4))
    args = sft_config("/tmp/unused", steps=1, seed=0, max_length=trl_cfg.max_length)
    trainer = SFTTrainer(model=model, args=args, train_dataset=encoded_dataset(data),
                         processing_class=tok)  # fmt: skip
    for i in range(4):
        assert trainer.train_dataset[i]["labels"] == data.labels[i]  # TRL's, ours


def test_trl_refuses_a_classification_task_by_name(tiny_bert_dir, tiny_csv, tmp_path):
    res = CliRunner().invoke(
        app,
        ["run", "--model", tiny_bert_dir, "--task", tiny_csv, "--trainer", "trl",
         "--rounds", "1", "--local-steps", "1", "--out", str(tmp_path / "r")],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "trains causal-LM tasks" in res.output and "classification" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trainer", "keras"], "`--trainer` must be one of"),
        (["--trainer", "trl", "--method", "hetlora", "--client-ranks", "2,4,4"], "hetlora"),
        (["--trainer", "trl", "--dtype", "fp16"], "cannot train in fp16 on a CPU"),
    ],
)
def test_trainer_choice_is_validated(tiny_llama_dir, tiny_qa_jsonl, tmp_path, extra, message):
    res = CliRunner().invoke(
        app,
        ["run", "--model", tiny_llama_dir, "--task", tiny_qa_jsonl, *extra,
         "--out", str(tmp_path / "r")],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_trl_clients_under_flower_match_the_in_process_engine(trl_cfg, tmp_path, task_identity):
    """The Flower engine's ClientApp trains with TRL too: the same rows, the same model."""
    from test_flower_parity import _close, _flower

    cfg = trl_cfg.replace(save_client_adapters=False)
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, grid = _flower(cfg.replace(engine="flower"), tmp_path / "flower")
    assert grid.trained == [(r, c) for r in (1, 2) for c in (0, 1, 2)]
    _close(local, flower)
    assert all(r["effective_deviation"]["max"] <= 1e-5 for r in flower)
    assert [r["train_loss"] for r in flower] == pytest.approx([r["train_loss"] for r in local])


def test_a_run_from_before_the_new_settings_still_resumes_and_exports(tiny_cfg, tmp_path):
    """A run written before ``trainer`` and ``fp32_side_branch`` existed (its stored
    config lacks them; its fingerprint counted ``secure_aggregation``'s default, as the
    code of then did) resumes and exports at their defaults; another setting does not."""
    import hashlib

    from fedexlora.config import ADDED_LATER, RESUME_SAFE
    from fedexlora.run.export import export_model

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    run_experiment(cfg.replace(fp32_side_branch=False), tmp_path, progress=False)  # as then
    then = {k: v for k, v in cfg.to_dict().items() if k not in ("trainer", "fp32_side_branch")}
    stable = {k: v for k, v in sorted(then.items()) if k not in RESUME_SAFE}
    del stable["double_quant"]  # the rule of then
    old = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    assert old != config_fingerprint(cfg)  # the hash did change
    for meta in (tmp_path / "checkpoints" / "fedex").glob("*/meta.json"):
        info = json.loads(meta.read_text())
        info.update(fingerprint=old, config=then)
        meta.write_text(json.dumps(info))
    (tmp_path / "config.toml").write_text(tomli_w.dumps({**then, "rounds": 2}))
    rows = run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2]
    assert export_model(tmp_path, tmp_path / "export").format == "merged"
    assert set(ADDED_LATER) >= {"trainer", "fp32_side_branch", "secure_aggregation"}
    with pytest.raises(Exception, match="another configuration"):
        run_experiment(cfg.replace(rounds=3, lr=1.0), tmp_path, resume=True, progress=False)
