"""Each kind of peft LoRA layer seen as the server's matrices: ``A (r, n)``, ``B (d, r)``.

The server aggregates every layer as a ``(d, n)`` update ``B @ A``. peft's layers store
their factors and their base weights in several shapes; this module maps each to that
view and back, taking the orientation and reshape from the peft layer itself (peft's own
``get_delta_weight`` is the reference):

- ``nn.Linear`` (and bitsandbytes): ``lora_A.weight (r, n)``, ``lora_B.weight (d, r)``;
  the weight is ``(d, n)``, or ``(n, d)`` for GPT-2's ``Conv1D`` (``fan_in_fan_out``).
- ``nn.Embedding``: ``lora_embedding_A (r, num_embeddings)``, ``lora_embedding_B
  (embedding_dim, r)``; the weight is ``(num_embeddings, embedding_dim)`` = ``(B A)^T``.
- ``nn.Conv1d/2d/3d`` (ungrouped): ``lora_A`` a convolution ``(r, in, *k)``, ``lora_B`` a
  pointwise one ``(out, r, 1...)``; the update is ``B (out, r) @ A (r, in * prod(k))``,
  reshaped to the weight's ``(out, in, *k)``.
- ``target_parameters`` on a stacked expert parameter ``(E, out, in)`` (or ``(E, in,
  out)``): peft keeps every expert's ``A_e`` in the rows of one ``lora_A (E r, in)`` and
  its ``B_e`` in every E-th column of ``lora_B (out, r E)``. The server sees one layer of
  ``d = E out``: ``A`` as stored, ``B`` the block-diagonal ``(E out, E r)`` of the
  ``B_e``, so that ``B A`` stacks the experts' updates ``B_e A_e``. An average of
  block-diagonal matrices is block-diagonal, so FedEx's residual keeps the structure.

Everything here is linear in ``B A``, so FedEx's residual folds exactly in every kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

__all__ = [
    "adapter_tensors",
    "base_matrix",
    "base_param",
    "dims",
    "factor_params",
    "fold_into_weight",
    "is_experts",
    "kind",
    "read_A",
    "read_B",
    "side_output",
    "to_stored",
    "weight_delta",
    "write_A",
    "write_B",
]


def kind(layer: LoraLayer) -> str:
    """``"linear"``, ``"embedding"``, ``"conv"`` or ``"param"`` (``target_parameters``)."""
    from peft.tuners.lora.layer import Embedding, ParamWrapper, _ConvNd

    if isinstance(layer, Embedding):
        return "embedding"
    if isinstance(layer, _ConvNd):
        return "conv"
    if isinstance(layer, ParamWrapper):
        return "param"
    return "linear"


def _adapter(layer: LoraLayer, adapter: str | None) -> str:
    if adapter is not None:
        return adapter
    names = list(layer.lora_embedding_A) if kind(layer) == "embedding" else list(layer.lora_A)
    return names[0]


def factor_params(layer: LoraLayer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's ``A`` and ``B`` parameters as peft stores them."""
    if kind(layer) == "embedding":
        return layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]
    return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight


def _experts(layer: LoraLayer) -> int:
    return int(getattr(layer, "num_experts", 1)) if kind(layer) == "param" else 1


def is_experts(layer: LoraLayer) -> bool:
    """Whether the layer adapts a stacked expert parameter (block-diagonal ``B``)."""
    return _experts(layer) > 1


def read_A(layer: LoraLayer, adapter: str | None = None) -> torch.Tensor:
    """``A`` as the server sees it, ``(r, n)`` (a view of the parameter where possible)."""
    A, _ = factor_params(layer, _adapter(layer, adapter))
    return A.reshape(A.shape[0], -1)


def read_B(layer: LoraLayer, adapter: str | None = None) -> torch.Tensor:
    """``B`` as the server sees it, ``(d, r)``: block-diagonal for stacked experts."""
    _, B = factor_params(layer, _adapter(layer, adapter))
    E = _experts(layer)
    B = B.reshape(B.shape[0], -1)
    if E == 1:
        return B
    out, rE = B.shape
    r = rE // E
    full = B.new_zeros(E * out, rE)
    for e in range(E):  # peft: B.reshape(out, r, E)[:, :, e] is expert e's B
        full[e * out : (e + 1) * out, e * r : (e + 1) * r] = B.reshape(out, r, E)[:, :, e]
    return full


def write_A(layer: LoraLayer, adapter: str, A: torch.Tensor) -> None:
    """Loads the server's ``A`` ``(r, n)`` into the parameter (its dtype)."""
    p, _ = factor_params(layer, adapter)
    p.data.copy_(A.reshape(p.shape).to(p.dtype))


def write_B(layer: LoraLayer, adapter: str, B: torch.Tensor, name: str = "") -> None:
    """Loads the server's ``B`` ``(d, r)`` into the parameter (its dtype).

    Raises:
        ValueError: If the layer adapts stacked experts and ``B`` is not block-diagonal
            (a method whose aggregate mixes the experts' factors).
    """
    _, p = factor_params(layer, adapter)
    E = _experts(layer)
    if E == 1:
        p.data.copy_(B.reshape(p.shape).to(p.dtype))
        return
    out, rE = p.shape
    r = rE // E
    blocks = torch.zeros_like(B)
    for e in range(E):
        blocks[e * out : (e + 1) * out, e * r : (e + 1) * r] = 1
    if bool((B * (1 - blocks)).ne(0).any()):
        raise ValueError(
            f"module {name!r}: its experts' B is not block-diagonal; this aggregation "
            "method mixes experts (target_parameters): use method='fedex' or 'fedit'"
        )
    cols = torch.stack([B[e * out : (e + 1) * out, e * r : (e + 1) * r] for e in range(E)], -1)
    p.data.copy_(cols.reshape(out, rE).to(p.dtype))


def dims(layer: LoraLayer, adapter: str | None = None) -> tuple[int, int]:
    """``(d, n)``: the shape of the layer's update as the server sees it."""
    A, B = factor_params(layer, _adapter(layer, adapter))
    return int(B.shape[0]) * _experts(layer), int(A.reshape(A.shape[0], -1).shape[1])


def base_param(layer: LoraLayer) -> torch.Tensor:
    """The frozen base tensor the layer adapts (its weight, or the targeted parameter)."""
    if kind(layer) == "param":
        return layer.get_param()
    return layer.get_base_layer().weight


def _transposed(layer: LoraLayer) -> bool:
    """Whether the stored weight (or each expert's) is ``(n, d)`` rather than ``(d, n)``."""
    k = kind(layer)
    if k == "embedding":
        return True
    if k == "param":  # a 2-D parameter is (out, in), as nn.Linear's
        swapped = getattr(layer, "_did_swap_in_out_features", False)
        return base_param(layer).dim() == 3 and not swapped
    return bool(getattr(layer, "fan_in_fan_out", False))


def to_stored(layer: LoraLayer, M: torch.Tensor) -> torch.Tensor:
    """A ``(d, n)`` matrix in the stored weight's shape and orientation."""
    w = base_param(layer)
    E = _experts(layer)
    if E > 1 or kind(layer) == "param":
        M = M.reshape(E, -1, M.shape[-1])
        return (M.transpose(1, 2) if _transposed(layer) else M).reshape(w.shape)
    M = M.T if _transposed(layer) else M
    return M.reshape(w.shape)


def _from_stored(layer: LoraLayer, w: torch.Tensor) -> torch.Tensor:
    """The stored weight (or a change of it) as a ``(d, n)`` matrix."""
    if kind(layer) == "param":
        W = w.reshape(_experts(layer), w.shape[-2], w.shape[-1])
        W = W.transpose(1, 2) if _transposed(layer) else W
        return W.reshape(-1, W.shape[-1])
    W = w.reshape(w.shape[0], -1)
    return W.T if _transposed(layer) else W


def base_matrix(layer: LoraLayer) -> torch.Tensor:
    """The (unquantized) base weight as the server's ``(d, n)`` matrix, fp64."""
    return _from_stored(layer, base_param(layer).detach().double())


def weight_delta(layer: LoraLayer, w: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """``w - w0`` (two states of the stored weight) as a ``(d, n)`` matrix, their dtype."""
    return _from_stored(layer, torch.sub(w, w0)).contiguous()


@torch.no_grad()
def fold_into_weight(layer: LoraLayer, R) -> None:
    """``W += R`` in place, ``R`` a scaled :class:`~fedexlora.core.factors.Residual`.

    One ``addmm_`` into a matrix view of the weight where its layout allows (a Linear,
    a Conv1D, a convolution, an embedding), else the dense update added once.
    """
    w = base_param(layer).data
    k = kind(layer)
    if R.dense is None and k != "param":
        view = w.view(w.shape[0], -1)
        if _transposed(layer):  # (n, d): (U V)^T = V^T U^T
            view.addmm_(R.V.T, R.U.T)
        else:
            view.addmm_(R.U, R.V)
        return
    dense = R.dense if R.dense is not None else R.U @ R.V
    w.add_(to_stored(layer, dense.to(w.dtype)))


def side_output(layer: LoraLayer, side, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` plus the side branch's correction, for the layer's kind.

    A Linear (or Conv1D) layer: the side branch's own ``x @ delta^T``. An embedding:
    the rows of ``delta^T`` its indices pick (times the embedding's own scale, as peft
    scales its LoRA branch). A convolution: the same convolution with ``delta`` as its
    weight. Computed in the side branch's dtype, rounded once to ``out``'s.
    """
    k = kind(layer)
    if k == "linear":
        return side(x, out)
    if side.rank == 0:
        return out
    delta = side.to_dense().to(side.dtype)
    with torch.autocast(device_type=out.device.type, enabled=False):
        if k == "embedding":
            base = layer.get_base_layer()
            extra = F.embedding(x, delta.T, padding_idx=base.padding_idx)
            scale = layer._get_embed_scale() if hasattr(layer, "_get_embed_scale") else None
            if scale is not None:
                extra = extra * scale.to(extra.dtype)
        elif k == "conv":
            base = layer.get_base_layer()
            weight = to_stored(layer, delta)
            extra = base._conv_forward(x.to(delta.dtype), weight, None)
        else:
            raise ValueError(f"no side branch for a {type(layer).__name__} layer")
        return (out.to(delta.dtype) + extra).to(out.dtype)


def adapter_tensors(
    layer: LoraLayer, name: str, A: torch.Tensor, B: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A saved peft adapter's keys and tensors for the server's ``A (q, n)``, ``B (d, q)``.

    Raises:
        ValueError: For stacked experts (peft's layout cannot hold a rank that differs
            per expert): export the merged model instead.
    """
    k = kind(layer)
    if k == "embedding":
        return {f"{name}.lora_embedding_A": A, f"{name}.lora_embedding_B": B}
    if is_experts(layer):
        raise ValueError(
            f"module {name!r} (target_parameters, stacked experts) cannot be written as a "
            "plain adapter; export the merged model instead"
        )
    Ap, Bp = factor_params(layer, _adapter(layer, None))
    return {
        f"{name}.lora_A.weight": A.reshape(A.shape[0], *Ap.shape[1:]),
        f"{name}.lora_B.weight": B.reshape(B.shape[0], B.shape[1], *Bp.shape[2:]),
    }
