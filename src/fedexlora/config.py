"""Run configuration: one dataclass, TOML in and out, validation that lists every error."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
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

from fedexlora.core.methods import REGISTRY, MethodSpec, method_names
from fedexlora.core.sampling import sample_size

__all__ = [
    "ConfigError",
    "RunConfig",
    "load_config",
    "model_name_error",
    "validate_mapping",
]

_PARTITIONS = ("iid", "dirichlet")
_WEIGHTINGS = ("examples", "uniform")
_ENGINES = ("local", "flower")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("fp32", "bf16", "fp16")
_QUANTIZATIONS = ("nf4", "fp4", "int8")
_EXPORT_FORMATS = ("adapter", "merged")
_TRAINERS = ("builtin", "trl")
RESUME_SAFE = (
    "rounds",
    "data_dir",
    "export",
    "export_format",
    "export_dtype",
    "allow_inexact",
    "device",
    "keep_checkpoints",
    "save_client_adapters",
    "report_to",
)
"""Settings that never change a run's results: how far it goes and what it writes.

A resume may change them, the checkpoint fingerprint leaves them out, and ``compare``
reuses a cell that differs only in them.
"""
_REPORTERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # name -> module it needs
_MODEL_ALIASES = ("minilm", "smollm2-135m")  # fedexlora.bridge.models.ALIASES (which loads torch)
# huggingface_hub's rule for a repo id ("name" or "org/name"), checked here without the network
_HUB_NAME = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")


def model_name_error(name: str) -> str | None:
    """Why ``name`` cannot be a model, or ``None`` when it may be one.

    An alias, an existing directory (``~`` expanded) and anything shaped like a hub name
    pass; the hub itself is not asked. Anything else is a local path that is not there,
    which loading would only report as a malformed hub name.

    Args:
        name: The ``model`` setting.

    Returns:
        The problem, starting with the quoted name, or ``None``.
    """
    if name in _MODEL_ALIASES:
        return None
    path = Path(name).expanduser()
    if name.strip() and path.is_dir():
        return None
    if _HUB_NAME.match(name) and "--" not in name and ".." not in name:
        return None
    what = "not a directory" if name.strip() and path.exists() else "no such local directory"
    return (
        f"{name!r}: {what} (give minilm, smollm2-135m, a hub name such as org/name, "
        "or an existing directory)"
    )


class ConfigError(ValueError):
    """A configuration with one or more errors; ``errors`` lists them all."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in errors))


@dataclass
class RunConfig:
    """Everything a federated run needs. Every field is also a TOML key and a CLI flag.

    Attributes mirror ``fedexlora run --help``.
    """

    model: str = "minilm"
    task: str = "bbc-news"
    methods: list[str] = field(default_factory=lambda: ["fedex"])
    num_clients: int = 3
    partition: str = "dirichlet"
    alpha: float = 0.5
    min_partition_size: int = 10
    rounds: int = 3
    local_epochs: float = 1.0
    local_steps: int | None = None
    trainer: str = "builtin"
    batch_size: int = 16
    eval_batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 64
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    target_modules: list[str] | None = None
    rslora: bool = False
    client_ranks: list[int] | None = None
    fraction: float = 1.0
    weighting: str | None = None
    seed: int = 0
    test_fraction: float = 0.2
    max_train: int | None = None
    max_test: int | None = None
    max_new_tokens: int = 64
    num_beams: int = 1
    residual_rank: int | None = None
    max_update_norm: float | None = None
    engine: str = "local"
    device: str = "cpu"
    dtype: str = "fp32"
    quantization: str | None = None
    double_quant: bool = False
    side_rank: int | None = None
    fp32_side_branch: bool | None = None
    gradient_checkpointing: bool = False
    save_client_adapters: bool = False
    secure_aggregation: bool = False
    keep_checkpoints: int = 2
    export: str | None = None
    export_format: str | None = None
    export_dtype: str = "fp32"
    allow_inexact: bool = False
    report_to: list[str] | None = None
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_max_grad_norm: float = 1.0
    fedsb_rank: int = 64
    fedsb_init: str = "auto"
    fedsb_init_samples: int = 256
    data_dir: str | None = None
    recipe: str | None = None

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
        return bool(self._methods_where(lambda s: s.exact))

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
        """Whether a lossy mode is on (``residual_rank`` or ``side_rank``)."""
        return self.residual_rank is not None or self.side_rank is not None

    @property
    def resolved_export_format(self) -> str:
        """``export_format``, or its default: ``merged``, or ``adapter`` with a side branch."""
        # a side branch (fp32 ones too) would be rounded into a merged fp32 model
        return self.export_format or ("adapter" if self.side_branch else "merged")

    def _methods_where(
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

    def _secure_errors(self, errs: list[str]) -> None:
        """What ``secure_aggregation`` cannot be combined with, appended to ``errs``."""
        from fedexlora.core.secure import secure_refusal

        for m in self.methods:
            why = secure_refusal(REGISTRY[m]) if m in REGISTRY else None
            if why:
                errs.append(f"`secure_aggregation`: {why}")
        if sample_size(self.num_clients, self.fraction) < 2:
            errs.append(
                "`secure_aggregation` needs at least 2 clients per round (one client's sum "
                f"is its own upload); got {self.num_clients} clients at fraction {self.fraction}"
            )
        for key, why in (
            ("client_ranks", "heterogeneous ranks need each client's own factors"),
            ("max_update_norm", "the server cannot check an upload it cannot see"),
            ("residual_rank", "the residual is formed dense from sums; it is kept exact"),
            ("side_rank", "the residual is formed dense from sums; it is kept exact"),
        ):
            if getattr(self, key) is not None:
                errs.append(f"`secure_aggregation` cannot be combined with `{key}`: {why}")
        if importlib.util.find_spec("flwr") is None:
            errs.append(
                "`secure_aggregation` uses Flower's SecAgg+, and flwr is not installed; fix: "
                "pip install 'fedex-lora[flower]'"
            )

    def errors(self) -> list[str]:
        """Every problem with the values, as one message each (empty when valid)."""
        errs: list[str] = []
        for f in fields(self):
            errs.extend(_type_errors(f, getattr(self, f.name)))
        if errs:
            return errs

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errs.append(msg)

        model_error = model_name_error(self.model)
        need(model_error is None, f"`model` {model_error}")
        unknown = [m for m in self.methods if m not in REGISTRY]
        need(not unknown, f"`methods`: unknown {unknown}; choose from {list(REGISTRY)}")
        need(len(self.methods) > 0, "`methods` must name at least one method")
        need(self.num_clients >= 1, f"`num_clients` must be >= 1, got {self.num_clients}")
        need(
            self.partition in _PARTITIONS,
            f"`partition` must be one of {_PARTITIONS}, got {self.partition!r}",
        )
        need(self.alpha > 0, f"`alpha` must be > 0, got {self.alpha}")
        need(
            self.min_partition_size >= 1,
            f"`min_partition_size` must be >= 1, got {self.min_partition_size}",
        )
        need(self.rounds >= 1, f"`rounds` must be >= 1, got {self.rounds}")
        need(self.local_epochs > 0, f"`local_epochs` must be > 0, got {self.local_epochs}")
        need(
            self.local_steps is None or self.local_steps >= 1,
            f"`local_steps` must be >= 1, got {self.local_steps}",
        )
        need(self.batch_size >= 1, f"`batch_size` must be >= 1, got {self.batch_size}")
        need(
            self.eval_batch_size >= 1, f"`eval_batch_size` must be >= 1, got {self.eval_batch_size}"
        )
        need(self.num_beams >= 1, f"`num_beams` must be >= 1, got {self.num_beams}")
        need(self.max_new_tokens >= 1, f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        need(self.lr > 0, f"`lr` must be > 0, got {self.lr}")
        need(self.weight_decay >= 0, f"`weight_decay` must be >= 0, got {self.weight_decay}")
        need(
            0 <= self.warmup_ratio < 1, f"`warmup_ratio` must be in [0, 1), got {self.warmup_ratio}"
        )
        need(self.max_grad_norm > 0, f"`max_grad_norm` must be > 0, got {self.max_grad_norm}")
        need(self.max_length >= 8, f"`max_length` must be >= 8, got {self.max_length}")
        need(self.lora_r >= 1, f"`lora_r` must be >= 1, got {self.lora_r}")
        need(self.lora_alpha > 0, f"`lora_alpha` must be > 0, got {self.lora_alpha}")
        need(
            0 <= self.lora_dropout < 1, f"`lora_dropout` must be in [0, 1), got {self.lora_dropout}"
        )
        need(0 < self.fraction <= 1, f"`fraction` must be in (0, 1], got {self.fraction}")
        need(
            self.weighting is None or self.weighting in _WEIGHTINGS,
            f"`weighting` must be one of {_WEIGHTINGS}, got {self.weighting!r}",
        )
        need(
            0 < self.test_fraction < 1,
            f"`test_fraction` must be in (0, 1), got {self.test_fraction}",
        )
        need(
            self.max_train is None or self.max_train >= 1,
            f"`max_train` must be >= 1, got {self.max_train}",
        )
        need(
            self.max_test is None or self.max_test >= 1,
            f"`max_test` must be >= 1, got {self.max_test}",
        )
        need(
            self.residual_rank is None or self.residual_rank >= 1,
            f"`residual_rank` must be >= 1, got {self.residual_rank}",
        )
        need(
            self.max_update_norm is None or self.max_update_norm > 0,
            f"`max_update_norm` must be > 0, got {self.max_update_norm}",
        )
        need(self.engine in _ENGINES, f"`engine` must be one of {_ENGINES}, got {self.engine!r}")
        need(
            self.trainer in _TRAINERS,
            f"`trainer` must be one of {_TRAINERS}, got {self.trainer!r}",
        )
        if self.trainer == "trl":
            need(
                importlib.util.find_spec("trl") is not None,
                "`trainer` 'trl' needs TRL, which is not installed; fix: pip install "
                "'fedex-lora[trl]'",
            )
            need(not self.dp, "`trainer` 'trl' cannot train with DP-SGD; fix: drop --dp-epsilon "
                 "(DP-SGD runs on the builtin trainer)")  # fmt: skip
            need(
                not (self.dtype == "fp16" and self.device == "cpu"),
                "`trainer` 'trl' cannot train in fp16 on a CPU (transformers' Trainer mixes "
                "fp16 on a GPU only); fix: --dtype bf16 or fp32, or --device cuda",
            )
        need(self.device in _DEVICES, f"`device` must be one of {_DEVICES}, got {self.device!r}")
        need(self.dtype in _DTYPES, f"`dtype` must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None:
            need(
                self.quantization in _QUANTIZATIONS,
                f"`quantization` must be one of {_QUANTIZATIONS}, got {self.quantization!r}",
            )
            need(
                self.quantization not in _QUANTIZATIONS
                or importlib.util.find_spec("bitsandbytes") is not None,
                f"`quantization` {self.quantization!r} needs bitsandbytes, which is not "
                "installed; fix: pip install 'fedex-lora[quantization]'",
            )
        for name in self.report_to or []:
            if name not in _REPORTERS:
                errs.append(f"`report_to`: unknown {name!r}; choose from {', '.join(_REPORTERS)}")
            elif importlib.util.find_spec(_REPORTERS[name]) is None:
                errs.append(
                    f"`report_to` {name!r} needs {_REPORTERS[name]}, which is not installed; "
                    f"fix: pip install 'fedex-lora[{name}]'"
                )
        need(
            not self.double_quant or self.quantization in ("nf4", "fp4"),
            "`double_quant` applies to 4-bit quantization only; add --quantization nf4 "
            "(or fp4), or drop --double-quant",
        )
        need(
            self.side_rank is None or self.side_rank >= 1,
            f"`side_rank` must be >= 1, got {self.side_rank}; fix: --side-rank 64 (or "
            "leave it unset for the exact side branch)",
        )
        need(
            self.side_rank is None or self.side_branch,
            "`side_rank` caps the side branch, which only bf16/fp16 and quantized bases "
            "have (or fp32 ones with --fp32-side-branch, the default with an exact method); "
            "fix: add --dtype bf16, "
            "--quantization nf4 or --fp32-side-branch, or drop --side-rank",
        )
        need(
            self.export_format is None or self.export_format in _EXPORT_FORMATS,
            f"`export_format` must be one of {_EXPORT_FORMATS}, got {self.export_format!r}",
        )
        need(
            self.export_dtype in _DTYPES,
            f"`export_dtype` must be one of {_DTYPES}, got {self.export_dtype!r}",
        )
        need(
            self.export_dtype == "fp32"
            or self.resolved_export_format != "merged"
            or self.allow_inexact,
            f"`export_dtype` {self.export_dtype!r}: a merged model in {self.export_dtype} "
            "rounds the federated update away, so it cannot be exact; fix: keep "
            "--export-dtype fp32, use --export-format adapter, or confirm with "
            "--allow-inexact",
        )
        need(
            self.dp_epsilon is None or self.dp_epsilon > 0,
            f"`dp_epsilon` must be > 0, got {self.dp_epsilon}; fix: --dp-epsilon 8 (or "
            "leave it unset for no differential privacy)",
        )
        need(0 < self.dp_delta < 1, f"`dp_delta` must be in (0, 1), got {self.dp_delta}")
        need(
            self.dp_max_grad_norm > 0,
            f"`dp_max_grad_norm` must be > 0, got {self.dp_max_grad_norm}",
        )
        need(self.fedsb_rank >= 1, f"`fedsb_rank` must be >= 1, got {self.fedsb_rank}")
        need(
            self.fedsb_init in ("auto", "gradient", "random"),
            f"`fedsb_init` must be auto, gradient or random, got {self.fedsb_init!r}",
        )
        need(
            self.fedsb_init_samples >= 1,
            f"`fedsb_init_samples` must be >= 1, got {self.fedsb_init_samples}",
        )
        if self.dp:
            cannot = []  # what the methods cannot run with, each method says (`check`)
            if self.gradient_checkpointing:
                cannot.append("--gradient-checkpointing (per-sample gradients need the hooks)")
            if self.low_precision:
                cannot.append(
                    "a bf16/fp16 or quantized base (per-sample gradients are checked in fp32 only)"
                )
            elif self.fp32_side_branch:
                cannot.append(
                    "--fp32-side-branch (the DP-SGD checks are made for layers without one)"
                )
            if cannot:
                errs.append("`dp_epsilon`: DP-SGD cannot be combined with " + "; ".join(cannot))
            need(
                importlib.util.find_spec("opacus") is not None,
                "`dp_epsilon` needs opacus, which is not installed; fix: pip install "
                "'fedex-lora[privacy]'",
            )
        need(
            self.keep_checkpoints >= 1,
            f"`keep_checkpoints` must be >= 1, got {self.keep_checkpoints}",
        )
        if self.secure_aggregation:
            self._secure_errors(errs)
        if self.client_ranks is not None:
            need(
                len(self.client_ranks) == self.num_clients,
                f"`client_ranks` needs one rank per client ({self.num_clients}), got "
                f"{len(self.client_ranks)}",
            )
            need(
                all(r >= 1 for r in self.client_ranks),
                f"`client_ranks` must all be >= 1, got {self.client_ranks}",
            )
            need(
                max(self.client_ranks, default=0) == self.lora_r,
                f"`lora_r` is the global adapter's rank and must equal max(client_ranks) = "
                f"{max(self.client_ranks, default=0)}, got {self.lora_r}",
            )
            # a method without clients trains one adapter at lora_r: client_ranks is moot
            other = self._methods_where(
                lambda s: s.federated and not s.hetero_ranks, unknown=True, unique=False
            )
            need(
                not other,
                f"`client_ranks` works with {' and '.join(method_names(hetero_ranks=True))} "
                f"(exact); it cannot be combined with methods {other}",
            )
        if self.engine == "flower" and self.save_client_adapters:
            for m in self._methods_where(lambda s: s.personalized):
                kept = " and ".join(REGISTRY[m].keeps)
                errs.append(
                    "`save_client_adapters` under the Flower engine saves each adapter from "
                    f"what the server receives, and the clients of method {m!r} keep {kept} "
                    "for themselves; fix: --engine local (each client's adapter is saved as it "
                    "trains), or drop --save-client-adapters"
                )
        if self.engine == "flower":
            for m in self._methods_where(lambda s: not s.flower):
                errs.append(
                    f"method {m!r} has no clients to federate and runs in-process only; "
                    "use --engine local for it (or drop it from the methods of a Flower run)"
                )
        need(
            self.residual_rank is None or self.side_rank is None,
            "`residual_rank` and `side_rank` are two lossy modes; choose one",
        )
        if self.residual_rank is not None:
            lossless = self._methods_where(
                lambda s: not s.residual_rank, unknown=True, unique=False
            )
            need(
                not lossless,
                f"`residual_rank` applies to {' and '.join(method_names(residual_rank=True))} "
                f"only; it cannot be combined with methods {lossless}",
            )
        for m in self._methods_where(lambda s: s.check is not None):
            errs.extend(REGISTRY[m].check(self))  # each method's own (MethodSpec.check)
        if self.num_clients >= 1 and self.max_train is not None:
            need(
                self.max_train >= self.num_clients * self.min_partition_size,
                f"`max_train` {self.max_train} is too small for {self.num_clients} clients "
                f"of at least `min_partition_size` {self.min_partition_size} examples",
            )
        return errs

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
        """The resolved configuration as TOML."""
        return tomli_w.dumps(self.to_dict())

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
_FLAG_NAMES = {"rank": "lora_r", "r": "lora_r", "clients": "num_clients"}
"""``fedexlora run`` flags (``--rank``, ``-r``, ``--clients``) whose TOML key is another name."""


def validate_mapping(data: dict[str, Any]) -> tuple[RunConfig | None, list[str]]:
    """Builds a config from a mapping, collecting every error (unknown keys included)."""
    errs = []
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
}
"""Settings added after runs existed, with the value those runs had: a run's
``config.toml`` without one reads it back so (:func:`load_run_config`), and the resume
fingerprint leaves it out at that value, so that a run from before still resumes and
exports."""


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


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Loads a TOML file, applies ``overrides`` and validates the result.

    Raises:
        ConfigError: Listing every error, including a missing or malformed file.
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
    data.update(overrides or {})
    cfg, errs = validate_mapping(data)
    if errs:
        raise ConfigError(errs)
    assert cfg is not None
    return cfg
