"""Run configuration: one dataclass, TOML in and out, validation that lists every error."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from fedexlora.config_checks import QUANTIZATIONS, cross_field_errors, model_name_error
from fedexlora.core.methods import REGISTRY, MethodSpec

__all__ = [
    "FLAGS",
    "ConfigError",
    "Option",
    "RunConfig",
    "load_run_config",
    "resumed_config",
    "load_config",
    "read_config",
    "setting_name",
    "model_name_error",
    "validate_mapping",
]

_DTYPES = ("fp32", "bf16", "fp16")
_EXPORT_FORMATS = ("adapter", "merged")
RESUME_SAFE = (
    "rounds",
    "stop_patience",
    "stop_min_rounds",
    "stop_at",
    "stop_metric",
    "data_dir",
    "export",
    "export_format",
    "export_dtype",
    "allow_inexact",
    "device",
    "keep_checkpoints",
    "save_client_adapters",
    "report_to",
    "launcher",
    "accelerate_config",
)
"""Settings that never change a run's results: how far it goes and what it writes.

A resume may change them, the checkpoint fingerprint leaves them out, and ``compare``
reuses a cell that differs only in them.
"""


class ConfigError(ValueError):
    """A configuration with one or more errors; ``errors`` lists them all."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in errors))


PANELS = (
    "Settings",
    "Model and LoRA",
    "Data",
    "Method",
    "Federation",
    "Training",
    "Evaluation",
    "Device, precision and memory",
    "Privacy",
    "Output and resume",
    "Export",
)
"""The panels of ``fedexlora run --help``, in the order they are shown."""
SETTINGS, MODEL, DATA, METHOD, FEDERATION, TRAINING, EVALUATION, PRECISION, PRIVACY, OUTPUT, \
    EXPORT = PANELS  # fmt: skip


@dataclass(frozen=True)
class Option:
    """What one setting is to a user: its flag, its help, its panel and its own check.

    Declared once, beside the field (:func:`setting`); the ``run`` and ``compare``
    options are generated from it (:mod:`fedexlora.cli.options`), and
    :meth:`RunConfig.errors` asks :meth:`problem` of every field.

    Attributes:
        help: One sentence, without its default.
        panel: The ``--help`` panel (:data:`PANELS`).
        flags: The flags, the long one first; empty: ``--`` and the key, dashes for
            underscores.
        default_text: How the help states the default; ``None``: the field's default,
            written out (nothing when that is unset); ``""``: no default is stated.
        low, high: Bounds of a number (``None``: unbounded); ``low_open``,
            ``high_open``: whether the bound itself is excluded.
        choices: The values a string may take.
        fix: Appended to the problem, ``"; fix: ..."``.
    """

    help: str
    panel: str
    flags: tuple[str, ...] = ()
    default_text: str | None = None
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    fix: str | None = None

    def problem(self, key: str, value: Any) -> str | None:
        """What is wrong with ``value`` for the setting ``key`` (set, and of its type)."""
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            fix = f"; fix: {self.fix}" if self.fix else ""
            return f"`{key}` must be a finite number, got {value}{fix}"
        if self.choices is not None and value not in self.choices:
            return f"`{key}` must be one of {self.choices}, got {value!r}"
        lo_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        hi_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        if lo_ok and hi_ok:
            return None
        if self.high is None:
            bound = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            bound = (
                f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                f"{_number(self.high)}{')' if self.high_open else ']'}"
            )
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"`{key}` must be {bound}, got {value}{fix}"


def _number(x: float | None) -> str:
    """A bound as the help and the errors write it: ``0``, ``1``, ``1e-5``."""
    if isinstance(x, int) and abs(x) >= 10**6:  # an integer bound written whole (a seed's)
        return str(x)
    text = format(x, "g")
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), text)


def shown_default(value: Any) -> str:
    """A default as ``--help`` writes it: on/off, a comma list, a short number."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return _number(value)
    return str(value)


def setting(default: Any = None, *, factory: Callable[[], Any] | None = None, **option: Any):
    """A :class:`RunConfig` field and its :class:`Option` (``option``: its fields)."""
    meta = {"option": Option(**option)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    """Everything a federated run needs. Every field is also a TOML key and a CLI flag.

    Each field declares its flag, help, panel and own check once (:class:`Option`, in
    the field's metadata); ``fedexlora run --help`` is generated from them.
    """

    # Settings
    recipe: str | None = setting(
        help="A paper experiment (see `fedexlora recipes`): its settings, and the paper's "
        "figures beside this run's; other flags override it",
        panel=SETTINGS,
        default_text="",
    )
    # Model and LoRA
    model: str = setting(
        "minilm",
        help="minilm, smollm2-135m, a hub name such as org/name, or a local directory",
        panel=MODEL,
    )
    lora_r: int = setting(8, help="LoRA rank", panel=MODEL, flags=("--rank", "-r"), low=1)
    lora_alpha: float = setting(16.0, help="LoRA alpha", panel=MODEL, low=0, low_open=True)
    lora_dropout: float = setting(
        0.05, help="LoRA dropout", panel=MODEL, low=0, high=1, high_open=True
    )
    target_modules: list[str] | None = setting(
        help="Comma list of LoRA targets", panel=MODEL, default_text="per architecture"
    )
    rslora: bool = setting(False, help="Rank-stabilised scale", panel=MODEL)
    dora: bool = setting(
        False, help="DoRA (use_dora=True): exact with fedex on an fp32 model", panel=MODEL
    )
    # Data
    task: str = setting(
        "bbc-news",
        help="bbc-news, gsm8k, deepmind-math, sst2..., or a .csv/.jsonl file",
        panel=DATA,
    )
    data_dir: str | None = setting(
        help="Local copies of hub datasets, in the hub's file layout, DIR/nyu-mll/glue/sst2/...",
        panel=DATA,
        default_text="$FEDEXLORA_DATA_DIR",
    )
    client_data: str | None = setting(
        help="Each client's own training file, DIR/<i>.jsonl (.csv, .json), in place of a "
        "slice of --task, which still gives the test split and classes",
        panel=DATA,
        default_text="slices of --task",
    )
    max_length: int = setting(64, help="Max tokens per example", panel=DATA, low=8)
    test_fraction: float = setting(
        0.2, help="Held-out test fraction", panel=DATA, low=0, low_open=True, high=1,
        high_open=True,
    )  # fmt: skip
    max_train: int | None = setting(
        help="Use only this many training examples", panel=DATA, default_text="all", low=1
    )
    max_test: int | None = setting(
        help="Use only this many test examples", panel=DATA, default_text="all", low=1
    )
    # Method
    methods: list[str] = setting(
        factory=lambda: ["fedex"],
        help=f"Comma list of {', '.join(REGISTRY)}; `fedexlora methods` describes each",
        panel=METHOD,
        flags=("--method",),
    )
    residual_rank: int | None = setting(
        help="Truncate FedEx-LoRA's residuals to this rank, which is lossy",
        panel=METHOD,
        default_text="exact",
        low=1,
    )
    fedsb_rank: int = setting(
        64, help="Fed-SB's rank: its r x r core is what clients train and send", panel=METHOD,
        low=1,
    )  # fmt: skip
    fedsb_init: str = setting(
        "auto",
        help="Fed-SB's frozen A and B: gradient (the authors' SVD of a sign-gradient step) "
        "or random; auto is random with --dp-epsilon, else gradient",
        panel=METHOD,
        choices=("auto", "gradient", "random"),
    )
    fedsb_init_samples: int = setting(
        256, help="Examples Fed-SB's gradient init is estimated on", panel=METHOD, low=1
    )
    # Federation
    num_clients: int = setting(
        3, help="Clients", panel=FEDERATION, flags=("--num-clients", "--clients"), low=1
    )
    partition: str = setting(
        "dirichlet",
        help="iid, dirichlet or group (whole groups per client: deepmind-math's modules)",
        panel=FEDERATION,
        choices=("iid", "dirichlet", "group"),
    )
    alpha: float = setting(
        0.5, help="Dirichlet concentration", panel=FEDERATION, low=0, low_open=True
    )
    min_partition_size: int = setting(
        10, help="Minimum examples per client", panel=FEDERATION, low=1
    )
    rounds: int = setting(3, help="Federated rounds", panel=FEDERATION, low=1)
    stop_patience: int | None = setting(
        help="Stop a method after this many rounds without a new best of the task's primary "
        "metric (never past --rounds)",
        panel=FEDERATION,
        default_text="off",
        low=1,
    )
    stop_min_rounds: int | None = setting(
        help="--stop-patience stops no method before this round: a warm-up in which the "
        "metric may wander before a method learns",
        panel=FEDERATION,
        default_text="off",
        low=1,
    )
    stop_at: float | None = setting(
        help="Stop a method once its primary metric reaches this value (never past --rounds)",
        panel=FEDERATION,
        default_text="off",
    )
    stop_metric: str | None = setting(
        help="The metric --stop-patience and --stop-at read: one of the task's (accuracy, "
        "exact_match, loss...; lower is better for a loss or perplexity)",
        panel=FEDERATION,
        default_text="the task's primary metric",
    )
    fraction: float = setting(
        1.0,
        help="Fraction of clients per round, rounded half up, at least one",
        panel=FEDERATION,
        low=0,
        low_open=True,
        high=1,
    )
    weighting: str | None = setting(
        help="How client updates are weighted: examples or uniform",
        panel=FEDERATION,
        default_text="each method's own: uniform for fedsa, as its release; examples otherwise",
        choices=("examples", "uniform"),
    )
    client_ranks: list[int] | None = setting(
        help="Comma list: each client's LoRA rank; the global rank is the largest",
        panel=FEDERATION,
        default_text="every client at --rank",
    )
    max_update_norm: float | None = setting(
        help="Reject client updates above this norm",
        panel=FEDERATION,
        default_text="off",
        low=0,
        low_open=True,
    )
    secure_aggregation: bool = setting(
        False,
        help="Flower's SecAgg+: the server sees only sums of the uploads, and FedEx stays "
        "exact; see docs/PRIVACY.md",
        panel=FEDERATION,
    )
    engine: str = setting(
        "local",
        help="local (in process) or flower, a Flower simulation",
        panel=FEDERATION,
        choices=("local", "flower"),
    )
    # Training
    trainer: str = setting(
        "builtin",
        help="builtin, or trl: each client trains with TRL's SFTTrainer (causal-LM tasks; "
        "needs the trl extra)",
        panel=TRAINING,
        choices=("builtin", "trl"),
    )
    nproc_per_client: int = setting(
        1,
        help="Processes (one per device) each client trains on, as a worker group started "
        "by --launcher on its node; see docs/DEPLOY.md",
        panel=TRAINING,
        low=1,
    )
    distributed: str = setting(
        "ddp",
        help="How a client's processes share its training (--nproc-per-client > 1): ddp "
        "(each holds the model, gradients all-reduced) or fsdp (sharded)",
        panel=TRAINING,
        choices=("ddp", "fsdp"),
    )
    launcher: str = setting(
        "torchrun",
        help="What starts a client's processes (--nproc-per-client > 1): torchrun or "
        "accelerate (accelerate launch)",
        panel=TRAINING,
        choices=("torchrun", "accelerate"),
    )
    accelerate_config: str | None = setting(
        help="accelerate's config file (accelerate launch --config_file) for --launcher accelerate",
        panel=TRAINING,
    )
    local_epochs: float = setting(
        1.0, help="Local epochs per round", panel=TRAINING, low=0, low_open=True
    )
    local_steps: int | None = setting(
        help="Local steps per round; overrides --local-epochs", panel=TRAINING, low=1
    )
    batch_size: int = setting(16, help="Batch size", panel=TRAINING, low=1)
    lr: float = setting(1e-3, help="Learning rate", panel=TRAINING, low=0, low_open=True)
    weight_decay: float = setting(0.0, help="AdamW weight decay", panel=TRAINING, low=0)
    warmup_ratio: float = setting(
        0.0, help="Fraction of steps for warm-up", panel=TRAINING, low=0, high=1, high_open=True
    )
    max_grad_norm: float = setting(
        1.0, help="Gradient clipping norm", panel=TRAINING, low=0, low_open=True
    )
    seed: int = setting(
        0,
        help="Seed for the data split, initialisation, sampling and training (DP noise: "
        "see --dp-reproducible)",
        panel=TRAINING,
        low=0,
        high=2**32 - 1,  # numpy's and torch's seeds
    )
    # Evaluation
    eval_batch_size: int = setting(64, help="Evaluation batch size", panel=EVALUATION, low=1)
    max_new_tokens: int = setting(
        64, help="Tokens generated per answer, causal LM exact match", panel=EVALUATION, low=1
    )
    num_beams: int = setting(
        1, help="Beams when generating answers; 1 is greedy", panel=EVALUATION, low=1
    )
    # Device, precision and memory
    device: str = setting(
        "cpu", help="auto, cpu or cuda", panel=PRECISION, choices=("auto", "cpu", "cuda")
    )
    dtype: str = setting(
        "fp32",
        help="fp32, bf16 or fp16: base weights and autocast",
        panel=PRECISION,
        choices=_DTYPES,
    )
    quantization: str | None = setting(
        help="nf4, fp4 or int8: quantize the base with bitsandbytes",
        panel=PRECISION,
        default_text="none",
        choices=QUANTIZATIONS,
    )
    double_quant: bool = setting(False, help="Quantize the 4-bit block scales too", panel=PRECISION)
    side_rank: int | None = setting(
        help="Cap the fp32 side branch at this rank, lossy with error feedback",
        panel=PRECISION,
        default_text="exact",
        low=1,
        fix="--side-rank 64 (or leave it unset for the exact side branch)",
    )
    side_budget: float | None = setting(
        help="Hold each layer's side branch within this fraction of its base weight's bytes "
        "(memory beside the base): exact until it binds, then its best low-rank part, the "
        "rest kept on the server as error feedback; each row says what was applied",
        panel=PRECISION,
        default_text="none, exact",
        low=0,
        low_open=True,
        fix="--side-budget 0.5 (or leave it unset for the exact side branch)",
    )
    fp32_side_branch: bool | None = setting(
        help="Keep an fp32 base's residuals beside it, not rounded into W: exact at any "
        "learning rate, one more matmul per LoRA layer",
        panel=PRECISION,
        default_text="on for exact methods without DP; --no-fp32-side-branch folds them into W",
    )
    gradient_checkpointing: bool = setting(False, help="Trade compute for memory", panel=PRECISION)
    # Privacy
    dp_epsilon: float | None = setting(
        help="DP-SGD on every client: total epsilon per client over the run",
        panel=PRIVACY,
        default_text="off",
        low=0,
        low_open=True,
        fix="--dp-epsilon 8 (or leave it unset for no differential privacy)",
    )
    dp_delta: float = setting(
        1e-5,
        help="DP delta, below 1 / the smallest client's examples",
        panel=PRIVACY,
        low=0,
        low_open=True,
        high=1,
        high_open=True,
    )
    dp_max_grad_norm: float = setting(
        1.0, help="DP-SGD per-sample clipping norm", panel=PRIVACY, low=0, low_open=True
    )
    dp_reproducible: bool = setting(
        False,
        help="Draw DP-SGD's sampling and noise (and SecAgg+'s rounding) from the run's seed, "
        "for simulations that must repeat: not private against anyone who knows the seed "
        "(off: OS entropy on each client)",
        panel=PRIVACY,
    )
    # Output and resume
    keep_checkpoints: int = setting(2, help="Checkpoints kept per method", panel=OUTPUT, low=1)
    save_client_adapters: bool = setting(False, help="Write client adapters", panel=OUTPUT)
    report_to: list[str] | None = setting(
        help="Comma list of tensorboard, mlflow: log every round there",
        panel=OUTPUT,
        default_text="none",
    )
    # Export
    export: str | None = setting(help="Also export the final model here", panel=EXPORT)
    export_format: str | None = setting(
        help="adapter or merged",
        panel=EXPORT,
        default_text="adapter when the run keeps a side branch, as an exact method does "
        "unless told otherwise and every bf16/fp16/quantized base does; merged otherwise, "
        "as after --no-fp32-side-branch",
        choices=_EXPORT_FORMATS,
    )
    export_dtype: str = setting("fp32", help="Merged export dtype", panel=EXPORT, choices=_DTYPES)
    allow_inexact: bool = setting(False, help="Allow an export that rounds", panel=EXPORT)

    @property
    def dp(self) -> bool:
        """Whether clients train with DP-SGD (``dp_epsilon`` set and finite)."""
        return self.dp_epsilon is not None and math.isfinite(self.dp_epsilon)

    @property
    def fedsb_init_resolved(self) -> str:
        """Fed-SB's initialisation: ``auto`` is ``random`` with DP, else ``gradient``."""
        if self.fedsb_init != "auto":
            return self.fedsb_init
        return "random" if self.dp else "gradient"

    @property
    def fp32_side_branch_resolved(self) -> bool:
        """Whether an fp32 base keeps its residuals beside the weights.

        ``fp32_side_branch`` when set; unset (``None``), on for an fp32 base whose run has
        an exact method and no DP-SGD (whose checks are made for layers without a side
        branch): folding into fp32 weights is exact only to their rounding, and the side
        branch costs the main job nothing measurable (docs/LARGE_MODELS.md).
        """
        if self.fp32_side_branch is not None:
            return self.fp32_side_branch
        if self.low_precision or self.dp:
            return False
        return bool(self.methods_where(lambda s: s.exact))

    def resolved(self, ran: RunConfig | None = None) -> RunConfig:
        """A copy with every default that depends on other fields written out.

        A run writes this to ``config.toml``, so that the run reads back as it ran.

        Args:
            ran: The config a resumed run ran with: an unset default takes its value.
        """
        if self.fp32_side_branch is None and ran is not None:
            return self.replace(fp32_side_branch=ran.fp32_side_branch_resolved)
        return self.replace(fp32_side_branch=self.fp32_side_branch_resolved)

    @property
    def side_branch(self) -> bool:
        """Whether residuals live in an fp32 side branch (fp32 ones: ``fp32_side_branch``)."""
        return self.low_precision or self.fp32_side_branch_resolved

    @property
    def low_precision(self) -> bool:
        """Whether the base is bf16/fp16 or quantized."""
        return self.dtype != "fp32" or self.quantization is not None

    @property
    def approximate(self) -> bool:
        """Whether a lossy mode is on (``residual_rank``, ``side_rank`` or ``side_budget``)."""
        return (
            self.residual_rank is not None
            or self.side_rank is not None
            or self.side_budget is not None
        )

    @property
    def resolved_export_format(self) -> str:
        """``export_format``, or its default: ``merged``, or ``adapter`` with a side branch."""
        # a side branch (fp32 ones too) would be rounded into a merged fp32 model
        return self.export_format or ("adapter" if self.side_branch else "merged")

    def methods_where(
        self, test: Callable[[MethodSpec], bool], *, unknown: bool = False, unique: bool = True
    ) -> list[str]:
        """The names in ``methods`` whose registered spec passes ``test``, in order.

        Args:
            test: Asked of each known method's spec.
            unknown: Whether names the registry does not know are included too.
            unique: Whether a name given twice is listed once.
        """
        out = []
        for m in self.methods:
            spec = REGISTRY.get(m)
            if (unknown if spec is None else test(spec)) and not (unique and m in out):
                out.append(m)
        return out

    def errors(self) -> list[str]:
        """Every problem with the values, as one message each (empty when valid)."""
        errs: list[str] = []
        for f in fields(self):
            errs.extend(_type_errors(f, getattr(self, f.name)))
        if errs:
            return errs

        for f in fields(self):  # each setting's own check (its Option)
            problem = f.metadata["option"].problem(f.name, getattr(self, f.name))
            if problem:
                errs.append(problem)
        return errs + cross_field_errors(self)

    def validate(self) -> RunConfig:
        """Returns ``self`` or raises :class:`ConfigError` listing every problem."""
        errs = self.errors()
        if errs:
            raise ConfigError(errs)
        return self

    def to_dict(self) -> dict[str, Any]:
        """A TOML-ready dict; ``None`` values are left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_toml(self) -> str:
        """The resolved configuration as TOML (a seeded DP run says so in a comment too)."""
        text = tomli_w.dumps(self.to_dict())
        if self.dp and self.dp_reproducible:
            text = (
                "# dp_reproducible = true: DP-SGD's sampling and noise are drawn from `seed`;\n"
                "# this run is NOT private against anyone who knows the seed (simulation only)\n"
                + text
            )
        return text

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _type_errors(f: dataclasses.Field, value: Any) -> list[str]:
    t = str(f.type)
    optional = "None" in t
    if value is None:
        return [] if optional else [f"`{f.name}` must not be empty"]
    if t.startswith("list[int]"):
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
        return [] if ok else [f"`{f.name}` must be a list of integers, got {value!r}"]
    if t.startswith("list"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return [f"`{f.name}` must be a list of strings, got {value!r}"]
        return []
    if t.startswith("bool"):
        return (
            [] if isinstance(value, bool) else [f"`{f.name}` must be true or false, got {value!r}"]
        )
    if t.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"`{f.name}` must be an integer, got {value!r}"]
    if t.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"`{f.name}` must be a number, got {value!r}"]
    if t.startswith("str"):
        return [] if isinstance(value, str) else [f"`{f.name}` must be a string, got {value!r}"]
    return []


_KEYS = [f.name for f in fields(RunConfig)]
FLAGS: dict[str, str] = {
    f.name: (f.metadata["option"].flags or ("--" + f.name.replace("_", "-"),))[0]
    for f in fields(RunConfig)
}
"""Each key's long flag on the command line: ``lora_r`` -> ``--rank``."""
_FLAG_NAMES = {
    flag.lstrip("-").replace("-", "_"): f.name
    for f in fields(RunConfig)
    for flag in f.metadata["option"].flags
    if flag.lstrip("-").replace("-", "_") not in (f.name, "method")
}
"""Flags whose TOML key is another name (``rank``, ``r``, ``clients``), from each
field's :class:`Option`; ``method`` is accepted as the key ``methods``."""


def setting_name(name: str) -> str:
    """The setting a mapping's key names: dashes read as underscores, ``method`` as ``methods``."""
    norm = name.replace("-", "_")
    return "methods" if norm == "method" else norm


def _same_key_twice(data: dict[str, Any]) -> list[str]:
    """One message per setting that ``data`` gives under two spellings (``method``, ``methods``)."""
    spellings: dict[str, list[str]] = {}
    for key in data:
        spellings.setdefault(setting_name(key), []).append(key)
    return [
        f"`{keys[0]}` and `{keys[1]}` are the same setting, given twice; keep one"
        for keys in spellings.values()
        if len(keys) > 1
    ]


def validate_mapping(data: dict[str, Any]) -> tuple[RunConfig | None, list[str]]:
    """Builds a config from a mapping, collecting every error (unknown keys included)."""
    errs = _same_key_twice(data)
    known = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm == "method":  # singular accepted, as on the command line
            norm = "methods"
            value = [m.strip() for m in value.split(",")] if isinstance(value, str) else value
        if norm in _FLAG_NAMES:  # a flag's name, not the key: "did you mean" would guess
            flag = ("-" if len(norm) == 1 else "--") + norm
            errs.append(
                f"unknown key `{key}`; did you mean `{_FLAG_NAMES[norm]}`? "
                f"(`{flag}` is the command-line flag)"
            )
            continue
        if norm not in _KEYS:
            close = difflib.get_close_matches(norm, _KEYS, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            errs.append(f"unknown key `{key}`{hint}")
            continue
        if norm == "methods" and isinstance(value, str):
            value = [m.strip() for m in value.split(",")]
        known[norm] = value
    ranks = known.get("client_ranks")
    if "lora_r" not in known and isinstance(ranks, list) and ranks:
        if all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            known["lora_r"] = max(ranks)  # the global rank: the largest client's
    try:
        cfg = RunConfig(**known)
    except TypeError as exc:  # pragma: no cover - all keys are checked above
        return None, errs + [str(exc)]
    errs.extend(cfg.errors())
    return (cfg if not errs else None), errs


ADDED_LATER: dict[str, Any] = {
    "double_quant": False,
    "secure_aggregation": False,
    "trainer": "builtin",
    "fp32_side_branch": False,
    "dp_reproducible": False,
    "nproc_per_client": 1,
    "distributed": "ddp",
}
"""Settings added after runs existed, with the value those runs had: a run's
``config.toml`` without one reads it back so (:func:`load_run_config`), and the resume
fingerprint leaves it out at that value, so that a run from before still resumes and
exports."""


def resumed_config(path: str | Path, changes: dict[str, Any]) -> RunConfig:
    """The run whose ``config.toml`` is ``path``, as a resume with ``changes`` runs it.

    A resume may change only the settings that leave results alone (:data:`RESUME_SAFE`);
    any other change, a value different from the stored one, is refused, naming its flag.

    Raises:
        ConfigError: A change that would alter the run's results, or as :func:`load_config`.
    """
    stored = load_run_config(path)
    errs = []
    for key, value in changes.items():
        if key in RESUME_SAFE:
            continue
        try:
            # getattr, not to_dict(): a setting left unset (None) is not in the dict
            same = getattr(stored.replace(**{key: value}), key) == getattr(stored, key)
        except (TypeError, ValueError):
            same = False
        if not same:
            safe = ", ".join(FLAGS[k] for k in RESUME_SAFE)
            errs.append(
                f"{FLAGS.get(key, key)} {value!r} would change the results of the run being "
                f"resumed (it was started with {getattr(stored, key)!r}); start a new run with "
                f"--out instead. A resume may change only {safe} and --no-progress"
            )
    if errs:
        raise ConfigError(errs)
    return load_run_config(path, {k: v for k, v in changes.items() if k in RESUME_SAFE})


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """A run directory's ``config.toml``, as that run ran (see :data:`ADDED_LATER`).

    Raises:
        ConfigError: As :func:`load_config`.
    """
    try:
        stored = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        stored = {}  # load_config names the problem
    then = {k: v for k, v in ADDED_LATER.items() if k not in stored}
    return load_config(path, {**then, **(overrides or {})})


def read_config(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TOML file's settings with ``overrides`` on top, as keys, not yet validated.

    Raises:
        ConfigError: If the file is missing, a directory, or not valid TOML.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError([f"config file {str(p)!r} is a directory; give a TOML file"])
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config file {str(p)!r} is not valid TOML: {exc}"]) from None
    for key in overrides or {}:  # a flag replaces the file's setting, whichever its spelling
        for spelled in [k for k in data if setting_name(k) == setting_name(key)]:
            del data[spelled]
    data.update(overrides or {})
    return data


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Loads a TOML file, applies ``overrides`` and validates the result.

    A ``recipe`` it names is a label here; :func:`fedexlora.run.recipes.load_config_file`
    (what ``fedexlora run --config`` and ``validate`` read) applies it.

    Raises:
        ConfigError: Listing every error, including a missing or malformed file.
    """
    cfg, errs = validate_mapping(read_config(path, overrides))
    if errs:
        raise ConfigError(errs)
    assert cfg is not None
    return cfg
