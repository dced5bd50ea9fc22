"""What a client uploads under secure aggregation, and what the server reads from the sums.

Under secure aggregation (:mod:`fedexlora.secagg`) the server sees only the sum of the
clients' vectors, never one client's. Each client therefore sends one flat vector whose
sum over the clients holds everything the server needs:

- ``w_i``, its weight (its example count over a public bound), and ``w_i * loss_i``;
- ``w_i`` times every tensor it uploads (the method's factors and the task head);
- for FedEx-LoRA (a method whose spec has ``secure_products``), per adapted layer,
  either the two sketches of ``w_i B_i A_i`` against the round's public test matrices
  (:mod:`fedexlora.core.sketch`, where they are smaller than the product) or the dense
  ``w_i B_i A_i``: the server then forms the residual ``sum_i p_i B_i A_i - B̄ Ā`` from
  sums alone, and keeps it factored at rank ``(k - 1) r``.

:class:`SecureLayout` is that vector's layout, computed alike by the clients and the
server from the round's upload template; :func:`client_vector` builds one client's
vector and :func:`read_sums` turns the sum back into means. Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedexlora.core.sketch import Sketch, SketchPlan, SketchShape, client_sketches
from fedexlora.core.state import AdapterState

__all__ = [
    "MIN_SURVIVORS",
    "SecureLayout",
    "SecureSums",
    "client_vector",
    "read_sums",
    "secure_refusal",
]

MIN_SURVIVORS = 3
"""The fewest clients a secure round sums: of two, each learns the other's upload (the
sum less its own). The configuration asks a run to sample this many a round, and the
SecAgg+ server refuses a round that would end with fewer."""

_WEIGHT, _LOSS = "__weight__", "__loss__"


def secure_refusal(spec) -> str | None:
    """Why ``spec``'s method cannot run under secure aggregation, or ``None`` if it can."""
    if not spec.federated:
        return f"{spec.name!r} ({spec.title}) has no clients: there is nothing to aggregate"
    from fedexlora.core.methods import REGISTRY

    able = [n for n, s in REGISTRY.items() if _able(s)]
    if spec.personalized:  # MethodSpec.keeps
        return (
            f"{spec.name!r} ({spec.title}) cannot run under secure aggregation: its clients "
            "keep parts of their own, so each is evaluated on its own model, and each "
            "client's metrics and test-split size would reach the server in the clear. "
            f"Methods that can: {', '.join(able)}"
        )
    if _able(spec):
        return None
    return (
        f"{spec.name!r} ({spec.title}) cannot run under secure aggregation: its server "
        "math needs each client's own factors (it is not a weighted sum of the uploads), "
        f"and secure aggregation shows the server only sums. Methods that can: {', '.join(able)}"
    )


def _able(spec) -> bool:
    """Whether the sums suffice for ``spec``'s method.

    Its math is linear, or FedEx's products are summed, and no client keeps parts (and
    metrics) of its own.
    """
    return spec.federated and not spec.personalized and (spec.linear or spec.secure_products)


@dataclass(frozen=True)
class SecureLayout:
    """The order and shapes of the entries of a client's secure vector.

    Attributes:
        entries: ``(key, shape)`` in vector order: the weight, the weighted loss, every
            uploaded tensor (:meth:`AdapterState.to_flat` keys) and, with products, per
            layer either ``sketch_y.<module>`` ``(m, s)`` and ``sketch_w.<module>``
            ``(s2, c)`` (:class:`~fedexlora.core.sketch.SketchShape`), or
            ``product.<module>`` of shape ``(d, n)`` where the sketch is not smaller.
        plan: The round's sketch parameters, or ``None`` (every product dense).
        sketches: ``(module, shape)`` of the sketched layers.
    """

    entries: tuple[tuple[str, tuple[int, ...]], ...]
    plan: SketchPlan | None = None
    sketches: tuple[tuple[str, SketchShape], ...] = ()

    @classmethod
    def for_template(
        cls, template: AdapterState, *, products: bool, sketch: SketchPlan | None = None
    ) -> SecureLayout:
        """The layout for uploads shaped like ``template`` (the round's upload template).

        Args:
            template: The round's upload template.
            products: Whether FedEx's products travel (a ``secure_products`` method).
            sketch: The round's sketch plan: each layer whose sketch is smaller than its
                product sends the sketch. ``None``: every product dense.
        """
        entries: list[tuple[str, tuple[int, ...]]] = [(_WEIGHT, ()), (_LOSS, ())]
        flat = template.to_flat()
        entries += [(k, tuple(flat[k].shape)) for k in sorted(flat)]
        sketches: list[tuple[str, SketchShape]] = []
        if products:
            for name in sorted(template.factors):
                A, B = template.factors[name]
                if A is None or B is None:
                    raise ValueError(f"{name!r}: a product upload needs both A and B")
                d, n, r = B.shape[0], A.shape[1], A.shape[0]
                shape = sketch.shape(d, n, r) if sketch is not None else None
                if shape is None:
                    entries.append((f"product.{name}", (d, n)))
                else:
                    entries.append((f"sketch_y.{name}", (shape.m, shape.s)))
                    entries.append((f"sketch_w.{name}", (shape.s2, shape.c)))
                    sketches.append((name, shape))
        return cls(tuple(entries), sketch if sketches else None, tuple(sketches))

    @property
    def size(self) -> int:
        """Numbers in the vector."""
        return sum(_numel(s) for _, s in self.entries)

    @property
    def products(self) -> bool:
        """Whether the vector carries the layers' products (dense or sketched)."""
        return any(k.startswith(("product.", "sketch_")) for k, _ in self.entries)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def client_vector(
    layout: SecureLayout, upload: AdapterState, weight: float, loss: float = 0.0
) -> torch.Tensor:
    """One client's fp64 vector: ``weight`` times each entry of ``layout``.

    Raises:
        ValueError: If the upload lacks an entry of the layout or has another shape.
    """
    flat = upload.to_flat()
    shapes = dict(layout.sketches)
    sketched: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    parts = []
    for key, shape in layout.entries:
        if key == _WEIGHT:
            t = torch.tensor([1.0], dtype=torch.float64)
        elif key == _LOSS:
            t = torch.tensor([float(loss) if loss == loss else 0.0], dtype=torch.float64)
        elif key.startswith("product."):
            A, B = upload.factors[key[len("product.") :]]
            t = B.detach().double() @ A.detach().double()
        elif key.startswith(("sketch_y.", "sketch_w.")):
            name = key[len("sketch_y.") :]
            if name not in sketched:
                A, B = upload.factors[name]
                assert layout.plan is not None  # a layout with sketches has its plan
                sketched[name] = client_sketches(A, B, shapes[name], layout.plan.seed, name)
            t = sketched[name][0 if key.startswith("sketch_y.") else 1]
        else:
            if key not in flat:
                raise ValueError(f"the upload lacks {key!r}")
            t = flat[key].detach().double()
        if tuple(t.shape) != shape and not (shape == () and t.numel() == 1):
            raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {shape}")
        parts.append(t.reshape(-1).cpu())
    return torch.cat(parts) * float(weight)


@dataclass
class SecureSums:
    """The means the server reads from the clients' summed vectors.

    Attributes:
        weight: ``sum_i w_i`` over the clients whose vectors were summed.
        loss: The weighted mean training loss.
        state: The weighted mean of every uploaded tensor, as an adapter state.
        products: Module -> ``sum_i p_i B_i A_i`` (fp64, ``(d, n)``), for the layers
            whose products travel dense.
        sketches: Module -> its mean sketches, for the sketched layers.
        means: Module -> ``(Ā, B̄)`` in fp64 (``state`` holds them in the template's
            dtype): FedEx's residual is formed against them.
        clipped: Numbers clipped by the quantization, over every client.
        examples: The clients' example counts, summed (``weight`` over its unit);
            ``None`` when the clients weigh the same and send no count.
    """

    weight: float
    loss: float
    state: AdapterState
    products: dict[str, torch.Tensor]
    clipped: int = 0
    examples: int | None = 0
    sketches: dict[str, Sketch] = field(default_factory=dict)
    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_sums(
    layout: SecureLayout,
    summed: torch.Tensor,
    template: AdapterState,
    *,
    clipped: int = 0,
) -> SecureSums:
    """The means in ``summed`` (the sum of the clients' :func:`client_vector`).

    Each tensor is cast to the template's dtype; products stay fp64.

    Raises:
        ValueError: If ``summed`` does not have the layout's size or its weight is not
            positive.
    """
    if summed.numel() != layout.size:
        raise ValueError(f"the summed vector has {summed.numel()} numbers, expected {layout.size}")
    summed = summed.double()
    out: dict[str, torch.Tensor] = {}
    at = 0
    for key, shape in layout.entries:
        n = _numel(shape)
        out[key] = summed[at : at + n].reshape(shape)
        at += n
    weight = float(out.pop(_WEIGHT))
    if not weight > 0:
        raise ValueError(f"the summed weight is {weight}: no client's vector is in the sum")
    loss = float(out.pop(_LOSS)) / weight
    ref = template.to_flat()
    special = ("product.", "sketch_y.", "sketch_w.")
    flat = {k: (v / weight).to(ref[k].dtype) for k, v in out.items() if not k.startswith(special)}
    products = {
        k[len("product.") :]: v / weight for k, v in out.items() if k.startswith("product.")
    }
    sketches = {}
    for name, shape in layout.sketches:
        assert layout.plan is not None  # a layout with sketches has its plan
        Y, W = out[f"sketch_y.{name}"] / weight, out[f"sketch_w.{name}"] / weight
        sketches[name] = Sketch(name, shape, layout.plan.seed, Y, W)
    state = AdapterState.from_flat(flat)
    exact = AdapterState.from_flat(
        {k: v / weight for k, v in out.items() if not k.startswith(special)}
    )
    means = dict(exact.factors)
    return SecureSums(weight, loss, state, products, clipped, sketches=sketches, means=means)
