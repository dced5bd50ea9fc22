"""TRL's ``SFTTrainer`` as each client's trainer (``examples/trl_sft/train.py``), #34.

A tiny Llama stands in for SmolLM2 (same code path: a causal LM, q/v LoRA, GSM8K as
conversational prompt-completion data through a ChatML template). The global model is
checked against the ideal computed by hand from the clients' uploads, on its effective
weights; the saved adapter is loaded with plain peft and must give the same logits.
"""

import pytest
import torch
from peft import PeftModel

from test_examples import _load, hand_ideal
from test_fp32_side_branch import _forward_weights as _weights  # W0 + side branch + s B A

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=8)

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
