"""Base weights held by more than one module, found by storage, and where their residuals go.

A LoRA layer's frozen base weight is not always its own. A causal LM with tied word
embeddings holds one tensor as ``lm_head.weight`` and ``embed_tokens.weight``; peft's
``layer_replication`` makes copies of decoder layers that share every base weight while
each copy trains its own adapter. Folding a residual into such a weight in place would
change every other holder too (the input embedding; every other copy of the layer, which
then receives each copy's update). So sharing is detected, never assumed: every
parameter and buffer of the model is grouped by the storage it lives in
(``untyped_storage().data_ptr()``, not its name), and a LoRA layer whose base weight is
in a group with any other holder keeps its residuals in an fp32 side branch beside the
weight (:mod:`fedexlora.bridge.fold`), whatever its dtype: each holder then ends at its
own ideal (the embedding unchanged, each replicated copy with its own residual) and the
shared tensor stays bit-identical. Where no placement is exact, a trained parameter that
shares the base (the base would move with the aggregated parameter, and no export could
give both), it is refused before any fold, naming both modules.
"""

from __future__ import annotations

import torch

from fedexlora.bridge.layers import _adapter_name, lora_layers, other_holders, storage_groups

__all__ = ["SHARED", "base_holders", "route_shared", "storage_groups"]

SHARED = "_fedex_shared"  # set on a LoRA layer: the other holders of its base weight


def base_holders(
    model: torch.nn.Module, adapter: str | None = None
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Per LoRA layer whose base weight is shared, the other parameters that hold it.

    Args:
        model: A peft model.
        adapter: The adapter whose LoRA layers are looked at (default: the active one).

    Returns:
        ``{layer name: [(parameter name, tensor), ...]}``, only for the layers whose base
        weight's storage is held by another module (a tied embedding, another copy of a
        replicated layer); names as ``model.named_parameters()`` gives them.
    """
    groups = storage_groups(model)
    out = {}
    for name, layer in lora_layers(model, _adapter_name(model, adapter)).items():
        others = other_holders(groups, name, layer)
        if others:
            out[name] = others
    return out


def route_shared(model: torch.nn.Module, adapter: str | None = None) -> dict[str, list[str]]:
    """Sends the residuals of every LoRA layer with a shared base weight to a side branch.

    Called by every fold of :mod:`fedexlora.bridge.fold` (and when a run builds its
    model) before anything is folded: it marks each such layer (its residuals then go to
    an fp32 side branch, the shared weight is never written) and returns what it found.

    Args:
        model: A peft model.
        adapter: The adapter whose LoRA layers are looked at (default: the active one).

    Returns:
        ``{layer name: [other holders' parameter names]}``.

    Raises:
        ValueError: If a trained parameter shares a LoRA layer's base weight (no exact
            placement: the base would move with it), or a layer with a shared base
            already holds residuals folded into it (the other holders were changed).
    """
    found = {}
    layers = lora_layers(model, _adapter_name(model, adapter))
    for name, others in base_holders(model, adapter).items():
        layer = layers[name]
        trained = [n for n, t in others if getattr(t, "requires_grad", False)]
        if trained:
            raise ValueError(
                f"module {name!r}: its frozen base weight is also the trained parameter "
                f"{trained[0]!r} (tied or shared), so no exact placement of the federated "
                f"update exists; fix: freeze {trained[0]!r} (or train a copy of it through "
                f"peft's modules_to_save), or leave {name.rsplit('.', 1)[-1]!r} out of "
                "target_modules"
            )
        acc = getattr(layer, "fedex_folded", None)  # fold.py's record of in-place folds
        if acc is not None and acc.rank and not getattr(layer, SHARED, None):
            raise ValueError(
                f"module {name!r}: residuals were folded into its base weight, which "
                f"{others[0][0]!r} holds too (tied or shared), so that module changed with "
                "it; fix: fold only through fedex-lora's calls, on a freshly loaded model"
            )
        setattr(layer, SHARED, tuple(n for n, _ in others))
        found[name] = [n for n, _ in others]
    return found
