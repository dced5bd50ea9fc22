"""Causal-LM tasks: a decoder with LoRA on all projections, loss, perplexity, exact match."""

import math

import pytest

from fedexlora.run.inprocess import run_experiment


def test_causal_lm_run_reports_loss_perplexity_exact_match(tiny_llama_dir, tiny_qa_jsonl, tmp_path):
    from fedexlora.config import RunConfig

    cfg = RunConfig(
        model=tiny_llama_dir,
        task=tiny_qa_jsonl,
        methods=["fedex", "fedit"],
        num_clients=2,
        min_partition_size=4,
        rounds=2,
        local_steps=3,
        batch_size=4,
        max_length=32,
        lora_r=2,
        lora_dropout=0.0,
        max_new_tokens=4,
        lr=1e-2,
    )
    rows = run_experiment(cfg, tmp_path, progress=False)
    # the default partition, dirichlet, needs labels: the run says it partitioned iid
    note = "partition 'dirichlet' needs class labels and task"
    assert (tmp_path / "partitions.txt").read_text().startswith(f"note: {note}")
    toml = (tmp_path / "config.toml").read_text()
    assert f"# note: {note}" in toml and "clients are partitioned iid" in toml
    from fedexlora.config import load_config

    assert load_config(tmp_path / "config.toml").partition == "dirichlet"  # still loads
    for r in rows:
        assert list(r["metrics"]) == ["exact_match", "loss", "perplexity"]  # primary first
        assert r["metrics"]["perplexity"] == pytest.approx(math.exp(r["metrics"]["loss"]))
        assert 0.0 <= r["metrics"]["exact_match"] <= 1.0
    fedex = [r for r in rows if r["method"] == "fedex"]
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in fedex)
    # the decoder default targets every attention and MLP projection
    names = set(fedex[0]["deviation"]["per_layer"])
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(n.endswith(proj) for n in names), proj


def test_causal_lm_on_a_4bit_base_is_exact_and_exports_exactly(
    tiny_llama_dir, tiny_qa_jsonl, tmp_path
):
    """The QLoRA setting (a decoder in NF4), as `--model smollm2-135m --quantization nf4`."""
    from conftest import load_script
    from fedexlora.config import RunConfig
    from fedexlora.run.export import export_model

    verify = load_script("benchmarks/verify_export.py")
    cfg = RunConfig(
        model=tiny_llama_dir, task=tiny_qa_jsonl, methods=["fedex"], num_clients=2,
        min_partition_size=4, rounds=2, local_steps=3, batch_size=4, max_length=32,
        lora_r=2, lora_dropout=0.0, max_new_tokens=2, lr=2e-2, quantization="nf4",
        save_client_adapters=True,
    )  # fmt: skip
    rows = run_experiment(cfg, tmp_path / "run", progress=False)
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in rows)
    res = export_model(tmp_path / "run", tmp_path / "export")
    assert res.format == "adapter"
    ideal, w0 = verify.ideal_from_client_adapters(tmp_path / "run", cfg)
    assert verify.rel(verify.exported(res.path, cfg), ideal, w0) <= 1e-5
