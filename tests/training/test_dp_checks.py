"""DP-SGD that cannot fail silently (Opacus issue 820).

1. Opacus's per-sample gradients, as our DP path asks for them (``privacy.wrap``), equal a
   hand computation with plain autograd, one example at a time, before clipping and
   noise: LoRA on Linear layers (BERT) with the trained head, LoRA on GPT-2's Conv1D
   layers, and Fed-SB's latent core (a parameter peft does not own).
2. The guard: a model whose parameters are replaced after Opacus wrapped it (what a
   device move does), or a first step that leaves an adapter unmoved, stops the run with
   a clear error, on the in-process engine, under Flower and from the CLI.
"""

import pytest
import torch
import torch.nn.functional as F

from fedexlora.training.privacy import DPCheckError


# -- 1. per-sample gradients against a hand computation ---------------------------------
def _no_dropout(model):
    """Opacus records activations in train mode only; dropout would make each
    example's forward pass differ between the batch and the hand computation."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    return model


def _trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _batch(vocab: int, causal: bool, b: int = 4, t: int = 9) -> dict:
    """Token ids with right padding of different lengths (the attention mask matters)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (b, t), generator=g)
    lengths = [t, t - 3, t - 1, t - 5][:b]
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids * mask
    if causal:
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.tensor([0, 2, 1, 2][:b])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _opacus_per_sample(model, batch) -> dict:
    """What DP-SGD clips: the per-sample gradients our DP path gets from Opacus."""
    from fedexlora.training.privacy import per_example_loss, wrap

    model.zero_grad(set_to_none=True)
    gsm = wrap(model)
    try:
        per_example_loss(gsm, batch).backward()  # the loss DP-SGD trains on
        return {n: p.grad_sample.detach().clone() for n, p in _trainable(model).items()}
    finally:
        gsm.to_standard_module()
        model.zero_grad(set_to_none=True)


def _by_hand(model, batch, causal: bool) -> dict:
    """Each example alone through the plain model, autograd of its own loss: for a
    classifier its cross-entropy; for a causal LM the mean over its own answer tokens
    (never over the batch's, which would make it depend on its batchmates)."""
    b = batch["input_ids"].shape[0]
    params = _trainable(model)
    out = {n: [] for n in params}
    for i in range(b):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        labels = one.pop("labels")
        logits = model(**one).logits.float()
        if causal:
            share = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
        else:
            share = F.cross_entropy(logits, labels)
        grads = torch.autograd.grad(share, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(gs) for n, gs in out.items()}


def _model(kind, tiny_bert_dir, tiny_gpt2_dir):
    from fedexlora.bridge.models import load_model

    if kind == "gpt2-conv1d":
        model = load_model(tiny_gpt2_dir, causal=True, r=4, alpha=8, dropout=0.0,
                           target_modules=["c_attn"])[0]  # fmt: skip
        return _no_dropout(model), True
    model = load_model(tiny_bert_dir, causal=False, num_labels=3, r=4, alpha=8, dropout=0.0,
                       target_modules=["query", "value"])[0]  # fmt: skip
    if kind == "fedsb-latent":
        from fedexlora.bridge.latent import install

        install(model, init="random", seed=0)
    return _no_dropout(model), False


@pytest.mark.parametrize("kind", ["bert-linear", "gpt2-conv1d", "fedsb-latent"])
def test_per_sample_gradients_equal_the_hand_computation(kind, tiny_bert_dir, tiny_gpt2_dir):
    model, causal = _model(kind, tiny_bert_dir, tiny_gpt2_dir)
    params = _trainable(model)
    names = list(params)
    if kind == "fedsb-latent":
        assert names and all("core" in n or "classifier" in n for n in names), names
    else:
        assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    if kind == "gpt2-conv1d":  # peft's LoRA on GPT-2's own Conv1D layers
        from transformers.pytorch_utils import Conv1D

        assert isinstance(dict(model.named_modules())[
            names[0].rsplit(".lora_A", 1)[0] + ".base_layer"], Conv1D)  # fmt: skip
    else:
        assert any("classifier" in n for n in names)  # the trained head too
    with torch.no_grad():  # B = 0 at init makes A's gradients zero: give B some weight
        for n, p in params.items():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    batch = _batch(model.config.vocab_size, causal)
    got = _opacus_per_sample(model, batch)
    want = _by_hand(model, batch, causal)
    assert set(got) == set(want) == set(names)
    for n in names:
        assert got[n].shape == (batch["input_ids"].shape[0], *params[n].shape), n
        assert float(want[n].norm()) > 0, f"{n}: a zero gradient would check nothing"
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


# -- 2. the guard ------------------------------------------------------------------------
def _move_like_a_device_change(model) -> None:
    """What ``model.to(device)`` does to a parameter it converts into a new tensor (and
    what a parameter materialized late looks like): a new Parameter object, same values."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = torch.nn.Parameter(
                    p.detach().clone(), requires_grad=p.requires_grad
                )


@pytest.fixture()
def moved_after_wrapping(monkeypatch):
    """Opacus wraps the model, then the model is moved: issue 820's order."""
    import fedexlora.training.privacy as privacy

    real = privacy.wrap

    def wrap_then_move(model):
        gsm = real(model)
        old = list(model.parameters())  # held, so that no id is reused
        _move_like_a_device_change(model)
        assert not {id(p) for p in old} & {id(p) for p in model.parameters()}  # all replaced
        return gsm

    monkeypatch.setattr(privacy, "wrap", wrap_then_move)


class _NoStep(torch.optim.AdamW):
    """An optimizer whose steps never reach the model's tensors."""

    def step(self, closure=None):
        return None


@pytest.fixture()
def optimizer_never_steps(monkeypatch):
    monkeypatch.setattr(torch.optim, "AdamW", _NoStep)


def _dp(tiny_cfg, method="fedex"):
    cfg = tiny_cfg.replace(methods=[method], rounds=1, local_steps=2, dp_epsilon=8.0,
                           dp_delta=1e-3)  # fmt: skip
    return cfg.replace(fedsb_rank=4) if method == "fedsb" else cfg


# No false alarm: every DP run of test_privacy.py (FedEx, FedIT and Fed-SB, both engines)
# goes through the guard.


def test_model_moved_after_wrapping_is_stopped(tiny_cfg, tmp_path, moved_after_wrapping):
    from fedexlora.run.inprocess import run_experiment

    stray = r"'base_model\.model\..*lora_A.*' .*trainable in the model but not among the "
    with pytest.raises(DPCheckError, match=stray + r"parameters DP-SGD updates.*issue 820"):
        run_experiment(_dp(tiny_cfg), tmp_path, progress=False)
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.is_file() or not metrics.read_text().strip()  # no silent round


@pytest.mark.parametrize("method", ["fedex", "fedsb"])
def test_adapter_that_does_not_move_is_stopped(tiny_cfg, tmp_path, optimizer_never_steps, method):
    from fedexlora.run.inprocess import run_experiment

    which = "core" if method == "fedsb" else "lora_"
    with pytest.raises(DPCheckError, match=rf"'[^']*{which}[^']*'.* got a gradient in the first "
                       r"private step but did not change.*issue 820"):  # fmt: skip
        run_experiment(_dp(tiny_cfg, method), tmp_path, progress=False)


def test_under_flower_a_failed_check_stops_the_run(tiny_cfg, tmp_path, task_identity,
                                                   optimizer_never_steps):  # fmt: skip
    """The ClientApp reports the failed check; the ServerApp stops, naming the client,
    instead of dropping it and going on (a client error alone does not fail a Flower run)."""
    from test_flower_parity import _flower

    with pytest.raises(DPCheckError, match=r"fedex round 1: client \d stopped the run: DP-SGD: "
                       r".*did not change"):  # fmt: skip
        _flower(_dp(tiny_cfg), tmp_path / "flower")
    metrics = tmp_path / "flower" / "metrics.jsonl"
    assert not metrics.is_file() or not metrics.read_text().strip()  # no silent round


def test_cli_says_what_happened_without_a_traceback(tiny_bert_dir, tiny_csv, tmp_path,
                                                    optimizer_never_steps):  # fmt: skip
    from typer.testing import CliRunner

    from fedexlora.cli import app

    res = CliRunner().invoke(app, [
        "run", "--model", tiny_bert_dir, "--task", tiny_csv, "--min-partition-size", "5",
        "--method", "fedex", "--rounds", "1", "--local-steps", "2", "--dp-epsilon", "8",
        "--dp-delta", "1e-3", "--out", str(tmp_path / "run"), "--no-progress",
    ])  # fmt: skip
    said = " ".join(res.output.split())  # the console wraps long lines
    assert res.exit_code == 2, res.output  # the CLI's exit code for an error it explains
    assert "did not change" in said and "issue 820" in said
    assert "Traceback" not in res.output


def test_a_multi_label_classifiers_dp_loss_is_its_own_loss():
    """Float labels of shape (batch, classes) are one label vector per example, not
    tokens: the DP loss is the model's own (per example already), never a token mean."""
    from transformers import BertConfig, BertForSequenceClassification

    from fedexlora.training.privacy import per_example_loss

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, num_labels=3,
                        problem_type="multi_label_classification")  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    batch = {"input_ids": torch.randint(0, 50, (4, 7)),
             "labels": torch.tensor([[1.0, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]])}  # fmt: skip
    assert torch.equal(per_example_loss(model, batch), model(**batch).loss)
