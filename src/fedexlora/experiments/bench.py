"""Communication cost per round of each method, counted by the engines' own code.

``fedexlora bench comm`` prints, per method, the bytes round 2 moves down (server to
client) and up (client to server), per client and for all ``k`` clients. From round 2 on
the clients hold the base model and whatever was sent once (FFA-LoRA's frozen A), and a
round folds the previous round's residual; every later round costs the same, except
where a method's round plan (:meth:`~fedexlora.core.methods.MethodSpec.plan`) changes by
round: RoLoRA's odd rounds upload B where its even rounds upload A.

The figures are not a formula of this module's: each method's server
(:class:`fedexlora.server.Server`, the one both engines run) starts from random factors
of the model's shapes, sends every client its round-1 payload, aggregates one random
upload per client (exactly the tensors the server accepts that round), and builds each
client's round-2 payload. ``down`` is :attr:`~fedexlora.core.messages.Payload.nbytes` of
those payloads and ``up`` :attr:`~fedexlora.core.messages.ClientUpload.nbytes` of the
round-2 uploads: what the engines count as ``bytes_down`` and ``bytes_up`` in
``metrics.jsonl``. So a method's residual travels down when its server sends one
(FedEx-LoRA's, FLoRA's stacked factors, FRLoRA's ``B̄Ā - B0A0``), a frozen or personal
factor does not, and FedSA-LoRA's task head stays on the client.

Layers of the same shape cost the same, so the server runs one layer of each distinct
shape, and each message's bytes count that layer as often as the model has it (a
Llama-7B-sized model never has to fit in memory).

Two rows are the bench's own, for comparison; no engine sends them:

* ``fedex-dense``: FedEx-LoRA as the released code sends it: its round-2 payload with
  every residual a dense ``(d, n)`` matrix.
* ``full-ft``: full fine-tuning of the same adapted layers: their dense ``(d, n)``
  weights both ways. It is a lower bound for full fine-tuning of the whole model, which
  would also send every layer that LoRA leaves frozen.

Trainable non-LoRA tensors of the model (a classifier head) travel with the factors
where the server sends and accepts them, and are counted in ``extra_bytes``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import typer

from fedexlora.core.methods import REGISTRY
from fedexlora.core.units import format_bytes

__all__ = [
    "comm_methods",
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


def comm_methods() -> tuple[str, ...]:
    """The table's rows: every federated method of the registry, then the bench's own.

    The registry is asked now, so a method added later counts. The bench's own rows are
    FedEx-LoRA's dense residual as the released code sends it, and full fine-tuning.
    """
    federated = [name for name, spec in REGISTRY.items() if spec.federated]
    return (*(m for m in federated if m != _OURS), "fedex-dense", _OURS, "full-ft")


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

    if num_labels < 1:
        raise ValueError(f"`--num-labels` must be >= 1, got {num_labels}")
    peft_model, _ = load_model(
        model, causal=False, num_labels=num_labels, r=rank, target_modules=target_modules
    )
    label = "MiniLM-L6 q,v + head" if model == "minilm" else model
    return shape_from_model(peft_model, label)[0]


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _one_layer(message, name: str):
    """``message`` (a payload or an upload) cut down to module ``name``: no other layer."""
    from dataclasses import replace

    from fedexlora.core.messages import Payload
    from fedexlora.core.state import AdapterState

    state = AdapterState(factors={name: message.state.factors[name]})
    if isinstance(message, Payload):
        kept = {name: message.residuals[name]} if name in message.residuals else {}
        return replace(message, state=state, residuals=kept)
    return replace(message, state=state)


def _model_bytes(message, counts: dict[str, int]) -> int:
    """``message.nbytes`` with each layer counted as often as the model has its shape.

    The server ran one layer of each distinct shape (``counts``: its name -> how many
    layers of the model have that shape); layers of one shape cost the same.
    """
    return message.nbytes + sum(
        (count - 1) * _one_layer(message, name).nbytes for name, count in counts.items()
    )


def _upload(server, client: int, generator=None):
    """A valid upload of ``client`` for the server's coming round.

    Exactly the tensors the server expects (:meth:`~fedexlora.server.Server.upload_template`:
    what the method's round plan uploads that round, which every client step sends, and
    trains). With ``generator``, each is moved by random noise, as local training moves
    it; what the plan does not upload stays the global one on every client, as in a run
    (a round that trains B alone leaves no residual); without, they are the global ones
    (the same bytes, nothing to draw).
    """
    import torch

    from fedexlora.core.messages import ClientUpload
    from fedexlora.core.state import AdapterState

    def moved(t):
        if t is None or generator is None:
            return t
        return t + 0.1 * torch.randn(t.shape, generator=generator)

    template = server.sent.get(client, server.upload_template())
    state = AdapterState(
        factors={k: (moved(A), moved(B)) for k, (A, B) in template.factors.items()},
        extra={k: moved(t) for k, t in template.extra.items()},
    )
    return ClientUpload(client, state, num_examples=10 + client)


def _round_two(
    method: str, shape: ModelShape, rank: int, clients: int, seed: int, sb_rank: int
) -> tuple[list, list, dict[str, int]]:
    """Round 2 of ``method``'s server on one layer of each shape: its payloads and uploads.

    The server (:class:`fedexlora.server.Server`, the one both engines run) starts from
    random factors, sends every client its round-1 payload, aggregates one random upload
    per client, and builds each client's round-2 payload: what an engine sends and counts
    as ``bytes_down`` (``Payload.nbytes``). The round-2 uploads are those it would accept
    (``ClientUpload.nbytes``, counted as ``bytes_up``).

    Returns:
        ``(payloads, uploads, counts)``: one of each per client, and per layer name of
        the server the number of layers of the model with its shape.

    Raises:
        RuntimeError: If the server refused a round-1 upload (the bench built it wrong).
    """
    import torch

    from fedexlora.core.state import AdapterState, LayerInfo
    from fedexlora.server import Server

    spec = REGISTRY[method]
    g = torch.Generator().manual_seed(seed)
    factors, layers, counts = {}, {}, {}
    for i, group in enumerate(shape.layers):
        name = f"{i}.{group.name}"
        # in the server's coordinates (Fed-SB's: A = I, B = the r x r core)
        A, B = spec.synthetic_factors(group.d, group.n, rank, sb_rank, g)
        factors[name] = (A, B)
        d, n, r = B.shape[0], A.shape[1], A.shape[0]
        layers[name] = LayerInfo(scale=1.0, fan_in_fan_out=False, rank=r, shape=(d, n))
        counts[name] = group.count
    extra = {f"extra{i}": torch.randn(s, generator=g) for i, s in enumerate(shape.extra)}
    server = Server(
        AdapterState(factors, extra), layers, method=spec.server, num_clients=clients, seed=seed
    )
    for c in range(clients):  # round 1: the factors only, no residual yet
        server.payload_for(c)
    outcome = server.aggregate([_upload(server, c, g) for c in range(clients)], effective=False)
    if outcome.rejected:
        raise RuntimeError(f"{method}: the server refused the bench's uploads {outcome.rejected}")
    payloads = [server.payload_for(c) for c in range(clients)]
    uploads = [_upload(server, c) for c in range(clients)]
    return payloads, uploads, counts


def _method_bytes(
    method: str, shape: ModelShape, rank: int, clients: int, seed: int, sb_rank: int
) -> dict[str, dict]:
    """Round-2 bytes of ``method`` (and, for FedEx-LoRA, of its dense variant)."""
    from dataclasses import replace

    import torch

    from fedexlora.core.factors import Residual
    from fedexlora.core.state import AdapterState

    payloads, uploads, counts = _round_two(method, shape, rank, clients, seed, sb_rank)
    downs = [_model_bytes(p, counts) for p in payloads]
    ups = [_model_bytes(u, counts) for u in uploads]
    first = payloads[0]
    groups = {f"{i}.{g.name}": g for i, g in enumerate(shape.layers)}
    row = {
        "down_per_client": max(downs),
        "up_per_client": max(ups),
        "down_total": sum(downs),
        "up_total": sum(ups),
        "residual_per_client": downs[0] - _model_bytes(replace(first, residuals={}), counts),
        "extra_bytes": AdapterState(extra=first.state.extra).nbytes,
    }
    if first.residuals:
        row["residual_rank"] = {
            f"{groups[k].name} {groups[k].d}x{groups[k].n}": r.rank
            for k, r in first.residuals.items()
        }
        row["factored"] = all(r.is_factored for r in first.residuals.values())
    out = {method: row}
    if method == _OURS:  # as the released code sends it: each residual dense (d, n)

        def dense(p):
            res = {
                k: Residual(r.shape, dense=torch.empty(r.shape, dtype=r.U.dtype))
                if r.is_factored
                else r
                for k, r in p.residuals.items()
            }
            return _model_bytes(replace(p, residuals=res), counts)

        dense_downs = [dense(p) for p in payloads]
        out["fedex-dense"] = {
            **row,
            "down_per_client": max(dense_downs),
            "down_total": sum(dense_downs),
            "residual_per_client": row["residual_per_client"] + dense_downs[0] - downs[0],
            "factored": False,
        }
    return out


_FIGURES = (
    "down_per_client",
    "up_per_client",
    "down_total",
    "up_total",
    "residual_per_client",
    "extra_bytes",
)


def comm_table(
    shape: ModelShape, rank: int, clients: int, *, seed: int = 0, fedsb_rank: int | None = None
) -> list[dict]:
    """Bytes of round 2, down and up, for every method of :func:`comm_methods`.

    Each federated method's figures are those its server's payloads and the uploads it
    accepts carry (see the module's description); ``fedex-dense`` and ``full-ft`` are
    the bench's own comparison rows.

    Args:
        shape: The adapted layers (and trainable extras) of the model.
        rank: The LoRA rank ``r``.
        clients: The number of clients ``k`` taking part in the round.
        seed: Seed of the random client factors (the bytes do not depend on it unless
            the factors are rank-deficient, which random ones are not).
        fedsb_rank: Fed-SB's rank (its core is ``fedsb_rank`` squared per layer); at most
            every layer's smaller side, as a run requires (``synthetic_factors`` refuses
            more). ``None``: 64, or the smallest layer side where that is less.

    Returns:
        One dict per method with ``model``, ``method``, ``label``, ``rank``, ``clients``,
        ``layers``, ``down_per_client``, ``up_per_client``, ``down_total``, ``up_total``
        (all ``k`` clients), ``residual_per_client`` (residual bytes in the download),
        ``extra_bytes`` (the trainable non-LoRA tensors, e.g. a head, in each download
        and upload; 0 where the clients keep their own), ``residual_rank``
        (per layer group, where there is a residual), ``factored`` (whether every
        residual travels factored), and ``down_vs_fedex`` (download relative to
        ``fedex``). The ``fedex`` row also has ``residual_dense_over_factored`` and
        ``down_dense_over_factored``.

    Raises:
        ValueError: If ``rank`` or ``clients`` is not positive, or ``fedsb_rank`` exceeds a
            layer's smaller side.
    """
    import torch

    if rank < 1:
        raise ValueError(f"`rank` must be positive, got {rank}")
    if clients < 1:
        raise ValueError(f"`clients` must be positive, got {clients}")
    if fedsb_rank is None:  # 64, unless a layer is smaller (a larger one a run refuses)
        fedsb_rank = min(64, *(min(g.d, g.n) for g in shape.layers))
    extra = sum(_nbytes(torch.empty(s, dtype=torch.float32)) for s in shape.extra)
    measured: dict[str, dict] = {}
    for m in comm_methods():
        if m not in REGISTRY:
            continue  # the bench's own rows, below
        measured.update(_method_bytes(m, shape, rank, clients, seed, fedsb_rank))
    weights = sum(
        g.count * _nbytes(torch.empty(g.d, g.n, dtype=torch.float32)) for g in shape.layers
    )
    full = extra + weights  # full fine-tuning of the adapted layers, each way
    measured["full-ft"] = {
        "down_per_client": full,
        "up_per_client": full,
        "down_total": clients * full,
        "up_total": clients * full,
        "residual_per_client": 0,
        "extra_bytes": extra,
    }
    rows = []
    for m in comm_methods():
        row = {
            "model": shape.name,
            "method": m,
            "label": _label(m),
            "rank": rank,
            "clients": clients,
            "layers": shape.num_layers,
            **{k: measured[m][k] for k in _FIGURES},
        }
        if m in REGISTRY:  # a latent method's adapter has a rank of its own
            row["rank"] = REGISTRY[m].adapter_setup(rank, 1.0, fedsb_rank)["r"]
        if "residual_rank" in measured[m]:
            row["residual_rank"] = measured[m]["residual_rank"]
            row["factored"] = measured[m]["factored"]
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
        "clients; bytes of round 2, fp32"
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
    head = max(r["extra_bytes"] for r in rows)
    if head:
        kept = [r["method"] for r in rows if not r["extra_bytes"]]
        but = f", except {', '.join(kept)} (each client keeps its own)" if kept else ""
        console.print(
            f"  every figure includes {head} B of trainable non-LoRA tensors "
            f"(the classifier head), each way{but}",
            highlight=False,
        )
    console.print()


def _print_legend(console) -> None:
    console.print("methods (down = server to one client, up = one client to server):")
    for m in comm_methods():
        console.print(f"  {m:<12} {_label(m)}", highlight=False)
    console.print(
        "  down/up are round 2, counted from the server's payloads and the uploads it "
        "accepts; 'residual' is the residual part of down/client; 'vs ours' is "
        "down/client relative to fedex",
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
    fedsb_rank: int | None = typer.Option(
        None,
        show_default=False,
        help="Fed-SB's rank, for every shape (default: 64, or the smallest layer side "
        "where that is less).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead."),
) -> None:
    """Bytes of round 2, down and up, per method, from the server's own payloads."""
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
    if rank < 1 or clients < 1 or (fedsb_rank is not None and fedsb_rank < 1):
        err.print(
            f"[bold red]error:[/bold red] `--rank`, `--clients` and `--fedsb-rank` must be "
            f">= 1, got {rank}, {clients} and {fedsb_rank}"
        )
        raise typer.Exit(2)
    tables = []
    try:
        for s in wanted:
            if s == "embedded":
                _quiet_libraries()
                shape = embedded_shape(rank, model=model, num_labels=num_labels)
                tables.append(comm_table(shape, rank, clients, fedsb_rank=fedsb_rank))
            elif s == "roberta-base":
                tables.append(comm_table(roberta_base_shape(), 4, 3, fedsb_rank=fedsb_rank))
            else:
                tables.append(comm_table(llama7b_shape(), 32, 10, fedsb_rank=fedsb_rank))
    except ValueError as exc:
        err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps([r for t in tables for r in t], indent=2))
        return
    console = Console()
    for t in tables:
        _print_table(t, console)
    _print_legend(console)
