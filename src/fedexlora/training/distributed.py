"""One client's local training on N processes (torch.distributed): DDP or FSDP (``fully_shard``).

A client whose model or side branch outgrows one device trains on all of its node's
devices. Every rank of the client's worker group runs the same calls (see
``docs/LARGE_MODELS.md``, "A client on several processes")::

    D.set_context(D.DistContext(mode="ddp"))   # or "fsdp"; after init_process_group
    D.prepare_model(model)                     # fsdp: shards it in place
    # per round
    D.load_round_state(model, flat if rank == 0 else None)   # client_state() of the round
    upload = local_update(cfg, method, model, data, rnd, client, ...)
    flat_out = D.trained_state(model)          # rank 0: the trained tensors; others None

Each global batch is the one a single process draws (same seed, same order); rank ``r``
trains on its contiguous share of it, its loss weighted by its share of the batch's
examples (tokens, for a causal LM), and the gradients are summed across ranks, so a step
is the single-process step on the global batch up to float reassociation.

- ``ddp``: every rank holds the whole model; the trainable gradients (LoRA factors and
  trained extras only: the base is frozen) are summed with one all-reduce per dtype per
  step.
- ``fsdp``: torch's ``fully_shard`` (FSDP2) shards every parameter (base weights, LoRA
  factors, trained extras) along dim 0, one FSDP unit per module that holds parameters;
  the fp32 side branch (held in buffers by :class:`~fedexlora.core.side.SideBranch`, its
  rank changing each round, which ``fully_shard`` cannot shard) is held as 1/N flat
  shards per rank by :class:`ShardedSide`, gathered for each forward and backward of its
  layer and freed after.

Refused, before any training, with one line: DP-SGD under either mode; under ``fsdp`` a
bitsandbytes base, DoRA, Fed-SB, LoRA on embeddings / convolutions / parameters, a base
that folds residuals into its weight (an fp32 base needs ``--fp32-side-branch``), tied
weights, loss penalties and methods that change what trains between rounds (HetLoRA,
RoLoRA), and TRL's trainer (which trains under ``ddp``: :mod:`fedexlora.training.sft`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from fedexlora.training.sharded_side import ShardedSide

if TYPE_CHECKING:
    from fedexlora.training.batches import TrainResult

__all__ = [
    "DistContext",
    "ShardedSide",
    "check_supported",
    "get_context",
    "load_round_state",
    "prepare_model",
    "rank_nbytes",
    "set_context",
    "backward_share",
    "share",
    "trained_state",
    "train_sharded",
]

MODES = ("ddp", "fsdp")


@dataclass
class DistContext:
    """How this process's client trains with its peers.

    Attributes:
        mode: ``ddp`` (every rank holds the model, gradients all-reduced) or ``fsdp``
            (``fully_shard``: parameters and side branch sharded).
        group: The process group of the client's ranks (default: the world).
    """

    mode: str
    group: object | None = None
    prepared: bool = field(default=False, init=False)
    side_group: object | None = field(default=None, init=False, repr=False)
    names: dict = field(default_factory=dict, init=False, repr=False)  # fsdp key -> fqn
    masters: dict = field(default_factory=dict, init=False, repr=False)  # rank 0: fp32
    trainable: frozenset = field(default_factory=frozenset, init=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"distributed mode {self.mode!r} is unknown; choose from {MODES}")

    @property
    def rank(self) -> int:
        """This process's rank in the client's group."""
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        """Processes training the client."""
        return dist.get_world_size(self.group)

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must be for this group's collectives (CUDA under NCCL)."""
        backend = dist.get_backend(self.group)
        if "nccl" in str(backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_CONTEXT: DistContext | None = None


def set_context(ctx: DistContext | None) -> None:
    """Makes ``ctx`` this process's distributed context (``None``: single process).

    Raises:
        ValueError: If torch.distributed is not initialized.
    """
    global _CONTEXT
    if ctx is not None and not dist.is_initialized():
        raise ValueError(
            f"distributed mode {ctx.mode!r} needs torch.distributed initialized first "
            "(launch with torchrun / accelerate launch, then init_process_group)"
        )
    _CONTEXT = ctx


def get_context() -> DistContext | None:
    """This process's distributed context, or ``None`` (single process)."""
    return _CONTEXT


def check_supported(mode: str, *, dp: bool = False, trainer: str = "builtin",
                    quantization: str | None = None, dora: bool = False,
                    penalty: bool = False) -> None:  # fmt: skip
    """Refuses, with one line naming the flags, a combination that cannot train exactly.

    Raises:
        ValueError: DP-SGD under either mode (its per-sample clipping and noise are one
            process's; the budget would be spent per rank); under ``fsdp`` TRL (its
            Trainer would wrap the sharded model in DDP), a quantized base, DoRA, or a
            loss penalty (HetLoRA).
    """
    if mode not in MODES:
        raise ValueError(f"distributed mode {mode!r} is unknown; choose from {MODES}")
    flag = f"--distributed {mode}"
    if dp:
        raise ValueError(
            f"{flag} cannot train with DP-SGD (--dp-epsilon): per-sample clipping, noise and "
            "the privacy budget are one process's; fix: drop --dp-epsilon or train the "
            "client on one process"
        )
    if mode != "fsdp":
        return
    if trainer == "trl":
        raise ValueError(
            f"{flag} cannot train with --trainer trl (fedex-lora shards the model itself, "
            "and TRL's Trainer would wrap it in DDP); fix: --distributed ddp, or --trainer builtin"
        )
    if quantization is not None:
        raise ValueError(
            f"{flag} cannot shard a bitsandbytes base (--quantization {quantization}); "
            "fix: --distributed ddp, or drop --quantization"
        )
    if dora:
        raise ValueError(f"{flag} cannot train DoRA (--dora); fix: --distributed ddp")
    if penalty:
        raise ValueError(
            f"{flag} cannot add a loss penalty on sharded factors (HetLoRA's rank pruning); "
            "fix: --distributed ddp"
        )


def _fail(msg: str):
    raise ValueError(f"--distributed fsdp: {msg}")


def _check_fsdp_model(model: torch.nn.Module) -> None:
    """Refuses, before sharding, what ``fsdp`` cannot hold exactly (one line each)."""
    from fedexlora.bridge import layer_kinds
    from fedexlora.bridge.fold import _holds_in_weight
    from fedexlora.bridge.latent import is_latent
    from fedexlora.bridge.layers import _is_bnb, lora_layers

    for name, layer in lora_layers(model).items():
        adapter = next(iter(layer.lora_A.keys()), "default") if hasattr(layer, "lora_A") else ""
        if _is_bnb(layer.get_base_layer()):
            _fail(f"module {name!r} has a bitsandbytes (quantized) base, which fully_shard "
                  "cannot shard; fix: --distributed ddp, or drop --quantization")  # fmt: skip
        if any(getattr(layer, "use_dora", {}).values()):
            _fail(f"module {name!r} uses DoRA (--dora); fix: --distributed ddp")
        if layer_kinds.kind(layer) != "linear":
            _fail(f"module {name!r} is LoRA on a {layer_kinds.kind(layer)}; only linear "
                  "layers are sharded; fix: --distributed ddp")  # fmt: skip
        if adapter and is_latent(layer, adapter):
            _fail("Fed-SB's latent adapters are not sharded; fix: --distributed ddp")
        if _holds_in_weight(layer):
            _fail(f"module {name!r} folds residuals into its fp32 base weight, which stays "
                  "frozen and sharded; fix: add --fp32-side-branch (or --dtype bf16)")  # fmt: skip
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            _fail(f"parameter {name!r} is tied to {seen[id(p)]!r}; tied weights are not "
                  "sharded; fix: --distributed ddp")  # fmt: skip
        seen[id(p)] = name


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Readies the model for the context's mode, in place, once after loading.

    ``ddp``: nothing to change (each rank holds the model; :func:`load_round_state` makes
    them equal). ``fsdp``: refuses what cannot be sharded (:func:`_check_fsdp_model`),
    gives each LoRA layer a :class:`ShardedSide`, then ``fully_shard``s every module
    that holds parameters (bottom-up), and the model itself as the root.

    Raises:
        ValueError: If no context is set, or the model cannot be sharded exactly.
    """
    ctx = _need()
    if ctx.prepared:
        return model
    if ctx.mode == "fsdp":
        _shard(model, ctx)
    ctx.prepared = True
    return model


def _need() -> DistContext:
    if _CONTEXT is None:
        raise ValueError("no distributed context; call set_context(DistContext(mode=...)) first")
    return _CONTEXT


def _shard(model: torch.nn.Module, ctx: DistContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fedexlora.bridge import fold
    from fedexlora.bridge.adapters import _extra_params
    from fedexlora.bridge.layers import _adapter_name, lora_layers

    _check_fsdp_model(model)
    adapter = _adapter_name(model, None)
    fqn = {id(p): n for n, p in model.named_parameters()}
    names = {}
    for name, layer in lora_layers(model, adapter).items():
        names[f"lora.{name}.A"] = fqn[id(layer.lora_A[adapter].weight)]
        names[f"lora.{name}.B"] = fqn[id(layer.lora_B[adapter].weight)]
    for key, p in _extra_params(model, adapter).items():
        names[f"extra.{key}"] = fqn[id(p)]
    ctx.names = names
    ctx.trainable = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    ctx.side_group = dist.new_group(list(range(dist.get_world_size(ctx.group))), backend=None)
    for layer in lora_layers(model).values():
        old = fold._side(layer, create=True)  # registers the forward hook that applies it
        layer.add_module(fold._SIDE, ShardedSide(*old.shape, dtype=old.dtype, ctx=ctx))
    dev = next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (ctx.world_size,))
    for module in reversed(list(model.modules())):  # children before their parents
        if module is model or isinstance(module, ShardedSide):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)``: rank ``rank``'s contiguous share of ``n`` items (sizes differ by ≤ 1)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# --- a round's state in, the trained state out ---------------------------------------


def _broadcast_flat(flat: Mapping[str, torch.Tensor] | None, ctx: DistContext):
    """Yields ``(key, full tensor)`` on every rank, one tensor in flight at a time."""
    meta = [None]
    if ctx.rank == 0:
        if flat is None:
            raise ValueError("load_round_state: rank 0 needs the round's state (flat)")
        meta = [[(k, tuple(v.shape), v.dtype) for k, v in flat.items()]]
    dist.broadcast_object_list(meta, src=dist.get_global_rank(ctx.group, 0)
                               if ctx.group is not None else 0, group=ctx.group)  # fmt: skip
    src = dist.get_global_rank(ctx.group, 0) if ctx.group is not None else 0
    dev = ctx.comm_device
    for key, shape, dtype in meta[0]:
        if ctx.rank == 0:
            t = flat[key].detach().to(dev).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=dev)
        if t.numel():
            dist.broadcast(t, src=src, group=ctx.group)
        yield key, t


@torch.no_grad()
def load_round_state(model: torch.nn.Module, flat: Mapping[str, torch.Tensor] | None) -> None:
    """Makes every rank's model the client's model of this round.

    ``flat`` is :func:`fedexlora.bridge.steps.client_state` of the client's model, on
    rank 0 only (``None`` elsewhere). It is broadcast tensor by tensor; under ``ddp``
    each rank loads it whole (:func:`~fedexlora.bridge.steps.load_client_state`), under
    ``fsdp`` each keeps its shards of the factors, extras and side branches.

    Raises:
        ValueError: If no context is set, the model is not prepared, or the state does
            not match the model.
    """
    ctx = _need()
    if not ctx.prepared:
        raise ValueError("load_round_state: call prepare_model(model) first")
    pairs = _broadcast_flat(flat, ctx)
    if ctx.mode == "ddp":
        from fedexlora.bridge.steps import load_client_state

        dev = next(model.parameters()).device
        load_client_state(model, {k: v.to(dev) for k, v in pairs})
        return
    _load_sharded(model, pairs, ctx)


def _load_sharded(model, pairs, ctx: DistContext) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fedexlora.bridge import fold
    from fedexlora.bridge.layers import lora_layers

    layers = lora_layers(model)
    sides: dict[str, dict[str, torch.Tensor]] = {}
    seen = set()
    dev = next(model.parameters()).device
    for key, t in pairs:
        if key.startswith("side."):
            module, _, role = key[5:].rpartition(".")
            if module not in layers or role not in ("U", "V", "dense"):
                raise ValueError(f"load_round_state: side-branch state {key!r} is not one "
                                 "this sharded model holds")  # fmt: skip
            # kept whole until the layer's last tensor arrives (U then V: one layer's)
            sides.setdefault(module, {})[role] = t
            if role == "dense" or {"U", "V"} <= set(sides[module]):
                getattr(layers[module], fold._SIDE).set_full(sides.pop(module), dev)
            seen.add(module)
            continue
        name = key.removeprefix("adapter.")
        if name not in ctx.names:
            raise ValueError(f"load_round_state: {key!r} names no trained tensor of the model")
        p = model.get_parameter(ctx.names[name])
        value = t.to(dev)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"load_round_state: {key!r} is {tuple(value.shape)}, the "
                             f"model's is {tuple(p.shape)}")  # fmt: skip
        if p.dtype in (torch.bfloat16, torch.float16) and name.startswith("extra."):
            ctx.masters[name] = value.detach().float().cpu().clone()  # as bridge.masters
        if isinstance(p, DTensor):
            local = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()  # fmt: skip
            p.to_local().copy_(local)
        else:
            p.copy_(value.to(p.dtype))
    for module in layers:
        if module not in seen:
            getattr(layers[module], fold._SIDE).set_full({}, dev)


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The trained tensors, full, on rank 0 (``None`` elsewhere); a collective call.

    What :meth:`~fedexlora.core.state.AdapterState.to_flat` of
    :func:`fedexlora.bridge.adapters.get_state` gives (``lora.<module>.A|B``,
    ``extra.<param>``), CPU, fp32 for half-precision tensors (a half-precision extra as
    its fp32 master plus what training changed).
    """
    ctx = _need()
    if ctx.mode == "ddp":
        if ctx.rank != 0:
            return None
        from fedexlora.bridge.adapters import get_state

        return get_state(model).to_flat()
    flat = _gathered(model, ctx)
    return flat if ctx.rank == 0 else None


def make_upload(model: torch.nn.Module, num_examples: int, *, client_id: int = 0,
                train_loss: float = math.nan, include_A: bool = True, include_B: bool = True,
                include_extra: bool = True):  # fmt: skip
    """:func:`fedexlora.bridge.steps.make_upload` of a sharded (``fsdp``) model, every rank.

    A collective call: each factor and extra is gathered whole (they are small: LoRA),
    so every rank returns the same upload.
    """
    from fedexlora.core.messages import ClientUpload
    from fedexlora.core.state import AdapterState

    state = AdapterState.from_flat(_gathered(model, _need()))
    factors = {
        m: (A if include_A else None, B if include_B else None)
        for m, (A, B) in state.factors.items()
    }
    extra = state.extra if include_extra else {}
    return ClientUpload(client_id, AdapterState(factors, extra), num_examples, float(train_loss))


def _gathered(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Every trained tensor gathered whole, on every rank (``fsdp``)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, fqn in ctx.names.items():
        p = model.get_parameter(fqn)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        value = full.detach().to("cpu", copy=True)
        m = ctx.masters.get(key)
        if m is not None:
            value = m + (value.float() - m.to(value.dtype).float())
        out[key] = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    return out


def rank_nbytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes this rank holds: ``frozen`` and ``trained`` parameters, ``side`` branches.

    A sharded parameter counts its local shard; a side branch its local shard
    (:class:`ShardedSide`) or all of it (:class:`~fedexlora.core.side.SideBranch`).
    """
    from torch.distributed.tensor import DTensor

    from fedexlora.bridge import fold
    from fedexlora.bridge.layers import lora_layers

    out = {"frozen": 0, "trained": 0, "side": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out["trained" if p.requires_grad else "frozen"] += local.numel() * local.element_size()
    for layer in lora_layers(model).values():
        side = getattr(layer, fold._SIDE, None)
        if isinstance(side, ShardedSide):
            out["side"] += side.local_nbytes
        elif side is not None:
            out["side"] += side.nbytes
    return out


# --- the training step's share and gradients -----------------------------------------


def _units(data, idx: Sequence[int]) -> list[int]:
    """What each example weighs in a batch's mean loss: its label tokens (causal LM), or 1."""
    if data.kind != "causal_lm":
        return [1] * len(idx)
    return [sum(1 for y in data.labels[i][1:] if y != -100) for i in idx]


def train_sharded(
    model, data, ctx: DistContext, *, epochs, steps, batch_size, lr, weight_decay, warmup_ratio,
    max_grad_norm, seed, device, desc, progress, autocast, dp, penalty,
) -> TrainResult:  # fmt: skip
    """``train_local`` on this rank's share of every global batch (DDP or FSDP).

    The global batches are the single process's (same generator, same order). Rank ``r``
    takes its contiguous share (:func:`~fedexlora.training.distributed.share`), its mean
    loss weighted by its share of the batch's units (examples; label tokens for a causal
    LM), and the gradients are summed over the ranks: by one all-reduce of the trainable
    gradients (``ddp``), or by ``fully_shard``'s reduce-scatter (``fsdp``, which
    averages: the loss is scaled by the world size). Clipping, the schedule and AdamW
    then act on the global batch's gradient. A rank whose share is empty runs one example
    at weight 0 (FSDP's collectives need every rank's forward). Dropout is seeded per
    rank (``seed`` on rank 0), so it cannot equal one process's masks: exactness against
    one process holds without dropout.
    """
    from fedexlora.training.batches import TrainResult, _schedule

    check_supported(ctx.mode, dp=dp is not None, penalty=penalty is not None)
    if ctx.mode == "fsdp":
        now = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
        if now != ctx.trainable:
            raise ValueError(
                "--distributed fsdp: this round trains other parameters than were sharded "
                "(a method that freezes factors by round, as RoLoRA); fix: --distributed ddp"
            )
    n = len(data)
    if n == 0:
        raise ValueError("cannot train on an empty dataset")
    total = steps if steps is not None else max(1, math.ceil(epochs * math.ceil(n / batch_size)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total, warmup_ratio))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1_000_003 * ctx.rank)  # dropout: the rank's own
    model.train()
    with warnings.catch_warnings():
        # fully_shard warns that an in-place op on a layer's output would skip its
        # pre-backward all-gather; peft adds the LoRA branch out of place, as the side
        # branch does, and the tests compare the gradients with one process's
        warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
        losses = _steps(model, data, ctx, total=total, batch_size=batch_size, gen=gen,
                        params=params, opt=opt, sched=sched, device=device, autocast=autocast,
                        penalty=penalty, max_grad_norm=max_grad_norm, desc=desc,
                        progress=progress)  # fmt: skip
    model.eval()
    losses = all_sum(losses, ctx)
    return TrainResult(loss=sum(losses) / len(losses), steps=total, num_examples=n)


def _steps(model, data, ctx: DistContext, *, total, batch_size, gen, params, opt, sched,
           device, autocast, penalty, max_grad_norm, desc, progress) -> list[float]:  # fmt: skip
    """The optimizer steps of :func:`train_sharded`; each rank's weighted losses."""
    n = len(data)
    order: list[int] = []
    losses = []
    bar = tqdm(range(total), desc=desc, leave=False, disable=not progress or ctx.rank != 0,
               dynamic_ncols=True)  # fmt: skip
    for _ in bar:
        if len(order) < batch_size:
            order += torch.randperm(n, generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        losses.append(backward_share(model, data, idx, ctx, params=params, device=device,
                                     autocast=autocast, penalty=penalty))  # fmt: skip
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return losses


def backward_share(model, data, idx: Sequence[int], ctx: DistContext, *, params, device,
                   autocast=None, penalty=None) -> float:  # fmt: skip
    """This rank's share of the global batch ``idx``: forward, backward, gradients summed.

    Afterwards every trainable gradient is the single process's gradient of the global
    batch's mean loss (whole on every rank under ``ddp``; this rank's shard under
    ``fsdp``). Returns this rank's part of the batch's mean loss (their sum is the mean).
    """
    from fedexlora.training.batches import _amp, _collate

    rank, world = ctx.rank, ctx.world_size
    lo, hi = share(len(idx), rank, world)
    units = _units(data, idx)
    mine, own = list(idx[lo:hi]), sum(units[lo:hi])
    weight = own / sum(units) if sum(units) else 0.0
    # padded as the global batch is: the same shapes per example as in one process
    longest = max(len(data.input_ids[i]) for i in idx)
    batch = _collate(data.subset(mine or list(idx[:1])), device, pad_to=longest)
    with _amp(device, autocast):
        out = model(**batch)
    if own:
        loss = out.loss
        # fully_shard's reduce-scatter averages over the ranks: scaled back to a sum
        objective = loss * (weight * (world if ctx.mode == "fsdp" else 1))
        part = float(loss.detach()) * weight
    else:  # nothing of this batch's mean here: zero gradients, the collectives still run
        objective, part = out.logits.float().sum() * 0.0, 0.0
    if penalty is not None:  # ddp only: each rank's share of it, summed once
        objective = objective + penalty() / world
    objective.backward()
    if ctx.mode == "ddp":
        all_reduce_grads(params, ctx)
    return part


def all_reduce_grads(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Sums the gradients of ``params`` over the ranks (one all-reduce per dtype)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    dev = ctx.comm_device
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads).to(dev)
        dist.all_reduce(flat, group=ctx.group)
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(s)


def all_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise sums of ``values`` over the ranks (fp64)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.comm_device)
    dist.all_reduce(t, group=ctx.group)
    return t.cpu().tolist()
