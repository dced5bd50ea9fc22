"""What a run is built from, on either engine: its model, its server, its data.

Both engines (in process, :mod:`fedexlora.run.inprocess`; Flower's ServerApp and
ClientApp, :mod:`fedexlora.flower`) build every method the same way here, so they start
from the same global model: :func:`new_model` (the LoRA model on the run's device, with
Fed-SB's frozen factors and the adapters of other client ranks), :func:`new_server` (its
:class:`~fedexlora.server.Server`), :func:`prepare` (the partitions and the tokenized
splits, :class:`Prepared`) and the settings they read (device, dtype, the adapter a
client of another rank trains). The name says what the module does: it builds what the
engines run, and runs nothing itself. What a client then does in a round is
:mod:`fedexlora.run.client_step`; the model-level steps a user's own loop needs are
:mod:`fedexlora.bridge.steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass

import torch

from fedexlora.bridge.adapters import get_state, layer_info
from fedexlora.bridge.fold import folded_delta, side_caps
from fedexlora.bridge.sharing import route_shared
from fedexlora.config import RunConfig
from fedexlora.core.methods import get_method
from fedexlora.server.server import Server
from fedexlora.training.local import Encoded, encode

__all__ = [
    "Prepared",
    "autocast_dtype",
    "check_max_length",
    "check_train_rows",
    "client_adapter",
    "effective_partition",
    "new_model",
    "new_server",
    "prepare",
    "resolve_device",
    "torch_dtype",
]


@dataclass
class Prepared:
    """What every method of a run shares: the task, partitions and tokenized data."""

    task: object
    parts: list[list[int]]
    train: Encoded
    test: Encoded
    tokenizer: object
    partition_table: str
    test_parts: list[list[int]] = dataclasses.field(default_factory=list)


def torch_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> torch dtype."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device` is 'cuda' but no CUDA GPU is available; use 'auto' or 'cpu'")
    return torch.device(name)


def autocast_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The autocast dtype for training and evaluation (``None`` for fp32)."""
    return None if cfg.dtype == "fp32" else torch_dtype(cfg.dtype)


def new_model(cfg: RunConfig, task, method: str):
    """A freshly loaded LoRA model on the run's device; same seed, same head and adapters.

    With ``dtype`` bf16/fp16 the frozen base weights are stored in that dtype while the
    adapters stay fp32 (peft's adapter autocast); with ``quantization`` the base is
    quantized by bitsandbytes. Either way residuals go to an fp32 side branch, never into
    the base weights (:func:`fedexlora.bridge.fold.fold_residuals`); so they do on an
    fp32 base with ``fp32_side_branch``.
    """
    from fedexlora.bridge.models import load_model

    spec = get_method(method)
    model, tokenizer = load_model(
        cfg.model,
        causal=task.kind == "causal_lm",
        num_labels=max(task.num_labels, 1),
        dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        rslora=cfg.rslora,
        dora=cfg.dora,
        seed=cfg.seed,
        dtype=torch_dtype(cfg.dtype),
        quantization=cfg.quantization,
        double_quant=cfg.double_quant,
        **spec.adapter_setup(cfg.lora_r, cfg.lora_alpha, cfg.fedsb_rank),
    )
    check_max_length(cfg, model)
    route_shared(model)  # a tied or replicated base weight: side branch, or refused now
    if cfg.side_budget is not None:
        from fedexlora.bridge.fold import side_caps

        side_caps(model, budget=cfg.side_budget)  # refuses a budget below one rank
    if cfg.fp32_side_branch_resolved:
        from fedexlora.bridge.fold import use_side_branch

        use_side_branch(model)
    spec.prepare(ModelSetup(cfg, task, model, tokenizer))  # Fed-SB: its frozen A and B
    for r in sorted(set(cfg.client_ranks or [])):
        if spec.hetero_ranks and r != cfg.lora_r:  # heterogeneous client ranks
            model.add_adapter(f"rank{r}", dataclasses.replace(model.peft_config["default"], r=r))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model.to(resolve_device(cfg.device)), tokenizer


class ModelSetup:
    """What a method may install into a freshly loaded model (``MethodSpec.prepare_model``).

    The method's own file decides what (Fed-SB: its frozen A and B around the core); this
    gives it the run's configuration and the bridge's installers, the same in every
    process (seeded, or computed from the same data).

    Attributes:
        cfg: The run configuration.
        task: The loaded task.
        model: The peft model, its adapter loaded.
        tokenizer: The model's tokenizer.
    """

    def __init__(self, cfg: RunConfig, task, model, tokenizer):
        self.cfg, self.task, self.model, self.tokenizer = cfg, task, model, tokenizer

    def pooled_gradients(self, samples: int) -> dict:
        """Each LoRA layer's gradient on ``samples`` pooled training examples (seeded).

        The sum of every client's gradient equals the gradient on the pooled examples: the
        simulation computes that sum here (a deployment would collect it once).
        """
        from fedexlora.bridge.layers import lora_layers
        from fedexlora.training.local import estimate_gradients

        cfg, task = self.cfg, self.task
        g = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randperm(len(task.train), generator=g)[:samples].tolist()
        data = encode(
            task.train.select(pick),
            self.tokenizer,
            kind=task.kind,
            max_length=cfg.max_length,
            template=task.template,
        )
        return estimate_gradients(
            self.model,
            data,
            samples=samples,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            layers=lora_layers(self.model),
        )

    def install_latent(self, *, init: str, grads: dict | None, total_steps: int) -> None:
        """Frozen A and B around each layer's ``r x r`` core, seeded by the run.

        :func:`fedexlora.bridge.latent.install`.
        """
        from fedexlora.bridge.latent import install

        install(
            self.model, init=init, seed=self.cfg.seed, grads=grads, lr=self.cfg.lr,
            total_steps=total_steps,
        )  # fmt: skip


def client_adapter(cfg: RunConfig, method: str, client: int) -> str | None:
    """The peft adapter a client trains when its rank differs from the global one."""
    if not cfg.client_ranks or not get_method(method).hetero_ranks:
        return None
    r = cfg.client_ranks[client]
    return None if r == cfg.lora_r else f"rank{r}"


def new_server(cfg: RunConfig, method: str, model) -> Server:
    """The server of one method, from the freshly loaded model's adapters."""
    spec = get_method(method)
    centralized = not spec.federated  # one party: its server's math, one client
    client_layers = {}
    for c in range(cfg.num_clients):
        name = client_adapter(cfg, method, c)
        if name is not None:
            client_layers[c] = layer_info(model, name)
    server = Server(
        get_state(model, adapter="default"),
        layer_info(model, "default"),
        method=spec.server,
        num_clients=1 if centralized else cfg.num_clients,
        fraction=1.0 if centralized else cfg.fraction,
        weighting=cfg.weighting,
        seed=cfg.seed,
        residual_rank=None if centralized else cfg.residual_rank,
        side_rank=None
        if centralized
        else side_caps(model, side_rank=cfg.side_rank, budget=cfg.side_budget),
        max_update_norm=None if centralized else cfg.max_update_norm,
        client_layers=client_layers,
    )
    if spec.folds_into_model:
        # every engine folds each outcome into this model (apply_round): the server reads
        # a dense base delta from it instead of keeping a second copy (Fed-SB's deltas are
        # in latent coordinates, FedSA-LoRA folds nothing into a global model)
        server.delta_source = functools.partial(folded_delta, model)
    return server


def effective_partition(cfg: RunConfig, task) -> tuple[str, str]:
    """The scheme the clients are partitioned by, and a note when it is not ``cfg``'s.

    Dirichlet partitioning draws class proportions, so a task without class labels (a
    causal-LM task such as gsm8k) is partitioned IID; the run says so in its header,
    ``partitions.txt`` and ``config.toml``.
    """
    if cfg.partition == "dirichlet" and task.kind != "classification":
        return "iid", (
            f"partition 'dirichlet' needs class labels and task {cfg.task!r} has none "
            f"({task.kind}): its clients are partitioned iid"
        )
    return cfg.partition, ""


def check_max_length(cfg: RunConfig, model) -> None:
    """Refuses a ``max_length`` beyond the positions the model can embed.

    Args:
        cfg: The run's configuration.
        model: The loaded model, or its configuration alone (read before the weights).

    Raises:
        ValueError: Naming the flag, the limit and where it comes from.
    """
    config = getattr(model, "config", model)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        limit = getattr(config, attr, None)
        if isinstance(limit, int) and limit > 0:
            if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
                limit -= 2  # their position ids start after the padding index
            if cfg.max_length > limit:
                raise ValueError(
                    f"--max-length {cfg.max_length} exceeds the {limit} positions model "
                    f"{cfg.model!r} can embed ({attr}); use --max-length {limit} or less"
                )
            return


def check_train_rows(cfg: RunConfig, task) -> None:
    """Refuses a training split smaller than the clients, naming its cause: the split.

    Raises:
        ValueError: If ``task`` has fewer training rows than ``cfg.num_clients``.
    """
    if len(task.train) < cfg.num_clients:
        limit = f", --max-train {cfg.max_train}" if cfg.max_train is not None else ""
        raise ValueError(
            f"task {cfg.task!r} has {len(task.train)} training rows left after its test "
            f"split (--test-fraction {cfg.test_fraction}{limit}), fewer than --num-clients "
            f"{cfg.num_clients}; fix: a lower --test-fraction, or fewer clients"
        )


def encode_rows(cfg: RunConfig, prep: Prepared, rows) -> Encoded:
    """A client's own training rows, tokenized as the run's are (a node's own file).

    Raises:
        ValueError: If no row keeps an answer token within ``max_length`` (causal LM).
    """
    task = prep.task
    data = encode(
        rows, prep.tokenizer, kind=task.kind, max_length=cfg.max_length, template=task.template
    )
    if task.kind == "causal_lm":
        _check_answers_fit(cfg, data)
    return data


def _check_answers_fit(cfg: RunConfig, train, whose: str = "") -> None:
    """Refuses training examples whose prompt fills ``--max-length``; warns of some.

    Such an example leaves no answer token to learn from: a batch of only such examples
    has a loss of 0/0 (NaN), which would wreck the client's training.
    """
    cut = [i for i, labels in enumerate(train.labels) if all(t == -100 for t in labels)]
    if not cut:
        return
    longest = max(len(p) for p in train.prompts)
    fix = f"raise --max-length (now {cfg.max_length}; the longest prompt has {longest} tokens)"
    if len(cut) == len(train.labels):
        raise ValueError(
            f"{whose}every training example's prompt fills --max-length {cfg.max_length} "
            f"tokens, leaving no answer token to learn from; fix: {fix}"
        )
    warnings.warn(
        f"{whose}{len(cut)} of {len(train.labels)} training examples keep no answer token within "
        f"--max-length {cfg.max_length}: a batch of only such examples has no loss; {fix}",
        stacklevel=2,
    )


_PARTITION_ARGS = {"num_clients": "--num-clients", "min_partition_size": "--min-partition-size",
                   "alpha": "--alpha"}  # fmt: skip


def _as_flags(message: str) -> str:
    """``partition``'s message with its arguments spelled as ``fedexlora run``'s flags."""
    for arg, flag in _PARTITION_ARGS.items():
        message = re.sub(rf"\b{arg}=", f"{flag} ", message)
        message = re.sub(rf"\b(a smaller|lower|increase) {arg}\b", rf"\1 {flag}", message)
    return message


def prepare(cfg: RunConfig, tokenizer, task) -> Prepared:
    """Partitions a loaded task and tokenizes both splits."""
    if cfg.trainer == "trl" and task.kind != "causal_lm":
        raise ValueError(
            f"`trainer` 'trl' (TRL's SFTTrainer) trains causal-LM tasks; task {cfg.task!r} is "
            f"{task.kind}; fix: --trainer builtin, or a causal-LM task such as gsm8k"
        )
    from fedexlora.tasks.partition import describe_partitions, partition, partition_like

    if cfg.client_data is not None:  # each client's own file (load_task_for read them)
        from fedexlora.tasks.own_data import parts_by_client, rows_digest

        parts = parts_by_client(task.train, cfg.num_clients)
        scheme = "own"
        note = (
            f"each client trains on its own file in --client-data {cfg.client_data} "
            f"(rows digest {rows_digest(task.train)})"
        )
    else:
        check_train_rows(cfg, task)
        scheme, note = effective_partition(cfg, task)
        try:
            parts = partition(
                task.train,
                cfg.num_clients,
                scheme=scheme,
                alpha=cfg.alpha,
                seed=cfg.seed,
                min_partition_size=cfg.min_partition_size,
            )
        except ValueError as exc:  # named as the run's flags, not the function's arguments
            raise ValueError(_as_flags(str(exc))) from None
    by_group = scheme == "group"  # whole groups per client (deepmind-math's modules)
    if by_group:
        table = describe_partitions(task.train, parts, label_column="group")
    else:
        table = describe_partitions(task.train, parts, task.label_names or None)
    if note:
        table = f"note: {note}\n{table}"
    train = encode(
        task.train, tokenizer, kind=task.kind, max_length=cfg.max_length, template=task.template
    )
    test = encode(
        task.test, tokenizer, kind=task.kind, max_length=cfg.max_length, template=task.template
    )
    if task.kind == "causal_lm" and cfg.client_data is not None:
        for i, part in enumerate(parts):  # each client trains on its own file alone
            _check_answers_fit(cfg, train.subset(part), f"client {i}'s file: ")
    elif task.kind == "causal_lm":
        _check_answers_fit(cfg, train)
    classes = task.kind == "classification" and "label" in task.train.column_names
    column = "group" if by_group and "group" in task.test.column_names else "label"
    test_parts = partition_like(  # each client's own test split (personalized methods)
        task.train[column] if classes or column == "group" else None,
        parts,
        task.test[column] if classes or column == "group" else None,
        len(task.test),
        seed=cfg.seed,
    )
    return Prepared(task, parts, train, test, tokenizer, table, test_parts)
