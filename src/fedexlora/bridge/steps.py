"""The steps of one round on a model, for any loop: the engines' and yours.

A client applies the server's payload to its model, trains however it likes, and makes
its upload. A server that keeps its own copy of the global model applies each round's
outcome to it. Everything else (sampling, payloads, validation, aggregation) is the
:class:`fedexlora.server.Server`'s. See ``docs/API.md``.

Client::

    apply_payload(model, payload)      # residual folded or side-branched, global factors
    ...train model with your own loop...
    upload = make_upload(model, num_examples, client_id=i)

Server::

    server = Server(get_state(model), layer_info(model), num_clients=3)
    payloads = {i: server.payload_for(i) for i in server.sample(rnd)}
    outcome = server.aggregate(uploads)
    apply_outcome(model, server, outcome, uploads)   # the server's own global model
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedexlora.bridge.adapters import get_state, lift, set_state
from fedexlora.bridge.dora import dora_deviation, is_dora, write_row_scales
from fedexlora.bridge.fold import (
    effective_weight,
    fold_layer,
    fold_residuals,
    load_side_state,
    side_state,
)
from fedexlora.bridge.layers import _adapter_name, lora_layers
from fedexlora.bridge.sharing import route_shared
from fedexlora.bridge.whole import extras_deviation, frozen_changes
from fedexlora.core.messages import ClientUpload, Payload, RoundOutcome
from fedexlora.core.methods.spec import FP32_UNIT_ROUNDING
from fedexlora.core.side import rank_cap
from fedexlora.core.state import AdapterState

__all__ = ["apply_outcome", "apply_payload", "client_state", "load_client_state", "make_upload"]


@torch.no_grad()
def apply_payload(
    model: torch.nn.Module,
    payload: Payload,
    *,
    side_rank: int | Mapping[str, int | None] | None = None,
    adapter: str | None = None,
) -> None:
    """Brings a client's model to the global model the payload describes.

    Folds ``scale * residual`` into each adapted layer's base (an fp32 weight directly; a
    bf16/fp16 or quantized one through its fp32 side branch), then loads the global
    factors and extras. The model must hold the base version the payload was built for:
    what its previous payloads left (see :meth:`fedexlora.server.Server.payload_for`).
    A ``reset`` payload (a client's first, or one for a client away longer than the
    server keeps history) starts from the pretrained weights: whatever the model folded
    before is dropped first, so any model of the client's architecture will do.

    Args:
        model: The client's peft model.
        payload: From :meth:`~fedexlora.server.Server.payload_for` (or
            :meth:`~fedexlora.server.Payload.from_bytes` on the client's side).
        side_rank: The run's side-branch cap, if any: one rank, or per layer
            (:func:`fedexlora.bridge.fold.side_caps`).
        adapter: The peft adapter the client trains (heterogeneous ranks: the payload is
            in that adapter's rank and scale); default: the active one.

    Raises:
        ValueError: If the payload's modules or shapes do not match the model, or its
            LoRA scaling is not the model's (a client built with another ``lora_alpha``,
            ``r`` or ``use_rslora`` than the server's: its fold would be off by the ratio).
    """
    _check_scales(model, payload.scales, adapter)
    if payload.reset:
        load_side_state(model, {})  # back to W0: every layer's accumulated delta dropped
    fold_residuals(model, payload.residuals, adapter, side_rank=side_rank)
    set_state(model, payload.state, adapter=adapter)


def _check_scales(model, scales: Mapping[str, float], adapter: str | None) -> None:
    adapter = _adapter_name(model, adapter)
    for name, layer in lora_layers(model, adapter).items():
        want = scales.get(name)
        have = float(layer.scaling[adapter])
        if want is not None and not math.isclose(have, want, rel_tol=1e-6):
            raise ValueError(
                f"module {name!r}: the client's LoRA scaling is {have:g}, the server's "
                f"{want:g}; build every party with the same LoraConfig (lora_alpha, r, "
                "use_rslora)"
            )


def client_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a client must keep between rounds to rebuild its model, as flat tensors.

    What payloads have folded into each adapted layer (``side.<module>.*``: factored
    while that is smaller than the layer's weight, else that fp32 weight itself; at most
    one ``(d, n)`` per layer) and its adapter (``adapter.*``). A freshly loaded
    (pretrained) model plus this state is the client's model, bit for bit
    (:func:`load_client_state`). Store it where
    your client lives between rounds (a Flower ``Context``, a file).
    """
    out = dict(side_state(model))
    out.update({f"adapter.{k}": v for k, v in get_state(model).to_flat().items()})
    return out


@torch.no_grad()
def load_client_state(model: torch.nn.Module, flat: dict[str, torch.Tensor]) -> None:
    """Restores :func:`client_state` into a freshly loaded (pretrained) model.

    Raises:
        ValueError: If the state does not match the model's layers or shapes.
    """
    load_side_state(model, {k: v for k, v in flat.items() if k.startswith("side.")})
    adapter = {k[8:]: v for k, v in flat.items() if k.startswith("adapter.")}
    set_state(model, AdapterState.from_flat(adapter))


def make_upload(
    model: torch.nn.Module,
    num_examples: int,
    *,
    client_id: int = 0,
    train_loss: float = math.nan,
    include_A: bool = True,
    include_B: bool = True,
    include_extra: bool = True,
) -> ClientUpload:
    """What a client sends back after training: its factors, extras and example count.

    Args:
        model: The client's trained peft model.
        num_examples: Examples it trained on (its aggregation weight).
        client_id: The client's id, as the server sampled it.
        train_loss: Optional, for the server's records.
        include_A: ``False`` for FFA-LoRA (A is frozen).
        include_B: ``False`` for RoLoRA's rounds that train A (B is frozen), and for
            FedSA-LoRA (each client keeps its B).
        include_extra: ``False`` for FedSA-LoRA (each client keeps its task head).
    """
    state = get_state(model, include_A=include_A, include_B=include_B, include_extra=include_extra)
    return ClientUpload(client_id, state, num_examples, float(train_loss))


@torch.no_grad()
def apply_outcome(
    model, server, outcome: RoundOutcome, uploads: list[ClientUpload] | None = None
) -> dict[str, float]:
    """Applies a round's outcome to the server's global model, and measures it there.

    Loads the new global factors, folds each layer's residual (into the base weight, or
    its side branch), and compares the layer's effective weight afterwards (base, side
    branch and adapter, as the forward pass applies them) with the ideal
    ``W + sum_i p_i (T_i + s_i B_i A_i)`` computed in fp64 from the accepted uploads
    (:meth:`Server.ideal_update`). One layer at a time, so at most three dense fp64
    copies of one layer exist at once.

    The rest of the model is measured too (:mod:`fedexlora.bridge.whole`): each trained
    extra (a task head) against the weighted average of the uploads, and every frozen
    parameter against the bits it had when the model was first measured.

    Args:
        model: The server's copy of the global model (as of the previous round).
        server: The server that produced ``outcome`` (before its next payload).
        outcome: From :meth:`~fedexlora.server.Server.aggregate`.
        uploads: The uploads of the round; without them nothing is measured.

    Returns:
        Per layer ``||W_model - W_ideal|| / ||W_ideal - W_previous||``: the error relative
        to the round's update (empty when no upload was accepted); the same per trained
        extra (by parameter name, against the average's nearest fp32 value); ``inf``
        for a frozen parameter whose bits changed. This is what the lossy modes really
        apply, not what the server meant to. ``outcome.rounding`` gets, per layer,
        ``2^-24 ||W_model|| / ||W_ideal - W_previous||``: fp32's unit rounding of the
        weights, relative to the same update.
    """
    adapter = _adapter_name(model, None)  # the one adapter federated (lora_layers)
    route_shared(model, adapter)  # a shared base weight (tied, replicated): a side branch
    measure = bool(uploads) and bool(outcome.weights) and outcome.previous is not None
    if measure:
        frozen_changes(model, first=True)  # the frozen parameters' bits, before any fold
    set_state(model, server.state, adapter)
    out = {}
    for name, layer in lora_layers(model, adapter).items():
        before = effective_weight(layer, adapter, lora=False) if measure else None
        if name in outcome.residuals:  # one layer at a time: no rescan of the model
            cap = rank_cap(server.side_rank, name)
            fold_layer(layer, outcome.residuals[name], adapter, side_rank=cap, name=name)
        if is_dora(layer, adapter):  # m = Dbar ||W' + s Bbar Abar||, on the folded base
            write_row_scales({name: layer}, server.state.extra, adapter)
            if before is not None:
                scale = server.layers[name].scale
                out[name], norm, den = dora_deviation(
                    layer, name, before, uploads, outcome, scale, adapter
                )
                if den > 0:
                    outcome.rounding[name] = FP32_UNIT_ROUNDING * norm / den
            continue
        if before is None:
            continue
        after = effective_weight(layer, adapter)
        # in the server's coordinates, lifted to the layer's (B M A for Fed-SB)
        update = lift(layer, server.ideal_update(name, uploads, outcome), adapter)
        ideal = before + update.to(before.device)
        A0, B0 = outcome.previous.factors[name]
        start = lift(layer, server.layers[name].scale * (B0.double() @ A0.double()), adapter)
        move = (ideal - before) - start.to(before.device)
        den = float(torch.linalg.norm(move))
        out[name] = float(torch.linalg.norm(after - ideal)) / den if den > 0 else 0.0
        if den > 0:  # what fp32's rounding of these weights alone can explain
            outcome.rounding[name] = FP32_UNIT_ROUNDING * float(torch.linalg.norm(after)) / den
    if measure:  # the rest of the model: trained extras, and frozen parameters' bits
        out.update(extras_deviation(model, server, outcome, uploads))
        out.update(frozen_changes(model))
    return out
