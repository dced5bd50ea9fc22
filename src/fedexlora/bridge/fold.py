"""The peft bridge's folds: ``scale * residual`` into each LoRA layer's frozen base.

For a bf16/fp16 or bitsandbytes-quantized weight what was folded accumulates in a
:class:`~fedexlora.core.side.SideBranch` (fp32, factored or dense, whichever is smaller)
that the forward pass applies, so no precision is lost. An fp32 (or fp64) weight takes
each residual in place, with one ``addmm_``, and an
:class:`~fedexlora.core.side.Accumulator` records them (factored, while smaller than the
weight) so that the weight can be rebuilt from ``W0`` bit for bit: the model is a function
of the residuals it received, in the order it received them. That costs nothing in the
forward pass but rounds ``W`` each time (``~6e-8 |W|``: about 1e-5 of a small update);
:func:`use_side_branch` keeps an fp32 model's residuals in a side branch too, exact to
fp32's rounding of the residual itself. Also here: a layer's base and effective weights,
the side branches' state for a checkpoint, and their rank caps (``--side-budget``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from peft.tuners.lora import LoraLayer

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.layers import _adapter_name, _is_bnb, lora_layers
from fedexlora.bridge.sharing import SHARED, route_shared
from fedexlora.core.aggregation import Residual, residuals_from_flat, residuals_to_flat
from fedexlora.core.side import Accumulator, SideBranch, rank_cap

__all__ = [
    "adapter_nbytes",
    "base_nbytes",
    "base_weight",
    "effective_weight",
    "fold_layer",
    "fold_residuals",
    "folded_delta",
    "folded_weights",
    "load_side_state",
    "restore_base",
    "side_caps",
    "side_nbytes",
    "side_state",
    "side_weight",
    "snapshot_base",
    "use_side_branch",
]

_SIDE = "fedex_side"  # child module of a LoraLayer holding its SideBranch (forward hook)
_ACC = "fedex_folded"  # the same for an fp32 layer: not hooked, materialized in the weight
_BESIDE = "_fedex_beside"  # set on a LoRA layer by use_side_branch: fp32 folds go beside


def _holds_in_weight(layer: LoraLayer) -> bool:
    """Whether the residual is folded into the base weight (fp32/fp64, unquantized).

    Not when :func:`use_side_branch` switched the layer to a side branch, nor when
    another module holds the same weight (:func:`fedexlora.bridge.sharing.route_shared`:
    a tied embedding, a replicated layer), which folding in place would change too.
    """
    base = layer.get_base_layer()
    if _is_bnb(base) or getattr(layer, _BESIDE, False) or getattr(layer, SHARED, None):
        return False
    return layer_kinds.base_param(layer).dtype in (torch.float32, torch.float64)


def use_side_branch(model: torch.nn.Module) -> torch.nn.Module:
    """Keeps every residual of ``model`` in an fp32 side branch, fp32 bases included.

    By default an fp32 layer takes each residual into its weight in place (one
    ``addmm_``, nothing added to the forward pass), which rounds the weight to fp32 each
    time: about ``6e-8 |W|``, so 1e-5 to 1e-4 of a small update (a low learning rate, a
    few steps). With the side branch the base stays ``W0`` and the sum of the residuals
    is held beside it (factored while smaller, else dense; fp64 for an fp64 base), exact
    to fp32's rounding of that sum, at the cost of one more (low-rank or dense) matmul
    per LoRA layer in the forward pass. Call it before the first fold, on every copy of
    the model (server and clients) alike. Returns ``model``. A DoRA layer keeps folding
    into its weight (peft's DoRA norm reads the base weight only, never a side branch).

    Raises:
        ValueError: If a residual was already folded into one of the model's weights.
    """
    for name, layer in lora_layers(model).items():
        if layer_kinds.kind(layer) == "param":
            continue  # target_parameters: held in its fp32 parameter (no forward to hook)
        if any(layer.use_dora.values()):
            continue  # DoRA: peft's norm reads the base weight only, so it folds there
        acc = _acc(layer)
        if acc is not None and acc.rank:
            raise ValueError(
                f"module {name!r} already holds folded residuals in its weight; call "
                "use_side_branch on the freshly loaded model, before the first round"
            )
        setattr(layer, _BESIDE, True)
    return model


def _side(layer: LoraLayer, create: bool = False) -> SideBranch | None:
    """The layer's side branch (created and hooked into its forward when asked)."""
    side = getattr(layer, _SIDE, None)
    if side is None and create:
        A = layer_kinds.read_A(layer)
        f64 = getattr(layer.get_base_layer().weight, "dtype", None) == torch.float64
        dtype = torch.float64 if f64 else torch.float32  # an fp64 base's sum stays fp64
        side = SideBranch(*layer_kinds.dims(layer), device=A.device, dtype=dtype)
        layer.add_module(_SIDE, side)
        layer.register_forward_hook(_apply_side)
    return side


def _acc(layer: LoraLayer, create: bool = False) -> Accumulator | None:
    """An fp32 layer's record: what was folded into it, and its weight before (``base0``)."""
    acc = getattr(layer, _ACC, None)
    if acc is None and create:
        weight = layer_kinds.base_param(layer)
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        acc = Accumulator(*layer_kinds.dims(layer), device=weight.device, dtype=dtype)
        acc.register_buffer("base0", weight.detach().clone(), persistent=False)
        layer.add_module(_ACC, acc)
    return acc


def _branch(layer: LoraLayer, create: bool = False) -> SideBranch | Accumulator | None:
    """Where the layer accumulates what is folded into it (either kind)."""
    if _holds_in_weight(layer):
        return _acc(layer, create)
    return _side(layer, create)


@torch.no_grad()
def _fold_weight(layer: LoraLayer, R: Residual) -> None:
    """``W += R`` in place: one ``addmm_`` (one ``add_`` for a dense ``R``).

    ``R`` is already scaled, in the weight's dtype (:meth:`Accumulator.record`). The same
    residuals folded in the same order give the same bits, which is what a rebuild from
    :func:`side_state` relies on.
    """
    layer_kinds.fold_into_weight(layer, R)  # orientation and reshape: the layer's kind


@torch.no_grad()
def _rebuild(layer: LoraLayer, parts: list[Residual], weight: torch.Tensor | None) -> None:
    """An fp32 layer back at ``W0`` plus ``parts`` folded in order, or at ``weight``."""
    acc = _acc(layer, create=bool(parts) or weight is not None)
    if acc is None:
        return
    w = layer_kinds.base_param(layer).data
    w.copy_(acc.base0)
    acc.clear()
    if weight is not None:
        if tuple(weight.shape) != tuple(w.shape):
            raise ValueError(f"weight state is {tuple(weight.shape)}, expected {tuple(w.shape)}")
        w.copy_(weight)
        acc.parts = None  # the weight is the state
        return
    for part in parts:
        _fold_weight(layer, acc.record(part))


def _apply_side(layer: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return layer_kinds.side_output(layer, getattr(layer, _SIDE), args[0], out)


def base_weight(layer: LoraLayer) -> torch.Tensor:
    """The frozen base weight as the forward pass uses it: fp64, ``(d, n)`` orientation.

    A bitsandbytes weight is dequantized (peft's own helper); a Conv1D weight is
    transposed.
    """
    base = layer.get_base_layer()
    if _is_bnb(base):
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(base.weight, state=getattr(base, "state", None)).double()
    return layer_kinds.base_matrix(layer)


def side_weight(layer: LoraLayer) -> torch.Tensor | None:
    """The layer's side-branch correction in fp64 ``(d, n)``, or ``None`` if it has none."""
    side = _side(layer)
    return None if side is None else side.to_dense()


def effective_weight(layer: LoraLayer, adapter: str = "default", *, lora: bool = True):
    """Base + side branch (+ ``scale * B @ A`` when ``lora``), fp64 ``(d, n)``.

    This is the weight the forward pass applies: what exactness is measured on.
    """
    w = base_weight(layer)
    extra = side_weight(layer)
    if extra is not None:
        w = w + extra.to(w.device)
    if lora:
        A = layer_kinds.read_A(layer, adapter).detach().double()
        B = layer_kinds.read_B(layer, adapter).detach().double()
        w = w + float(layer.scaling[adapter]) * (B @ A).to(w.device)
    return w


def side_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What every layer accumulated, as flat tensors (``side.<module>.U|V|dense``).

    For a bf16/fp16 or quantized layer that is its side branch. For an fp32 layer, the
    residuals folded into its weight since it was loaded, factored, with their ranks
    (``side.<module>.splits``) so that they are folded again one by one; once they would
    outgrow one dense ``(d, n)``, the weight itself (``side.<module>.weight``, as large).
    At most one ``(d, n)`` per layer either way.
    """
    out = {}
    for name, layer in lora_layers(model).items():
        branch = _branch(layer)
        if branch is None or not branch.rank:
            continue
        if isinstance(branch, Accumulator) and branch.outgrown:
            out[f"side.{name}.weight"] = layer_kinds.base_param(layer).detach().clone()
            continue
        out.update(residuals_to_flat("side", {name: branch.residual}))
        splits = getattr(branch, "splits", [])
        if len(splits) > 1:  # an fp32 layer's residuals, folded again in order on load
            out[f"side.{name}.splits"] = torch.tensor(splits, dtype=torch.int64)
    return out


@torch.no_grad()
def load_side_state(model: torch.nn.Module, flat: Mapping[str, torch.Tensor]) -> None:
    """Sets what each layer accumulated from :func:`side_state`'s tensors (others emptied).

    An fp32 layer's weight is rebuilt from the weight it had before anything was folded
    (``W0``), the residuals folded again in their order, so load this into a freshly
    loaded model or into one that folded only through this module.

    Raises:
        ValueError: If a tensor names an unknown module or has the wrong shape, or a
            base weight is shared with a trained parameter
            (:func:`~fedexlora.bridge.sharing.route_shared`).
    """
    route_shared(model)
    layers = lora_layers(model)
    extra = {}  # the fp32 layers' ".splits" and ".weight" (see side_state)
    for k, v in flat.items():
        for tail in (".splits", ".weight"):
            if k.endswith(tail):
                extra.setdefault(tail, {})[k[len("side.") : -len(tail)]] = v
    splits, weights = extra.get(".splits", {}), extra.get(".weight", {})
    residuals = residuals_from_flat(
        "side", {k: v for k, v in flat.items() if not k.endswith((".splits", ".weight"))}
    )
    unknown = sorted((set(residuals) | set(weights)) - set(layers))
    if unknown:
        raise ValueError(f"side-branch state for unknown modules {unknown[:3]}")
    for name, layer in layers.items():
        if _holds_in_weight(layer):
            cut = splits.get(name)
            parts = []
            if name in residuals:
                parts = Accumulator.split(residuals[name], None if cut is None else cut.tolist())
            _rebuild(layer, parts, weights.get(name))
            continue
        if name in weights:
            raise ValueError(f"module {name!r}: a weight state, but its base is not fp32")
        branch = _side(layer, create=name in residuals)
        if branch is not None:
            branch.set(residuals[name] if name in residuals else Residual.zero(*branch.shape))


def side_nbytes(model: torch.nn.Module) -> int:
    """Bytes held by all side branches."""
    return sum(s.nbytes for s in (_side(x) for x in lora_layers(model).values()) if s)


def adapter_nbytes(model: torch.nn.Module, adapter: str = "default") -> int:
    """Bytes of one adapter's LoRA factors in ``model``.

    ``lora_A`` and ``lora_B`` (a Fed-SB layer's basis and core, an embedding's
    ``lora_embedding_*``, DoRA's magnitudes) of ``adapter`` only: not the other adapters
    of a model with several (``client_ranks``), the base weights, a side branch, or a
    trained head (``modules_to_save``).
    """
    return sum(
        p.numel() * p.element_size()
        for layer in lora_layers(model, adapter).values()
        for name, p in layer.named_parameters()
        if name.startswith("lora_") and adapter in name.split(".")
    )


@torch.no_grad()
def folded_delta(model: torch.nn.Module, name: str, adapter: str | None = None) -> Residual:
    """What was folded into module ``name`` since it was loaded, in ``adapter``'s units.

    ``adapter`` defaults to the model's active one: the one federated (``lora_layers``).

    That is ``sum R`` over the residuals :func:`fold_residuals` gave it (before the LoRA
    scale): the server's record of its base delta, read from the model instead of kept
    twice (:attr:`fedexlora.server.Server.delta_source`). An fp32 layer gives its record
    while it is factored, and ``(W - W0) / scale`` once the weight itself is the state;
    a bf16/fp16 or quantized layer gives its side branch. Returned in fp32 (fp64 for an
    fp64 layer) on the CPU.

    Raises:
        ValueError: If ``name`` is not a LoRA layer of the model.
    """
    adapter = _adapter_name(model, adapter)
    layers = lora_layers(model, adapter)
    if name not in layers:
        raise ValueError(f"no LoRA layer {name!r} in the model")
    layer = layers[name]
    scale = float(layer.scaling[adapter])
    d, n = layer_kinds.dims(layer, adapter)
    branch = _branch(layer)
    if branch is None or not branch.rank:
        return Residual.zero(d, n)
    cpu = lambda t: t.detach().to("cpu")  # noqa: E731
    if isinstance(branch, Accumulator) and branch.outgrown:
        w = layer_kinds.base_param(layer).detach()
        # in the weight's dtype: W and W0 hold the delta to their own precision, and a
        # client that folds it back onto W0 comes within rounding of W
        delta = layer_kinds.weight_delta(layer, cpu(w), cpu(branch.base0)).div_(scale)
        return Residual((d, n), dense=delta.contiguous(), stored_rank=min(d, n))
    R = branch.residual.scaled(1.0 / scale)
    return Residual(
        R.shape,
        U=None if R.U is None else cpu(R.U),
        V=None if R.V is None else cpu(R.V),
        dense=None if R.dense is None else cpu(R.dense),
        stored_rank=R.stored_rank,
    )


def folded_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights that residuals are folded into (fp32/fp64 layers only)."""
    return {
        n: layer_kinds.base_param(layer)
        for n, layer in lora_layers(model).items()
        if _holds_in_weight(layer)
    }


def snapshot_base(model: torch.nn.Module) -> dict:
    """Everything folding changes (what each layer accumulated), to restore later."""
    return {"side": side_state(model)}


@torch.no_grad()
def restore_base(model: torch.nn.Module, snapshot: dict) -> None:
    """Restores :func:`snapshot_base`'s state bit for bit."""
    load_side_state(model, snapshot["side"])


@torch.no_grad()
def fold_residuals(
    model: torch.nn.Module,
    residuals: Mapping[str, Residual],
    adapter: str | None = None,
    *,
    side_rank: int | Mapping[str, int | None] | None = None,
) -> None:
    """Applies ``scale * residual`` to each layer's frozen base, in place.

    The scale and the orientation come from the peft layer. Where the base weight is
    bf16/fp16 or quantized (bitsandbytes) it is never rounded into: the scaled residual is
    added to the layer's :class:`SideBranch` (appended, and re-factored in fp64 on its
    ladder: :meth:`SideBranch.add`), which the forward pass applies. Where it is fp32 (or
    fp64) the residual goes into the weight with one ``addmm_`` and is recorded
    (:class:`Accumulator`), so two models that received the same residuals hold the same
    bits, whether they were rebuilt from :func:`side_state` or folded round by round.
    ``side_rank`` caps each branch's rank, one cap or per layer (:func:`side_caps`; the
    server's capped modes send residuals that keep it there; the cap only drops the float
    noise of their cancellation).

    A layer whose base weight another module holds too (a tied ``lm_head``, a layer of
    peft's ``layer_replication``) keeps its residuals in a side branch whatever its dtype
    (:func:`fedexlora.bridge.sharing.route_shared`, checked here before each fold).

    Raises:
        ValueError: If a residual names an unknown module or has the wrong shape, or a
            base weight is shared with a trained parameter.
    """
    adapter = _adapter_name(model, adapter)
    route_shared(model, adapter)
    layers = lora_layers(model, adapter)
    for name, R in residuals.items():
        if name not in layers:
            raise ValueError(f"residual for unknown module {name!r}")
        fold_layer(layers[name], R, adapter, side_rank=rank_cap(side_rank, name), name=name)


@torch.no_grad()
def fold_layer(
    layer: LoraLayer,
    R: Residual,
    adapter: str = "default",
    *,
    side_rank: int | None = None,
    name: str = "",
) -> None:
    """:func:`fold_residuals` for one LoRA layer (``name`` only for error messages)."""
    d, n = layer_kinds.dims(layer, adapter)
    if tuple(R.shape) != (d, n):
        raise ValueError(f"module {name!r}: residual is {R.shape}, expected {(d, n)}")
    if R.is_zero:
        return
    scale = float(layer.scaling[adapter])
    if _holds_in_weight(layer):
        _fold_weight(layer, _acc(layer, create=True).record(R.scaled(scale)))
        return
    if layer.use_dora.get(adapter, False):  # a side branch would escape peft's DoRA norm
        raise ValueError(
            f"module {name!r} uses DoRA (use_dora=True) on a base weight that another "
            "module holds too (tied or replicated), which fedex-lora cannot fold into "
            "exactly; leave it out of target_modules or set use_dora=False"
        )
    branch = _side(layer, create=True)
    branch.max_rank = side_rank
    branch.add(R.scaled(scale))


def base_nbytes(layer: LoraLayer) -> int:
    """Bytes of a LoRA layer's frozen base weight as stored (4-bit: packed, and its scales)."""
    w = layer_kinds.base_param(layer)
    total = w.numel() * w.element_size()
    state = getattr(w, "quant_state", None)  # bitsandbytes 4-bit: per-block scales
    while state is not None:
        absmax = getattr(state, "absmax", None)
        if absmax is not None:
            total += absmax.numel() * absmax.element_size()
        state = getattr(state, "state2", None)  # double quantization: the scales' own
    scb = getattr(w, "SCB", None)  # bitsandbytes int8: per-row scales
    if scb is not None:
        total += scb.numel() * scb.element_size()
    return int(total)


def side_caps(
    model: torch.nn.Module, *, side_rank: int | None = None, budget: float | None = None
) -> int | dict[str, int | None] | None:
    """The side branches' rank caps: ``side_rank``, or each layer's own for ``budget``.

    ``side_rank`` is one cap for every layer. For ``budget`` (``--side-budget``), a layer
    of base ``(d, n)`` stored in ``b`` bytes may hold ``budget * b`` bytes beside it: an
    fp32 side branch ``U (d, q) V (q, n)`` of rank ``q = floor(budget * b / (4 (d + n)))``;
    where that rank would hold the dense ``(d, n)`` anyway, ``None`` (no cap: the layer
    stays exact). Every process computes the same caps from the same model.

    Raises:
        ValueError: If ``budget`` holds less than one rank for some layer: a cap of 0
            would fold nothing there, and the error held back would only grow.
    """
    if budget is None:
        return side_rank
    caps: dict[str, int | None] = {}
    short: dict[str, float] = {}  # layer -> the budget one rank of it needs
    adapter = _adapter_name(model, None)
    for name, layer in lora_layers(model, adapter).items():
        d, n = layer_kinds.dims(layer, adapter)
        q = int(budget * base_nbytes(layer) // (4 * (d + n)))
        caps[name] = None if q * (d + n) >= d * n else q
        if caps[name] == 0:
            short[name] = 4 * (d + n) / base_nbytes(layer)
    if short:
        worst = max(short, key=short.__getitem__)
        named = worst.removeprefix("base_model.model.")
        raise ValueError(
            f"--side-budget {budget:g} holds less than one rank of side branch in "
            f"{len(short)} of {len(caps)} layers (one rank of {named!r} "
            f"takes {short[worst]:.3g} of its base's bytes): those layers would fold nothing "
            f"and hold back an error that only grows; fix: --side-budget "
            f"{_round_up(short[worst]):g} or more, or leave it unset"
        )
    return caps


def _round_up(x: float) -> float:
    """``x`` rounded up to two significant digits."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / scale - 1e-9) * scale
