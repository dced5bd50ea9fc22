"""Communication cost per round of each method, counted from real tensors.

``fedexlora bench comm`` prints, per method, the bytes one round moves down (server to
client) and up (client to server), per client and for all ``k`` clients. The figures are
the steady state of a round from round 2 on, when the clients already hold the base
model and, under FFA-LoRA, the frozen A.

Every figure is the ``numel * element_size`` of a tensor that was actually built: random
client factors at the layer's shape go through :func:`fedexlora.core.aggregation.aggregate`,
and the result's ``A``, ``B`` and ``residual`` are measured. Layers of the same shape
cost the same, so one layer of each distinct shape is built and its bytes multiplied by
the number of layers of that shape (a Llama-7B-sized model never has to fit in memory).

What each method sends, per client and round (fp32 throughout, as the engine sends):

* ``fedit``: down global A, B; up A_i, B_i.
* ``ffa``: down global B (A is frozen and was sent once, in round 1); up B_i.
* ``flora``: down the fresh global A, B and the stacked client factors, which
  ``aggregate(method="flora")`` returns as its residual (rank ``k r``, or dense where
  that is smaller); up A_i, B_i.
* ``fedex-dense``: FedEx-LoRA as the released code sends it: down A, B and the dense
  ``(d, n)`` residual; up A_i, B_i.
* ``fedex``: FedEx-LoRA as this package sends it: down A, B and the residual factored
  at rank ``<= (k-1) r`` (dense where that is smaller); up A_i, B_i.
* ``full-ft``: full fine-tuning of the same adapted layers: their dense ``(d, n)``
  weights both ways. It is a lower bound for full fine-tuning of the whole model, which
  would also send every layer that LoRA leaves frozen.

Trainable non-LoRA tensors of the model (a classifier head) travel both ways with every
method and are counted in ``extra_bytes``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import typer

from fedexlora.core.methods import REGISTRY
from fedexlora.core.units import format_bytes

__all__ = [
    "COMM_METHODS",
    "LayerShape",
    "ModelShape",
    "bench_app",
    "comm_table",
    "embedded_shape",
    "llama7b_shape",
    "roberta_base_shape",
    "shape_from_model",
]

# The method measured against a baseline (FedEx-LoRA): the table's reference, last of the
# registered methods, after its bench-only dense variant.
_OURS = next(name for name, spec in REGISTRY.items() if spec.baseline)
_FEDERATED = tuple(name for name, spec in REGISTRY.items() if spec.federated)
# Every federated method of the registry, then two rows of the bench's own: FedEx-LoRA's
# dense residual as the released code sends it, and full fine-tuning.
COMM_METHODS = (
    *(m for m in _FEDERATED if m != _OURS),
    "fedex-dense",
    _OURS,
    "full-ft",
)

_LABELS = {
    "fedit": "FedIT",
    "ffa": "FFA-LoRA",
    "flora": "FLoRA",
    "fedsb": "Fed-SB: only the r x r core, at its own (larger) rank",
    "fedex-dense": "FedEx-LoRA, dense residual (released code)",
    "fedex": "FedEx-LoRA, factored residual (ours)",
    "full-ft": "full fine-tuning of the adapted layers only",
}


def _label(method: str) -> str:
    """A row's label: the bench's own, or the registered method's title."""
    return _LABELS.get(method) or REGISTRY[method].title


bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: communication per round (comm). Timing and memory benchmarks live "
    "in the repository's benchmarks/ folder.",
)


@bench_app.callback()
def _bench() -> None:
    """Benchmarks of fedex-lora (a group, so that ``fedexlora bench comm`` works)."""


@dataclass(frozen=True)
class LayerShape:
    """A group of adapted layers of one shape.

    Attributes:
        name: What the layers are, e.g. ``"q_proj,k_proj,v_proj,o_proj"``.
        d: Output features: ``B`` is ``(d, r)``.
        n: Input features: ``A`` is ``(r, n)``.
        count: How many layers of the model have this shape.
    """

    name: str
    d: int
    n: int
    count: int


@dataclass(frozen=True)
class ModelShape:
    """The adapted layers of a model, and its trainable non-LoRA tensors.

    Attributes:
        name: A label for tables.
        layers: The adapted layers, grouped by shape.
        extra: Shapes of the trainable non-LoRA tensors (e.g. a classifier head), which
            travel both ways every round.
    """

    name: str
    layers: tuple[LayerShape, ...]
    extra: tuple[tuple[int, ...], ...] = ()

    @property
    def num_layers(self) -> int:
        """The number of adapted layers."""
        return sum(g.count for g in self.layers)


def roberta_base_shape() -> ModelShape:
    """RoBERTa-base with LoRA on query and value (the paper's GLUE setting).

    12 layers, each with a 768x768 query and value projection. The GLUE classification
    head is left out: the comparison is of the adapters and residuals alone.
    """
    return ModelShape("RoBERTa-base q,v", (LayerShape("query,value", 768, 768, 2 * 12),))


def llama7b_shape() -> ModelShape:
    """A Llama-7B-shaped decoder with LoRA on every linear layer of its 32 blocks.

    Per block: q, k, v, o are 4096x4096; gate and up map 4096 -> 11008; down maps
    11008 -> 4096. The LM head and embeddings are not adapted.
    """
    return ModelShape(
        "Llama-7B all linear",
        (
            LayerShape("q,k,v,o_proj", 4096, 4096, 4 * 32),
            LayerShape("gate,up_proj", 11008, 4096, 2 * 32),
            LayerShape("down_proj", 4096, 11008, 32),
        ),
    )


def shape_from_model(model, name: str = "model") -> tuple[ModelShape, int]:
    """The adapted-layer shapes and trainable extras of a peft model, and its LoRA rank.

    Args:
        model: A peft model (as returned by :func:`fedexlora.bridge.models.load_model`).
        name: A label for tables.

    Returns:
        ``(shape, rank)``.

    Raises:
        ValueError: If the layers do not all have the same rank.
    """
    from fedexlora.bridge.adapters import get_state, layer_info

    info = layer_info(model)
    ranks = sorted({li.rank for li in info.values()})
    if len(ranks) != 1:
        raise ValueError(f"layers have different LoRA ranks {ranks}; comm assumes one rank")
    groups: dict[tuple[int, int], list[str]] = {}
    for layer, li in info.items():
        groups.setdefault(li.shape, []).append(layer.rsplit(".", 1)[-1])
    layers = tuple(
        LayerShape(",".join(sorted(set(names))), d, n, len(names))
        for (d, n), names in groups.items()
    )
    extra = tuple(tuple(t.shape) for t in get_state(model).extra.values())
    return ModelShape(name, layers, extra), ranks[0]


def embedded_shape(
    rank: int = 8,
    *,
    model: str = "minilm",
    num_labels: int = 5,
    target_modules: list[str] | None = None,
) -> ModelShape:
    """The shape of the model ``fedexlora run`` trains, read from the loaded peft model.

    The defaults are those of ``fedexlora run``: MiniLM-L6 with LoRA on query and value
    and the 5-class head of ``bbc-news``.
    """
    from fedexlora.bridge.models import load_model

    peft_model, _ = load_model(
        model, causal=False, num_labels=num_labels, r=rank, target_modules=target_modules
    )
    label = "MiniLM-L6 q,v + head" if model == "minilm" else model
    return shape_from_model(peft_model, label)[0]


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _layer_bytes(
    d: int, n: int, rank: int, clients: int, seed: int, sb_rank: int
) -> dict[str, dict]:
    """Down and up bytes of one layer for every method, from real tensors."""
    import torch

    from fedexlora.core.aggregation import aggregate

    g = torch.Generator().manual_seed(seed)
    As = [torch.randn(rank, n, generator=g) / n**0.5 for _ in range(clients)]
    Bs = [torch.randn(d, rank, generator=g) / d**0.5 for _ in range(clients)]
    # a latent method (Fed-SB) in the server's coordinates: A = I shared, B = the r x r core
    q = min(sb_rank, d, n)
    cores = [torch.randn(q, q, generator=g) for _ in range(clients)]
    up_ab = _nbytes(As[0]) + _nbytes(Bs[0])
    out: dict[str, dict] = {}
    for m in _FEDERATED:
        spec = REGISTRY[m]
        if spec.latent:  # only the core travels, each way
            res = aggregate([torch.eye(q)] * clients, cores, method=m, generator=g)
            out[m] = {"down": _nbytes(res.B), "up": _nbytes(cores[0]), "residual": 0}
        elif spec.alternating:  # RoLoRA: B goes up in odd rounds, A in even (their mean)
            res = aggregate([As[0]] * clients, Bs, method=m, generator=g)
            up = (_nbytes(As[0]) + _nbytes(Bs[0])) // 2
            out[m] = {"down": _nbytes(res.A) + _nbytes(res.B), "up": up, "residual": 0}
        elif spec.frozen_A:  # A was sent once, in round 1: only B travels
            res = aggregate([As[0]] * clients, Bs, method=m, generator=g)
            down = _nbytes(res.B) + (_nbytes(res.A) if spec.refactors_A else 0)  # FedSVD: new A
            out[m] = {"down": down, "up": _nbytes(Bs[0]), "residual": 0}
        elif spec.personal_B:  # FedSA-LoRA: A up, Ā down; B stays on the client
            res = aggregate(As, [Bs[0]] * clients, method=m, generator=g)
            out[m] = {"down": _nbytes(res.A), "up": _nbytes(As[0]), "residual": 0}
        else:
            start = (As[0], Bs[0]) if spec.restarts else None  # FRLoRA: the round's start
            res = aggregate(As, Bs, method=m, generator=g, start=start)
            ab = _nbytes(res.A) + _nbytes(res.B)
            if not spec.exact:  # averaged factors alone: no residual
                out[m] = {"down": ab, "up": up_ab, "residual": 0}
                continue
            r = res.residual  # exact with both factors trained: a residual travels down
            out[m] = {
                "down": ab + r.nbytes,
                "up": up_ab,
                "residual": r.nbytes,
                "residual_rank": r.rank,
                "factored": r.is_factored,
            }
            if m == _OURS:  # and as the released code sends it: dense
                dense = _nbytes(r.to_dense())
                out["fedex-dense"] = {
                    "down": ab + dense,
                    "up": up_ab,
                    "residual": dense,
                    "residual_rank": r.rank,
                    "factored": False,
                }

    weight = _nbytes(torch.empty(d, n, dtype=torch.float32))
    out["full-ft"] = {"down": weight, "up": weight, "residual": 0}
    return out


def comm_table(
    shape: ModelShape, rank: int, clients: int, *, seed: int = 0, fedsb_rank: int = 64
) -> list[dict]:
    """Bytes per round, down and up, for every method of :data:`COMM_METHODS`.

    Args:
        shape: The adapted layers (and trainable extras) of the model.
        rank: The LoRA rank ``r``.
        clients: The number of clients ``k`` taking part in the round.
        seed: Seed of the random client factors (the bytes do not depend on it unless
            the factors are rank-deficient, which random ones are not).
        fedsb_rank: Fed-SB's rank (its core is ``fedsb_rank`` squared per layer, capped by
            the layer's smaller side).

    Returns:
        One dict per method with ``model``, ``method``, ``label``, ``rank``, ``clients``,
        ``layers``, ``down_per_client``, ``up_per_client``, ``down_total``, ``up_total``
        (all ``k`` clients), ``residual_per_client`` (residual bytes in the download),
        ``extra_bytes`` (head, included in every up and down figure), ``residual_rank``
        (per layer group, where there is a residual), ``factored`` (whether every
        residual travels factored), and ``down_vs_fedex`` (download relative to
        ``fedex``). The ``fedex`` row also has ``residual_dense_over_factored`` and
        ``down_dense_over_factored``.

    Raises:
        ValueError: If ``rank`` or ``clients`` is not positive.
    """
    import torch

    if rank < 1:
        raise ValueError(f"`rank` must be positive, got {rank}")
    if clients < 1:
        raise ValueError(f"`clients` must be positive, got {clients}")
    extra = sum(_nbytes(torch.empty(s, dtype=torch.float32)) for s in shape.extra)
    per_group = [
        (g, _layer_bytes(g.d, g.n, rank, clients, seed + i, fedsb_rank))
        for i, g in enumerate(shape.layers)
    ]
    rows = []
    for m in COMM_METHODS:
        down = extra + sum(g.count * b[m]["down"] for g, b in per_group)
        up = extra + sum(g.count * b[m]["up"] for g, b in per_group)
        row = {
            "model": shape.name,
            "method": m,
            "label": _label(m),
            "rank": rank,
            "clients": clients,
            "layers": shape.num_layers,
            "down_per_client": down,
            "up_per_client": up,
            "down_total": clients * down,
            "up_total": clients * up,
            "residual_per_client": sum(g.count * b[m]["residual"] for g, b in per_group),
            "extra_bytes": extra,
        }
        if m in REGISTRY and REGISTRY[m].latent:  # at its own rank
            row["rank"] = fedsb_rank
        if "residual_rank" in per_group[0][1][m]:
            row["residual_rank"] = {
                f"{g.name} {g.d}x{g.n}": b[m]["residual_rank"] for g, b in per_group
            }
            row["factored"] = all(b[m]["factored"] for _, b in per_group)
        rows.append(row)
    by = {r["method"]: r for r in rows}
    ours = by[_OURS]
    for r in rows:
        r["down_vs_fedex"] = r["down_per_client"] / ours["down_per_client"]
    dense = by["fedex-dense"]
    ours["residual_dense_over_factored"] = (
        dense["residual_per_client"] / ours["residual_per_client"]
        if ours["residual_per_client"]
        else float("inf")
    )
    ours["down_dense_over_factored"] = dense["down_per_client"] / ours["down_per_client"]
    return rows


def _print_table(rows: list[dict], console) -> None:
    from rich.table import Table

    first = rows[0]
    k = first["clients"]
    title = (
        f"{first['model']}: {first['layers']} adapted layers, r={first['rank']}, k={k} "
        "clients; bytes per round, fp32"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("method")
    for col in ("down/client", "up/client", f"down x{k}", f"up x{k}", "residual", "vs ours"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["method"],
            format_bytes(r["down_per_client"]),
            format_bytes(r["up_per_client"]),
            format_bytes(r["down_total"]),
            format_bytes(r["up_total"]),
            format_bytes(r["residual_per_client"]) if r["residual_per_client"] else "-",
            f"{r['down_vs_fedex']:.2f}x",
        )
    console.print(table)
    ours = next(r for r in rows if r["method"] == _OURS)
    ranks = ", ".join(f"{g} rank {q}" for g, q in ours.get("residual_rank", {}).items())
    console.print(
        f"  fedex residual dense/factored {ours['residual_dense_over_factored']:.1f}x, "
        f"download dense/factored {ours['down_dense_over_factored']:.2f}x; {ranks}",
        highlight=False,
    )
    if first["extra_bytes"]:
        console.print(
            f"  every figure includes {first['extra_bytes']} B of trainable non-LoRA tensors "
            "(the classifier head), each way",
            highlight=False,
        )
    console.print()


def _print_legend(console) -> None:
    console.print("methods (down = server to one client, up = one client to server):")
    for m in COMM_METHODS:
        console.print(f"  {m:<12} {_label(m)}", highlight=False)
    console.print(
        "  down/up are a steady-state round (round 2 on); 'residual' is the residual part "
        "of down/client; 'vs ours' is down/client relative to fedex",
        highlight=False,
    )
    console.print()


_SHAPES = ("embedded", "roberta-base", "llama-7b")


def _quiet_libraries() -> None:
    from fedexlora.quiet import quiet_libraries

    quiet_libraries()


@bench_app.command("comm")
def comm(
    rank: int = typer.Option(8, "--rank", "-r", help="LoRA rank of the embedded model."),
    clients: int = typer.Option(
        3, "--clients", "--num-clients", help="Clients of the embedded model."
    ),
    model: str = typer.Option("minilm", help="Model of the first table."),
    num_labels: int = typer.Option(5, help="Classes of its head (bbc-news has 5)."),
    shapes: str = typer.Option(
        ",".join(_SHAPES),
        help="Comma list of embedded (the model above, with --rank/--clients), "
        "roberta-base (q,v, r=4, k=3) and llama-7b (all linear, r=32, k=10).",
    ),
    fedsb_rank: int = typer.Option(64, help="Fed-SB's rank, for every shape."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead."),
) -> None:
    """Bytes per round, down and up, per method, counted from real tensors."""
    from rich.console import Console
    from rich.markup import escape

    wanted = [s.strip() for s in shapes.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in _SHAPES]
    err = Console(stderr=True)
    if unknown or not wanted:
        err.print(
            "[bold red]error:[/bold red] "
            + escape(f"`--shapes`: unknown {unknown}; choose from {list(_SHAPES)}"),
            highlight=False,
        )
        raise typer.Exit(2)
    if rank < 1 or clients < 1 or fedsb_rank < 1:
        err.print(
            f"[bold red]error:[/bold red] `--rank`, `--clients` and `--fedsb-rank` must be "
            f">= 1, got {rank}, {clients} and {fedsb_rank}"
        )
        raise typer.Exit(2)
    tables = []
    for s in wanted:
        if s == "embedded":
            _quiet_libraries()
            try:
                shape = embedded_shape(rank, model=model, num_labels=num_labels)
            except ValueError as exc:
                err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False)
                raise typer.Exit(2) from None
            tables.append(comm_table(shape, rank, clients, fedsb_rank=fedsb_rank))
        elif s == "roberta-base":
            tables.append(comm_table(roberta_base_shape(), 4, 3, fedsb_rank=fedsb_rank))
        else:
            tables.append(comm_table(llama7b_shape(), 32, 10, fedsb_rank=fedsb_rank))
    if as_json:
        typer.echo(json.dumps([r for t in tables for r in t], indent=2))
        return
    console = Console()
    for t in tables:
        _print_table(t, console)
    _print_legend(console)
