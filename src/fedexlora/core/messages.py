"""What travels between the server and its clients, and what a round produces.

:class:`Payload` (server to client), :class:`ClientUpload` (client to server), both as
flat tensors or safetensors bytes; the checks an upload must pass; and
:class:`RoundOutcome`, the result of one round. The server's logic is in
:mod:`fedexlora.server`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fedexlora.core.aggregation import Residual, residuals_from_flat, residuals_to_flat
from fedexlora.core.state import AdapterState

__all__ = [
    "ClientUpload",
    "Payload",
    "RoundOutcome",
    "example_count",
    "validate_upload",
]


@dataclass
class Payload:
    """What the server sends one client for one round.

    The client folds ``scale * residual`` into each adapted base weight, then loads
    ``state``; its effective weights then equal the server's global model exactly.

    Attributes:
        round: The round this payload starts.
        version: The base-weight version the client holds after applying it.
        state: Global factors and extras (A is ``None`` where the client has it already).
        residuals: Module -> residual from the client's version to ``version``; with
            ``reset``, from the pretrained weights ``W0`` to ``version``.
        reset: The residuals start from ``W0``: the client first drops whatever it folded
            before (a new or re-synced client, or one away longer than the server keeps
            history for; :func:`fedexlora.bridge.steps.apply_payload` does this).
        keep: Whether the client should keep its model for its next payload. ``False``
            when the server expects the client to be away longer than its history will
            reach: its next payload will be a ``reset`` one anyway, so the client may
            drop its state after training (a Flower client does).
        scales: Module -> the LoRA scaling the server's residuals assume for this client
            (``alpha / r``, or rsLoRA's), which :func:`fedexlora.bridge.steps.apply_payload`
            checks against the client's model. In-process only: not in :meth:`to_flat` or
            :meth:`to_bytes` (a Flower client checks the run's fingerprint instead).
    """

    round: int
    version: int
    state: AdapterState
    residuals: dict[str, Residual] = field(default_factory=dict)
    reset: bool = False
    keep: bool = True
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor sent."""
        return self.state.nbytes + sum(r.nbytes for r in self.residuals.values())

    def to_flat(self) -> dict[str, torch.Tensor]:
        """One flat ``name -> tensor`` map for transport (Flower records, safetensors)."""
        flat = {f"state.{k}": v for k, v in self.state.to_flat().items()}
        flat.update(residuals_to_flat("residual", self.residuals))
        return flat

    @classmethod
    def from_flat(
        cls,
        flat: Mapping[str, torch.Tensor],
        *,
        round: int,
        version: int,
        reset: bool = False,
        keep: bool = True,
    ) -> Payload:
        """Inverse of :meth:`to_flat`; residual shapes are read from the tensors."""
        state = AdapterState.from_flat(
            {k[6:]: v for k, v in flat.items() if k.startswith("state.")}
        )
        residuals = residuals_from_flat("residual", dict(flat))
        return cls(round, version, state, residuals, reset=reset, keep=keep)

    def to_bytes(self) -> bytes:
        """Safetensors bytes of :meth:`to_flat`, with round, version, reset and keep."""
        meta = {"round": self.round, "version": self.version}
        meta.update(reset=int(self.reset), keep=int(self.keep))
        return _to_bytes(self.to_flat(), meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> Payload:
        """Inverse of :meth:`to_bytes`."""
        flat, meta = _from_bytes(data, ("round", "version"))
        return cls.from_flat(
            flat,
            round=meta["round"],
            version=meta["version"],
            reset=bool(meta.get("reset", 0)),
            keep=bool(meta.get("keep", 1)),
        )


@dataclass
class ClientUpload:
    """What a client sends back after local training."""

    client_id: int
    state: AdapterState
    num_examples: int
    train_loss: float = float("nan")

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor uploaded."""
        return self.state.nbytes

    def to_flat(self) -> dict[str, torch.Tensor]:
        """The factors and extras as one flat map (:meth:`AdapterState.to_flat`)."""
        return self.state.to_flat()

    @classmethod
    def from_flat(
        cls,
        flat: Mapping[str, torch.Tensor],
        *,
        client_id: int,
        num_examples,
        train_loss: float = float("nan"),
    ) -> ClientUpload:
        """Inverse of :meth:`to_flat`."""
        return cls(client_id, AdapterState.from_flat(dict(flat)), num_examples, train_loss)

    def to_bytes(self) -> bytes:
        """Safetensors bytes of the upload, with its client id, count and loss."""
        meta = {"client_id": self.client_id, "num_examples": self.num_examples}
        meta["train_loss"] = self.train_loss
        return _to_bytes(self.to_flat(), meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> ClientUpload:
        """Inverse of :meth:`to_bytes`."""
        flat, meta = _from_bytes(data, ("client_id", "num_examples", "train_loss"))
        return cls.from_flat(
            flat,
            client_id=int(meta["client_id"]),
            num_examples=meta["num_examples"],
            train_loss=float(meta["train_loss"]),
        )


_META = "__meta__."


def _nbytes(residuals: Mapping[str, Residual]) -> int:
    return sum(r.nbytes for r in residuals.values())


def _to_bytes(flat: Mapping[str, torch.Tensor], meta: dict) -> bytes:
    """Safetensors bytes; scalars travel as 0-d fp64 tensors under ``__meta__.<key>``."""
    from safetensors.torch import save

    out = {k: v.detach().contiguous().cpu() for k, v in flat.items()}
    out.update({_META + k: torch.tensor(float(v), dtype=torch.float64) for k, v in meta.items()})
    return save(out)


def _from_bytes(data: bytes, keys: tuple[str, ...]) -> tuple[dict, dict]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        flat = load(data)
    except (SafetensorError, ValueError) as exc:
        raise ValueError(f"not a fedex-lora message (safetensors bytes): {exc}") from None
    meta = {k[len(_META) :]: v.item() for k, v in flat.items() if k.startswith(_META)}
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ValueError(f"message lacks {missing}")
    ints = {k: int(v) if float(v).is_integer() else v for k, v in meta.items()}
    return {k: v for k, v in flat.items() if not k.startswith(_META)}, ints


@dataclass
class RoundOutcome:
    """The result of one round on the server.

    Attributes:
        residuals: Module -> residual to fold into the global base weights (times scale).
        accepted: Client ids whose uploads were aggregated.
        rejected: Client id -> reason, for uploads refused by validation.
        deviation: Module -> relative deviation of the averaged-factor product.
        effective_deviation: Module -> relative deviation of the applied update.
        feedback_norm: Frobenius norm of the residual kept back (lossy mode), per module.
        weights: Client id -> normalised weight, for the accepted uploads.
        previous: The global adapter state before this round.
        unchanged: True when no upload was accepted: the global model did not change.
        secure: Under secure aggregation, what the server read from the sums besides the
            model: ``clipped`` (numbers the quantization clipped, over every client) and
            ``train_loss`` (the weighted mean); ``None`` without secure aggregation.
        rounding: Module -> fp32's unit rounding of the layer's weights relative to the
            round's update, ``2^-24 ||W'|| / ||W_ideal - W_previous||``: about what one
            fold into fp32 weights may be off by (set where the model is measured,
            :func:`fedexlora.bridge.steps.apply_outcome`).
    """

    residuals: dict[str, Residual]
    accepted: list[int]
    rejected: dict[int, str]
    deviation: dict[str, float]
    effective_deviation: dict[str, float]
    feedback_norm: dict[str, float] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    previous: AdapterState | None = None
    unchanged: bool = False
    secure: dict | None = None
    rounding: dict[str, float] = field(default_factory=dict)


def example_count(value) -> tuple[int | None, str]:
    """``(n, "")`` for a positive integer-valued count, else ``(None, reason)``.

    Python ints, numpy and torch integers, and integral floats (``100.0``) are accepted;
    a bool, zero, a negative number, a fraction, NaN or infinity is not.
    """
    bad = f"num_examples must be a positive integer, got {value!r}"
    if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool:
        return None, f"{bad} (a bool)"
    if isinstance(value, (str, bytes)):
        return None, f"{bad} (text)"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None, bad
        value = value.item()
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError):  # 10**400 overflows a float
        return None, f"{bad} (not a number a float holds)"
    if not math.isfinite(as_float):
        return None, f"{bad} (not finite)"
    if as_float != int(as_float):
        return None, f"{bad} (a fraction)"
    if as_float <= 0:
        return None, bad
    return int(as_float), ""


_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_PRODUCT_LIMIT = float(torch.finfo(torch.float32).max) / 1e6


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().double()))


def validate_upload(
    upload: ClientUpload,
    template: AdapterState,
    *,
    max_update_norm: float | None = None,
    reference: AdapterState | None = None,
    scales: dict[str, float] | None = None,
) -> str | None:
    """Returns why an upload must be rejected, or ``None`` when it is acceptable.

    Checks the example count, the key set against ``template``, shapes, dtypes, finiteness,
    that each layer's product ``scale B A`` is far from fp32's overflow (finite factors of
    1e20 gave an infinite residual, which reached the global model), and, when
    ``max_update_norm`` is set, the norm of the change from ``reference``.
    """
    count, why = example_count(upload.num_examples)
    if count is None:
        return why
    got, want = upload.state.to_flat(), template.to_flat()
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        return f"missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}"
    if extra:
        return f"unexpected keys {extra[:3]}{'...' if len(extra) > 3 else ''}"
    sq = 0.0
    ref = reference.to_flat() if reference is not None else {}
    for key, t in got.items():
        w = want[key]
        if not isinstance(t, torch.Tensor):
            return f"{key}: not a tensor"
        if tuple(t.shape) != tuple(w.shape):
            return f"{key}: shape {tuple(t.shape)}, expected {tuple(w.shape)}"
        if t.dtype not in _FLOATS:
            return f"{key}: dtype {t.dtype}, expected one of fp64, fp32, bf16, fp16"
        if not torch.isfinite(t).all():
            return f"{key}: contains NaN or Inf"
        if max_update_norm is not None and key in ref:
            sq += float((t.double() - ref[key].double()).pow(2).sum())
    held = reference.factors if reference is not None else template.factors
    for name, (A, B) in upload.state.factors.items():
        # ||s B A|| <= |s| ||B|| ||A||, in fp64: the residual sums and differences k such
        # products, kept in fp32; a bound 1e6 below its largest value leaves room for both
        # (a factor the method does not upload is the global one)
        A = A if A is not None else held.get(name, (None, None))[0]
        B = B if B is not None else held.get(name, (None, None))[1]
        if A is None or B is None:
            continue
        bound = abs((scales or {}).get(name, 1.0)) * _norm(B) * _norm(A)
        if not bound < _PRODUCT_LIMIT:
            return f"lora.{name}: its update B A is too large to aggregate (norm bound {bound:.3g})"
    if max_update_norm is not None and math.sqrt(sq) > max_update_norm:
        return f"update norm {math.sqrt(sq):.4g} exceeds max_update_norm {max_update_norm:g}"
    return None
