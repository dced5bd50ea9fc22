"""The exactness figure beyond the LoRA layers: trained extras and frozen parameters.

:func:`fedexlora.bridge.steps.apply_outcome` measures each LoRA layer's effective weight
against the ideal. A round may also go wrong elsewhere in the model: a trained extra (a
task head, ``bias="all"``) written back off its average (a bf16 parameter rounds it), or a
frozen parameter changed by a fold (an input embedding tied to a targeted ``lm_head``).
:func:`extras_deviation` measures each trained extra against the weighted average of the
uploads, in fp64; :func:`frozen_changes` compares every frozen parameter, under every
name a module holds it by, with a digest of its bits taken the first time the model was
measured. Both go into the same per-name figure, so the run's exactness check covers the
whole model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.adapters import get_state
from fedexlora.bridge.layers import lora_layers
from fedexlora.core.messages import ClientUpload, RoundOutcome

__all__ = ["extras_deviation", "frozen_changes"]

_DIGEST = "_fedex_frozen_digest"  # on the model: name -> digest of a frozen parameter's bits
# adapters, fedex-lora's own modules (side branches), and peft's copies of trained
# extras for every adapter (a rank adapter's head is trained when its clients train)
_LORA_TAGS = (".lora_", ".fedex_", ".modules_to_save.")
_CHUNK = 1 << 22
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def extras_deviation(
    model: torch.nn.Module, server, outcome: RoundOutcome, uploads: Sequence[ClientUpload]
) -> dict[str, float]:
    """Per trained extra, ``||got - fp32(Σ p_i x_i)|| / ||Σ p_i x_i - previous||``.

    ``got`` is the model's extra as :func:`~fedexlora.bridge.adapters.get_state` reads it
    (a half-precision one: its fp32 master); the average is over the accepted uploads
    with the outcome's weights, in fp64, then rounded once to fp32, the precision an
    extra is held in (an fp32 parameter, or a bf16 one's fp32 master): an extra holds
    no residual beside it, so the nearest fp32 value is its ideal (0 when it holds it;
    a bf16 parameter without its master is off by bf16's rounding, 1e-3 and more). Nothing
    when the method keeps the extras on the clients, or an upload lacks them.

    Returns:
        Per extra, the deviation.
    """
    spec = getattr(server, "spec", None)
    if outcome.previous is None or not outcome.weights or not getattr(spec, "shares_head", 1):
        return {}
    by_id = {u.client_id: u for u in uploads}
    got = get_state(model).extra
    out = {}
    for name, before in outcome.previous.extra.items():
        parts = [(p, by_id[c].state.extra.get(name)) for c, p in outcome.weights.items()]
        if name not in got or any(x is None for _, x in parts):
            continue
        ideal = sum(p * x.double() for p, x in parts)
        den = float(torch.linalg.norm(ideal - before.double()))
        if den > 0:
            held = ideal.float().double()  # the nearest fp32 value
            out[name] = float(torch.linalg.norm(got[name].double() - held)) / den
    return out


def _digest(t: torch.Tensor) -> bytes | int:
    """A digest of ``t``'s bits: BLAKE2b of its bytes on the CPU, else :func:`_checksum`.

    Every round digests every frozen parameter (MiniLM: 21M of them): hashing the bytes
    in place is about 6x faster than the position-weighted sum on the CPU
    (``benchmarks/round_time.py``'s ``apply`` part), and a stronger check.
    """
    if t.device.type != "cpu" or t.is_quantized:
        return _checksum(t)
    data = memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return hashlib.blake2b(data, digest_size=16).digest()


def _checksum(t: torch.Tensor) -> int:
    """A checksum of ``t``'s bits: their integer values, weighted by position, summed."""
    flat = t.detach().reshape(-1)
    bits = flat.view(_INT[flat.element_size()]) if flat.element_size() in _INT else flat
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(1, chunk.numel() + 1, device=chunk.device, dtype=torch.int64)
        total += int((chunk * (pos % 65521 + 1)).sum()) + int(chunk.sum())
    return total


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every frozen parameter by every name, but the LoRA layers' own base weights.

    Those are measured as the layers' effective weights (an fp32 base takes residuals).
    """
    own = set()
    for name, layer in lora_layers(model).items():
        base = layer.get_base_layer()
        # the tensor it adapts: the weight, or a target_parameters wrapper's parameter
        attr = layer.parameter_name if layer_kinds.kind(layer) == "param" else "weight"
        for sub, module in layer.named_modules():
            if module is base:
                own.add(f"{name}.{sub}.{attr}" if sub else f"{name}.{attr}")
    return {
        n: p
        for n, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad and n not in own and not any(t in n for t in _LORA_TAGS)
    }


@torch.no_grad()
def frozen_changes(model: torch.nn.Module, *, first: bool = False) -> dict[str, float]:
    """Frozen parameters whose bits changed since the model was first measured.

    The first call takes each frozen parameter's digest (kept on the model); later calls
    compare; with ``first`` a call only takes the digest if none was taken yet.

    Returns:
        ``{name: inf}`` for each frozen parameter that changed (empty when none did).
    """
    held = getattr(model, _DIGEST, None)
    if first and held is not None:
        return {}
    frozen = _frozen(model)
    if held is None:
        setattr(model, _DIGEST, {n: _digest(p) for n, p in frozen.items()})
        return {}
    return {n: float("inf") for n, p in frozen.items() if n in held and _digest(p) != held[n]}
