"""fp32 masters of the trained extras held in half precision (a task head, ``bias="all"``).

A model loaded in bf16/fp16 and wrapped by peft trains its extras (the classification
head, other ``modules_to_save``, the biases of ``bias="all"``) in that dtype. Their
federated average is not a bf16 number: written back into the bf16 parameter it would be
rounded (1e-3 to 5e-2 of the round's update), and the next round would start from the
rounded value. So the bridge keeps an fp32 copy beside each such parameter, its
*master*, set to the exact average (:func:`write_extra`), while the parameter holds it
rounded to its dtype for the forward pass (as mixed-precision training keeps fp32 master
weights and computes in bf16). What a client trained is read back on top of the master
(:func:`read_extra`): ``master + (param - round(master))``, exact in fp32, so a round
that did not move a parameter gives back its master bit for bit, and the federated
extras stay the exact weighted averages of what the clients trained, round after round.
The user's model, optimizer and forward pass are unchanged (the parameter keeps its
dtype). fp32/fp64 extras are read and written directly.
"""

from __future__ import annotations

import torch

__all__ = ["master", "read_extra", "write_extra"]

_MASTER = "_fedex_master"  # attribute of a half-precision parameter: its fp32 master
_HALF = (torch.bfloat16, torch.float16)


def master(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master of a half-precision parameter, or ``None`` (none written yet)."""
    m = getattr(param, _MASTER, None)
    return m if m is not None and param.dtype in _HALF else None


@torch.no_grad()
def read_extra(param: torch.Tensor) -> torch.Tensor:
    """A trained extra's value as a CPU fp32 (fp64: fp64) copy, its master included.

    For a half-precision parameter with a master: ``master + (param - round(master))``,
    what training changed since the master was written added to it in fp32 (the
    difference of two bf16/fp16 numbers is exact in fp32).
    """
    m = master(param)
    value = param.detach()
    if m is not None:
        value = m + (value.float() - m.to(param.dtype).float())
    value = value.to("cpu", copy=True)
    return value.float() if value.dtype in _HALF else value


@torch.no_grad()
def write_extra(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets a trained extra to ``value``; a half-precision one keeps ``value`` as its master.

    The parameter holds ``value`` rounded to its dtype; its master holds ``value`` in fp32
    on the parameter's device.
    """
    if param.dtype not in _HALF:
        param.copy_(value.to(param.dtype))
        return
    m = value.detach().to(device=param.device, dtype=torch.float32, copy=True)
    param.copy_(m.to(param.dtype))
    setattr(param, _MASTER, m)
