"""An export is a model to share: the task's labels, a base reference valid elsewhere, the
rank it states, and the usual file modes (issue 59)."""

import json
import os
import stat

import pytest
import torch

from fedexlora.bridge.models import portable_reference
from fedexlora.run.export import export_model
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.restore import load_task_for

pytestmark = pytest.mark.slow(seconds=10)


def test_portable_reference_names_no_installed_package_path():
    ref = portable_reference("minilm")
    assert ref == "sentence-transformers/all-MiniLM-L6-v2"  # the package's files, from the hub
    assert "site-packages" not in ref and not os.path.isabs(ref)
    assert portable_reference("org/some-model") == "org/some-model"
    assert portable_reference("~/models/mine") == os.path.expanduser("~/models/mine")


def test_adapter_and_merged_exports_carry_labels_portable_base_rank_and_modes(tiny_cfg, tmp_path):
    from peft import PeftConfig
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2)
    run_experiment(cfg, tmp_path / "run", progress=False)
    names = load_task_for(cfg).label_names
    assert len(names) == 3 and names[0] != "LABEL_0"
    old = os.umask(0o022)
    try:
        adapter = export_model(tmp_path / "run", tmp_path / "adapter")
        merged = export_model(tmp_path / "run", tmp_path / "merged", fmt="merged")
    finally:
        os.umask(old)

    # the adapter: the base's config with the task's head and names, the base as given
    peft_cfg = PeftConfig.from_pretrained(str(adapter.path))
    assert peft_cfg.base_model_name_or_path == cfg.model
    config = AutoConfig.from_pretrained(str(adapter.path))
    assert config.num_labels == 3 and config.id2label == dict(enumerate(names))
    assert config.label2id == {n: i for i, n in enumerate(names)}
    info = json.loads((adapter.path / "fedexlora_export.json").read_text())
    assert info["num_labels"] == 3 and info["id2label"] == {str(i): n for i, n in enumerate(names)}
    assert info["base"]["reference"] == cfg.model
    # the rank it states is the adapter's: r plus the accumulated residual's rank
    rank = json.loads((adapter.path / "adapter_config.json").read_text())["r"]
    assert rank > cfg.lora_r
    assert f"rank up to {rank}: r={cfg.lora_r} plus the rank of the residual" in adapter.note

    # the merged model: plain transformers, the task's names
    plain = AutoModelForSequenceClassification.from_pretrained(str(merged.path))
    assert plain.config.id2label == dict(enumerate(names))

    # the usual modes under umask 022: folders 0755, files 0644
    for root in (adapter.path, merged.path):
        for p in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


def test_a_fed_sb_run_exports_as_a_plain_adapter_exactly(tiny_cfg, tmp_path):
    """Fed-SB's ``lora_B`` is a frozen basis after a trained core, which peft saves as two
    tensors; the export holds their product, so plain peft loads it, and on the unchanged
    base every weight is the run's: ``W0 + s basis core A`` in each adapted layer (computed
    here from the restored model's own modules), the trained head, every other weight W0."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from fedexlora.bridge.layers import lora_layers
    from fedexlora.run.checkpoint import latest_checkpoint
    from fedexlora.run.restore import restore_model

    cfg = tiny_cfg.replace(methods=["fedsb"], rounds=2, fedsb_rank=8, fedsb_init="random")
    run_experiment(cfg, tmp_path / "run", progress=False)
    res = export_model(tmp_path / "run", tmp_path / "adapter")
    assert res.format == "adapter"
    task = load_task_for(cfg)
    model, _, _, _ = restore_model(
        cfg, task, "fedsb", latest_checkpoint(tmp_path / "run" / "checkpoints" / "fedsb"), None
    )

    def base():
        return AutoModelForSequenceClassification.from_pretrained(
            cfg.model, num_labels=task.num_labels, ignore_mismatched_sizes=True
        )

    pristine = base().state_dict()
    got = PeftModel.from_pretrained(base(), str(res.path)).merge_and_unload().state_dict()
    ideal = {k: v.double() for k, v in pristine.items()}
    for name, layer in lora_layers(model).items():
        B = layer.lora_B["default"]
        core, basis = B.core.weight.double(), B.basis.weight.double()
        assert core.abs().max() > 0  # trained: the test compares a real update
        update = layer.scaling["default"] * basis @ core @ layer.lora_A["default"].weight.double()
        ideal[name.removeprefix("base_model.model.") + ".weight"] += update
    head = {k: v for k, v in model.state_dict().items() if "modules_to_save.default" in k}
    assert head  # the classifier, trained and shared
    for k, v in head.items():
        ideal[k.removeprefix("base_model.model.").replace(".modules_to_save.default", "")] = v
    assert got.keys() == ideal.keys()
    for k in ideal:
        assert torch.allclose(got[k].double(), ideal[k].double(), rtol=0, atol=1e-6), k
    changed = [k for k in ideal if not torch.equal(ideal[k].float(), pristine[k].float())]
    assert len(changed) == len(lora_layers(model)) + len(head)
