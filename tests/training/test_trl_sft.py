"""TRL's ``SFTTrainer`` as each client's trainer (#34), both ways fedex-lora offers it.

- The example (``examples/trl_sft/train.py``): a tiny Llama stands in for SmolLM2 (same
  code path: a causal LM, q/v LoRA, GSM8K as conversational prompt-completion data
  through a ChatML template). The global model is checked against the ideal computed by
  hand from the clients' uploads, on its effective weights; the saved adapter is loaded
  with plain peft and must give the same logits.
- ``fedexlora run --trainer trl``: the global model is checked against the ideal rebuilt
  by hand from the clients' saved adapters and the pristine base
  (``benchmarks/verify_export.py``), on its effective weights.
"""

import json

import pytest
import tomli_w
import torch
from peft import PeftModel
from typer.testing import CliRunner

from fedexlora.bridge.fold import effective_weight
from fedexlora.bridge.layers import lora_layers
from fedexlora.cli import app
from fedexlora.run.checkpoint import config_fingerprint, latest_checkpoint
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.restore import load_task_for, restore_model
from test_examples import _load, hand_ideal
from test_fp32_side_branch import _forward_weights as _weights  # W0 + side branch + s B A
from test_precision import _rel, ideal_from_client_adapters

# slow: the test order puts it first (tests/conftest.py); its seconds, measured (the sum
# of the two files merged here: 8 s for the example's, 19 s for --trainer trl's)
pytestmark = pytest.mark.slow(seconds=27)


# -- the example: examples/trl_sft/train.py ---------------------------------------------
# The chat template SmolLM2-135M-Instruct ships (ChatML), given to the test's tokenizer
# as data: TRL applies it, nothing here formats a conversation.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def sft(tiny_llama_dir):
    from fedexlora.tasks.data import load_task

    ex = _load("examples/trl_sft/train.py")
    base, tok = ex.load_base(tiny_llama_dir)
    tok.chat_template = CHATML
    tok.eos_token = tok.sep_token  # MiniLM's tokenizer has no EOS of its own
    task = load_task("gsm8k", seed=0, test_fraction=0.2)
    data = ex.conversations(task.train.select(range(36)))
    return ex, base, tok, [data.shard(3, i) for i in range(3)], task


def test_sft_trainer_clients_reach_the_ideal_and_the_adapter_reloads(sft, tmp_path, tiny_llama_dir):
    ex, base, tok, shards, _ = sft
    w0 = _weights(ex.lora_model(base))
    glob, server, clients, history = ex.federate(
        base, tok, shards, rounds=2, steps=3, out=str(tmp_path / "out"), max_length=96
    )
    assert [sorted(o.accepted) for o, _, _ in history] == [[0, 1, 2]] * 2
    # the engine's own measure, on the model
    assert max(max(dev.values()) for _, _, dev in history) < 1e-5
    # and by hand: the ideal average of the clients' models, rebuilt from their uploads
    got = _weights(glob)
    want = hand_ideal(w0, [(o, u) for o, u, _ in history], scale=ex.LORA["lora_alpha"] / 8)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    assert err < 1e-5, err
    assert any(float(torch.linalg.norm(want[n] - w0[n])) > 0 for n in want)  # it trained
    for c, model in enumerate(clients):  # each party, given its next payload, holds it too
        ex.apply_payload(model, server.payload_for(c))
        mine = _weights(model)
        gap = max(
            float(torch.linalg.norm(mine[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
            for n in want
        )
        assert gap < 1e-5, (c, gap)
    # the global adapter, loaded with plain peft on a fresh base, is that model
    adapter = ex.save_adapter(glob, tmp_path / "adapter")
    fresh = ex.load_base(tiny_llama_dir)[0]
    reloaded = PeftModel.from_pretrained(fresh, str(adapter)).eval()
    ids = tok("Natalia sold clips to 48 of her friends.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = glob.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max())), (a - b).abs().max()


def test_the_loss_is_on_the_completion_only(sft, tmp_path):
    """TRL's completion-only loss: every prompt token (the chat template's user turn) is
    masked out of the labels, every completion token is kept."""
    ex, base, tok, shards, _ = sft
    from trl import SFTTrainer

    args = ex.sft_config(str(tmp_path), steps=1, seed=0, max_length=96)  # the example's own
    trainer = SFTTrainer(
        model=ex.lora_model(base), args=args, train_dataset=shards[0], processing_class=tok
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    prompt_ids = tok.apply_chat_template(shards[0][0]["prompt"], tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    assert ids[: len(prompt_ids)].tolist() == list(prompt_ids)
    assert (labels[: len(prompt_ids)] == -100).all()
    kept = labels[len(prompt_ids) :]
    assert (kept[kept != -100] == ids[len(prompt_ids) :][kept != -100]).all()
    assert int((kept != -100).sum()) > 10  # the answer is trained on


# -- the engine: fedexlora run --trainer trl --------------------------------------------
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
