"""The ranks of test_distributed_client: one client trained on 2 gloo processes, DDP and FSDP.

Every rank builds the same tiny models (seeded), so no weights travel but the round's
state (rank 0's). Rank 0 also trains the single-process reference and writes everything
the test compares to ``out/result.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

BATCH, STEPS = 5, 3  # 5 over 2 ranks: an uneven split (3 + 2)
TRAIN = dict(steps=STEPS, batch_size=BATCH, lr=5e-2, warmup_ratio=0.34, max_grad_norm=0.05,
             weight_decay=0.01, seed=11, progress=False)  # fmt: skip


def tiny(kind: str, *, dora: bool = False):
    """A tiny random peft model: ``bert`` (classifier, fp32, head trained) or ``llama``
    (causal LM, bf16 base, fp32 adapters); residuals in fp32 side branches; no dropout."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from fedexlora.bridge.fold import use_side_branch

    torch.manual_seed(0)
    if kind == "bert":
        cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=48, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
        base = BertForSequenceClassification(cfg)
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["query", "value", "dense"],
            modules_to_save=["classifier"], lora_dropout=0.0, use_dora=dora,
        )  # fmt: skip
    else:
        cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(base, lora)
    for n, p in model.named_parameters():
        if "lora_" in n or "modules_to_save" in n:
            p.data = p.data.float()
    return use_side_branch(model)


def data(kind: str):
    """Deterministic examples: 13 sentences (classification), or 13 with prompt labels."""
    from fedexlora.training.local import Encoded

    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 97, (int(torch.randint(4, 12, (1,), generator=g)),),
                         generator=g).tolist() for _ in range(13)]  # fmt: skip
    if kind == "bert":
        return Encoded(ids, [i % 3 for i in range(13)], "classification", 0)
    labels = [[-100] * (len(x) // 2) + x[len(x) // 2 :] for x in ids]
    return Encoded(ids, labels, "causal_lm", 0)


def round_state(kind: str) -> dict[str, torch.Tensor]:
    """A round's client state: random factors and head, and a folded residual per layer."""
    from fedexlora.bridge.adapters import get_state, set_state
    from fedexlora.bridge.fold import fold_residuals
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.bridge.steps import client_state
    from fedexlora.core.factors import Residual
    from fedexlora.core.state import AdapterState

    model = tiny(kind)
    g = torch.Generator().manual_seed(3)
    state = get_state(model)
    rnd = lambda t: 0.2 * torch.randn(t.shape, generator=g)  # noqa: E731
    factors = {m: (rnd(A), rnd(B)) for m, (A, B) in state.factors.items()}
    set_state(model, AdapterState(factors, {k: rnd(v) for k, v in state.extra.items()}))
    res = {}
    for i, (name, layer) in enumerate(lora_layers(model).items()):
        d, n = layer.lora_B["default"].weight.shape[0], layer.lora_A["default"].weight.shape[1]
        if i % 3 == 2:  # one layer in three: a dense residual
            res[name] = Residual((d, n), dense=0.05 * torch.randn(d, n, generator=g))
        else:
            res[name] = Residual((d, n), U=0.1 * torch.randn(d, 3, generator=g),
                                 V=0.1 * torch.randn(3, n, generator=g))  # fmt: skip
    fold_residuals(model, res)
    return client_state(model)


def frozen_full(model) -> dict[str, torch.Tensor]:
    """Every frozen parameter, whole (gathered when sharded), and every side branch."""
    from torch.distributed.tensor import DTensor

    from fedexlora.bridge.fold import _SIDE
    from fedexlora.bridge.layers import lora_layers
    from fedexlora.training.distributed import ShardedSide

    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    for name, layer in lora_layers(model).items():
        side = getattr(layer, _SIDE, None)
        if isinstance(side, ShardedSide):
            out.update({f"side.{name}.{k}": v.clone() for k, v in side.gathered().items()})
        elif side is not None:
            out.update({f"side.{name}.{k}": v.clone() for k, v in side.residual.tensors().items()})
    return out


GRAD_BATCH = [12, 3, 7, 0, 9]  # one global batch, split 3 + 2
SOLO_BATCH = [4]  # a batch of one: rank 1's share is empty


def one_gradient(model, batches, ctx, idx=GRAD_BATCH) -> dict[str, torch.Tensor]:
    """Every trainable gradient of the mean loss of batch ``idx``, whole; then zeroed.

    ``ctx``: through :func:`~fedexlora.training.distributed.backward_share` (this rank's
    share); ``None``: one process on the whole batch.
    """
    from torch.distributed.tensor import DTensor

    from fedexlora.training import distributed as D
    from fedexlora.training.local import _collate

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.train()
    if ctx is None:
        model(**_collate(batches.subset(idx), "cpu")).loss.backward()
    else:
        D.backward_share(model, batches, idx, ctx, params=list(params.values()), device="cpu")
    out = {}
    for n, p in params.items():
        g = p.grad
        out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        p.grad = None
    model.eval()
    return out


def run(rank: int, world: int, port: int, out: str, modes: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fedexlora.training import distributed as D
    from fedexlora.training.local import train_local

    result: dict = {}
    try:
        for kind in ("bert", "llama"):
            flat, batches = round_state(kind), data(kind)
            for mode in modes.split(","):
                model = tiny(kind)
                D.set_context(D.DistContext(mode=mode))
                D.prepare_model(model)
                D.load_round_state(model, flat if rank == 0 else None)
                nbytes = D.rank_nbytes(model)
                grads = one_gradient(model, batches, ctx=D.get_context())
                solo = one_gradient(model, batches, ctx=D.get_context(), idx=SOLO_BATCH)
                res = train_local(model, batches, **TRAIN)
                trained = D.trained_state(model)
                frozen = frozen_full(model)
                gathered = [None] * world
                dist.all_gather_object(gathered, nbytes)
                D.set_context(None)
                if rank == 0:
                    result[(kind, mode)] = dict(trained=trained, loss=res.loss, bytes=gathered,
                                                frozen=frozen, grads=grads, solo=solo)  # fmt: skip
            if rank == 0:  # the single process, on the same global batches
                from fedexlora.bridge.adapters import get_state
                from fedexlora.bridge.steps import load_client_state

                model = tiny(kind)
                load_client_state(model, flat)
                one = D.rank_nbytes(model)
                start = frozen_full(model)
                grads = one_gradient(model, batches, ctx=None)
                solo = one_gradient(model, batches, ctx=None, idx=SOLO_BATCH)
                res = train_local(model, batches, **TRAIN)
                result[(kind, "one")] = dict(trained=get_state(model).to_flat(), loss=res.loss,
                                             bytes=[one], frozen=start, flat=flat,
                                             grads=grads, solo=solo)  # fmt: skip
        refusals = {}
        D.set_context(D.DistContext(mode="fsdp"))
        try:
            D.prepare_model(tiny("bert", dora=True))
        except ValueError as e:
            refusals["dora"] = str(e)
        D.set_context(D.DistContext(mode="ddp"))
        model = tiny("bert")
        D.prepare_model(model)
        try:
            train_local(model, data("bert"), dp=object(), **TRAIN)
        except ValueError as e:
            refusals["dp"] = str(e)
        try:  # TRL trains under ddp (test_trl_distributed.py), not under fsdp
            from types import SimpleNamespace

            from fedexlora.run.client_step import local_update

            D.set_context(D.DistContext(mode="fsdp"))
            cfg = SimpleNamespace(dp=False, trainer="trl", quantization=None, dora=False)
            local_update(cfg, "fedex", model, data("bert"), 1, 0)
        except ValueError as e:
            refusals["trl"] = str(e)
        D.set_context(None)
        result["refusals"] = refusals
        if rank == 0:
            torch.save(result, os.path.join(out, "result.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    _, out, port, modes = sys.argv
    mp.start_processes(run, args=(2, int(port), out, modes), nprocs=2, start_method="spawn")
