"""Fed-SB (Singh et al., 2025, arXiv 2502.15436): LoRA with a trainable ``r x r`` core.

A Fed-SB layer's update is ``s * B R A``: ``B`` ``(d, r)`` and ``A`` ``(r, n)`` are frozen
and shared by every client, and only ``R`` ``(r, r)`` is trained. The update is linear in
``R``, so averaging the clients' ``R`` is the exact average of their updates, and a client
sends ``r^2`` numbers per layer.

Here a Fed-SB layer is a peft LoRA layer whose ``lora_B`` is a :class:`LatentB` (the frozen
basis ``B`` after the trainable core ``R``), and whose ``lora_A`` holds the frozen ``A``.
The bridge (:mod:`fedexlora.bridge.adapters`) shows the server such a layer in its latent
coordinates: factors ``(I_r, R)`` of a layer of shape ``(r, r)``. On those, Fed-SB's
aggregation is FFA-LoRA's (a frozen shared A, the B averaged), so the server, the
payloads, the checks and the checkpoints need nothing of their own.

Two initialisations of ``A`` and ``B``:

- ``gradient`` (the authors' LoRA-SB): from the truncated SVD of ``-lr * sign(G)``, ``G``
  the full-weight gradient summed over the first examples of a seeded shuffle of the
  training split; ``R`` starts at the singular values, so the first "step" is the
  rank-``r`` part of a sign-gradient step. In a simulation this is the sum of the clients'
  gradients (one dense upload per client, once); it reads the data without any noise, so
  it is refused with DP.
- ``random``: data-free orthonormal bases seeded by the run's seed, ``R = 0``.
"""

from __future__ import annotations

import torch

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.layers import lora_layers

__all__ = ["LatentB", "install", "is_latent"]


class LatentB(torch.nn.Module):
    """``lora_B`` of a Fed-SB layer: ``z -> B (R z)`` with ``B`` frozen and ``R`` trained.

    ``weight`` is the product ``B @ R`` ``(d, r)``, so everything that reads
    ``lora_B.weight`` (peft's merge, the effective weight, exports) sees the layer's
    ordinary LoRA factor.
    """

    def __init__(self, basis: torch.Tensor, core: torch.Tensor):
        super().__init__()
        d, r = basis.shape
        if tuple(core.shape) != (r, r):
            raise ValueError(f"core must be ({r}, {r}), got {tuple(core.shape)}")
        self.core = torch.nn.Linear(r, r, bias=False)
        self.basis = torch.nn.Linear(r, d, bias=False)
        with torch.no_grad():
            self.core.weight.copy_(core)
            self.basis.weight.copy_(basis)
        self.basis.weight.requires_grad_(False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``B (R z)``."""
        return self.basis(self.core(z))

    @property
    def weight(self) -> torch.Tensor:
        """The ordinary LoRA factor ``B @ R`` ``(d, r)``."""
        return self.basis.weight @ self.core.weight

    @property
    def in_features(self) -> int:
        """``r``, as ``nn.Linear`` has it."""
        return self.core.in_features

    @property
    def out_features(self) -> int:
        """``d``, as ``nn.Linear`` has it."""
        return self.basis.out_features


def is_latent(layer, adapter: str = "default") -> bool:
    """Whether ``layer`` is a Fed-SB layer (its ``lora_B`` is a :class:`LatentB`)."""
    return adapter in layer.lora_B and isinstance(layer.lora_B[adapter], LatentB)


@torch.no_grad()
def install(
    model,
    *,
    init: str,
    seed: int,
    grads: dict[str, torch.Tensor] | None = None,
    lr: float = 1e-3,
    total_steps: int = 1,
    adapter: str = "default",
) -> None:
    """Turns every LoRA layer of ``model`` into a Fed-SB layer (frozen A and B, core R).

    Args:
        model: A peft model whose adapter has the Fed-SB rank.
        init: ``gradient`` (needs ``grads``) or ``random``.
        seed: Seeds the random bases.
        grads: For ``gradient``: each adapted layer's base-weight gradient in ``(d, n)``
            orientation, summed over the init's examples
            (:func:`fedexlora.training.local.estimate_gradients`).
        lr: The learning rate of the gradient init's sign step (the authors scale it by
            the total number of steps).
        total_steps: Local steps of the whole run (rounds x steps per round).
        adapter: The peft adapter to turn into Fed-SB.

    Raises:
        ValueError: On an unknown ``init``, or ``gradient`` without gradients.
    """
    layers = lora_layers(model, adapter)
    if init not in ("gradient", "random"):
        raise ValueError(f"--fedsb-init must be gradient or random, got {init!r}")
    if init == "gradient" and not grads:
        raise ValueError("Fed-SB's gradient initialisation needs training examples")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    for name, layer in layers.items():
        if layer_kinds.kind(layer) != "linear":
            raise ValueError(
                f"module {name!r} is a LoRA {layer_kinds.kind(layer)} layer; Fed-SB adapts "
                "linear layers only: leave it out of --target-modules, or use another method"
            )
        A_mod = layer.lora_A[adapter]
        r, n = A_mod.weight.shape
        d = layer.lora_B[adapter].weight.shape[0]
        if r > min(d, n):
            raise ValueError(
                f"module {name!r}: Fed-SB rank {r} exceeds the layer's smaller side "
                f"min({d}, {n}); use --fedsb-rank {min(d, n)} or less"
            )
        scale = float(layer.scaling[adapter])
        if init == "gradient":
            step = -(lr / max(total_steps, 1)) * torch.sign(grads[name].double())
            U, S, Vh = torch.linalg.svd(step, full_matrices=False)
            basis, A, core = U[:, :r], Vh[:r], torch.diag(S[:r]) / scale
        else:
            basis = torch.linalg.qr(torch.randn(d, r, generator=gen, dtype=torch.float64))[0]
            A = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))[0].T
            core = torch.zeros(r, r, dtype=torch.float64)
        dtype, device = A_mod.weight.dtype, A_mod.weight.device
        A_mod.weight.copy_(A.to(dtype))
        A_mod.weight.requires_grad_(False)
        layer.lora_B[adapter] = LatentB(basis.to(dtype), core.to(dtype)).to(device)
