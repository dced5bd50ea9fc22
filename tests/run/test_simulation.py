import json

import pytest
import torch

from fedexlora.run.checkpoint import latest_checkpoint
from fedexlora.run.export import export_model
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.layout import RunError
from fedexlora.run.report import read_metrics
from fedexlora.run.restore import load_task_for, restore_model

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=8)

FIELDS = {
    "method",
    "round",
    "metrics",
    "train_loss",
    "seconds",
    "server_seconds",
    "bytes_up",
    "bytes_down",
    "deviation",
    "effective_deviation",
}


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]


def test_run_writes_run_directory_and_fedex_is_exact(tiny_cfg, tmp_path):
    rows = run_experiment(tiny_cfg, tmp_path, progress=False)
    assert [(r["method"], r["round"]) for r in rows] == [
        ("fedex", 1),
        ("fedex", 2),
        ("fedit", 1),
        ("fedit", 2),
    ]
    on_disk = read_metrics(tmp_path / "metrics.jsonl")
    assert _strip(on_disk) == _strip(rows)
    for r in rows:
        assert FIELDS <= set(r)
        assert {"accuracy", "f1_macro"} <= set(r["metrics"])
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert {"mean", "max", "per_layer"} <= set(r["deviation"])
    fedex = [r for r in rows if r["method"] == "fedex"]
    fedit = [r for r in rows if r["method"] == "fedit"]
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in fedex)
    assert all(r["effective_deviation"]["max"] > 1e-4 for r in fedit)
    # same partitions, same initial adapters, same data order: round 1 trains identically
    assert fedex[0]["train_loss"] == fedit[0]["train_loss"]
    # fedex ships the residual: more bytes down from round 2 on, factored at rank <= (k-1) r
    assert fedex[1]["bytes_down"] > fedit[1]["bytes_down"]
    assert all(v <= 2 * 4 for v in fedex[0]["residual_rank"].values())
    for name in ("config.toml", "summary.md", "metrics.png", "deviation.png"):
        assert (tmp_path / name).is_file(), name
    summary = (tmp_path / "summary.md").read_text()
    assert "| fedex |" in summary and "| fedit |" in summary
    # the final accuracy carries its 95% Wilson interval over the test examples
    from fedexlora.run.report import wilson

    n = fedex[-1]["test_examples"]
    assert n == len(load_task_for(tiny_cfg).test) > 0
    lo, hi = wilson(fedex[-1]["metrics"]["accuracy"], n)
    assert f"| fedex | {fedex[-1]['metrics']['accuracy']:.4f} [{lo:.3f}, {hi:.3f}] |" in summary
    assert f"measured on {n} test examples" in summary and "fedexlora compare" in summary


def test_same_seed_same_run_and_other_seed_differs(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    a = run_experiment(cfg, tmp_path / "a", progress=False)
    b = run_experiment(cfg, tmp_path / "b", progress=False)
    c = run_experiment(cfg.replace(seed=1), tmp_path / "c", progress=False)
    assert _strip(a) == _strip(b)
    assert a[0]["train_loss"] != c[0]["train_loss"]


def test_refuses_to_overwrite_a_run(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["fedit"], rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunError, match="already holds a run; pass --resume"):
        run_experiment(cfg, tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_all_methods_and_centralized(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["ffa", "flora", "centralized"], rounds=2)
    rows = run_experiment(cfg, tmp_path, progress=False)
    by = {(r["method"], r["round"]): r for r in rows}
    assert by[("centralized", 2)]["bytes_up"] == 0 and by[("centralized", 1)]["sampled"] == [0]
    assert by[("centralized", 1)]["num_examples"] == sum(
        by[("ffa", 1)]["num_examples"] for _ in [0]
    )
    for m in ("ffa", "flora"):
        assert by[(m, 2)]["effective_deviation"]["max"] < 1e-5
    # FFA-LoRA uploads no A: fewer bytes up than FLoRA, which uploads both factors
    assert by[("ffa", 1)]["bytes_up"] < by[("flora", 1)]["bytes_up"]


@pytest.mark.parametrize("beside", [False, None], ids=["folded-merged", "default-adapter"])
def test_export_reproduces_global_model_logits(tiny_cfg, tmp_path, beside):
    """Folded into fp32 weights, the default export is a merged model; with the side
    branch (fedex's default on fp32), a PEFT adapter on the unchanged base."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from fedexlora.run.build import prepare
    from fedexlora.training.local import predict

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, fp32_side_branch=beside)
    run_experiment(cfg, tmp_path / "run", progress=False)
    res = export_model(tmp_path / "run", tmp_path / "export")
    dest = res.path
    assert res.format == ("merged" if beside is False else "adapter")
    task = load_task_for(cfg)
    model, tok, server, _ = restore_model(
        cfg, task, "fedex", latest_checkpoint(tmp_path / "run" / "checkpoints" / "fedex"), None
    )
    assert server.round == 2
    prep = prepare(cfg, tok, task)
    if res.format == "merged":
        plain = AutoModelForSequenceClassification.from_pretrained(dest).eval()
        assert not any("lora" in k for k in plain.state_dict())
    else:
        base = AutoModelForSequenceClassification.from_pretrained(
            cfg.model, num_labels=task.num_labels, ignore_mismatched_sizes=True
        )  # as the run loaded it: a fresh head of the task's size, replaced by the adapter's
        plain = PeftModel.from_pretrained(base, dest).eval()
    ref = predict(model, prep.test)
    got = predict(plain, prep.test)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_save_client_adapters(tiny_cfg, tmp_path):
    from peft import PeftConfig

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, save_client_adapters=True)
    run_experiment(cfg, tmp_path, progress=False)
    weights = []
    for c in range(3):
        d = tmp_path / "clients" / "round-1" / f"client-{c}"
        assert (d / "adapter_config.json").is_file()
        assert (d / "adapter_model.safetensors").is_file()
        meta = json.loads((d / "meta.json").read_text())
        assert meta["num_examples"] > 0
        weights.append(meta["weight"])
        assert PeftConfig.from_pretrained(str(d)).r == 4
    assert sum(weights) == pytest.approx(1.0)


def test_bf16_base_with_gradient_checkpointing_stays_exact(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, dtype="bf16", gradient_checkpointing=True)
    rows = run_experiment(cfg, tmp_path, progress=False)
    # the aggregation itself is exact in fp32 whatever the base dtype
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in rows)
    # recomputing activations in the backward pass changes nothing: the same run without
    # checkpointing trains to the same losses and metrics
    plain = run_experiment(
        cfg.replace(gradient_checkpointing=False), tmp_path / "plain", progress=False
    )
    for a, b in zip(rows, plain, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["metrics"] == pytest.approx(b["metrics"], abs=1e-6)


def test_cuda_without_gpu_is_a_clear_error(tiny_cfg, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="`device` is 'cuda' but no CUDA GPU is available"):
        run_experiment(tiny_cfg.replace(device="cuda"), tmp_path, progress=False)
