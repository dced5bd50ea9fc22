"""The run configuration's cross-field checks.

What cannot be combined, and what needs a package that is not installed.

:class:`fedexlora.config.RunConfig` checks each setting on its own (its type and its
:class:`~fedexlora.config.Option`); :func:`cross_field_errors` checks the rest, one message
per problem, each naming the settings and the fix.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from fedexlora.core.methods import REGISTRY, method_names
from fedexlora.core.sampling import sample_size

__all__ = ["QUANTIZATIONS", "REPORTERS", "cross_field_errors", "model_name_error"]

QUANTIZATIONS = ("nf4", "fp4", "int8")
REPORTERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # name -> module it needs
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


def cross_field_errors(cfg) -> list[str]:
    """Every problem that involves several settings or the installed packages.

    One message each: what :meth:`fedexlora.config.RunConfig.errors` adds to each setting's
    own checks. ``cfg`` is a ``RunConfig`` (not imported here: it imports this module).
    """
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    model_error = model_name_error(cfg.model)
    need(model_error is None, f"`model` {model_error}")
    unknown = [m for m in cfg.methods if m not in REGISTRY]
    need(not unknown, f"`methods`: unknown {unknown}; choose from {list(REGISTRY)}")
    need(len(cfg.methods) > 0, "`methods` must name at least one method")
    need(
        cfg.data_dir is None or Path(cfg.data_dir).expanduser().is_dir(),
        f"`data_dir` {cfg.data_dir!r} is not a directory (without one, the data would come "
        "from the hub); fix: the directory that holds the hub's file layout",
    )
    need(
        cfg.client_data is None or Path(cfg.client_data).expanduser().is_dir(),
        f"`client_data` {cfg.client_data!r} is not a directory; fix: a directory holding "
        "one file per client, 0.jsonl, 1.jsonl, ... (or .csv, .json)",
    )
    twice = sorted({m for m in cfg.methods if cfg.methods.count(m) > 1})
    need(not twice, f"`methods` names {twice} more than once; name each method once")
    if cfg.trainer == "trl":
        need(
            importlib.util.find_spec("trl") is not None,
            "`trainer` 'trl' needs TRL, which is not installed; fix: pip install 'fedex-lora[trl]'",
        )
        need(not cfg.dp, "`trainer` 'trl' cannot train with DP-SGD; fix: drop --dp-epsilon "
             "(DP-SGD runs on the builtin trainer)")  # fmt: skip
        need(
            not (cfg.dtype == "fp16" and cfg.device == "cpu"),
            "`trainer` 'trl' cannot train in fp16 on a CPU (transformers' Trainer mixes "
            "fp16 on a GPU only); fix: --dtype bf16 or fp32, or --device cuda",
        )
    need(
        cfg.quantization not in QUANTIZATIONS
        or importlib.util.find_spec("bitsandbytes") is not None,
        f"`quantization` {cfg.quantization!r} needs bitsandbytes, which is not "
        "installed; fix: pip install 'fedex-lora[quantization]'",
    )
    if cfg.dora:
        _dora_errors(cfg, errs)
    for name in cfg.report_to or []:
        if name not in REPORTERS:
            errs.append(f"`report_to`: unknown {name!r}; choose from {', '.join(REPORTERS)}")
        elif importlib.util.find_spec(REPORTERS[name]) is None:
            errs.append(
                f"`report_to` {name!r} needs {REPORTERS[name]}, which is not installed; "
                f"fix: pip install 'fedex-lora[{name}]'"
            )
    need(
        cfg.stop_min_rounds is None or cfg.stop_patience is not None,
        "`stop_min_rounds` delays --stop-patience, which is off; add --stop-patience N, or "
        "drop --stop-min-rounds",
    )
    need(
        not cfg.double_quant or cfg.quantization in ("nf4", "fp4"),
        "`double_quant` applies to 4-bit quantization only; add --quantization nf4 "
        "(or fp4), or drop --double-quant",
    )
    plain = cfg.methods_where(lambda s: s.keeps_residual, unknown=True)
    if not plain:  # FedIT-like methods only: no residual, nothing beside the base
        for key in ("side_rank", "side_budget", "fp32_side_branch"):
            if getattr(cfg, key) not in (None, False):
                errs.append(
                    f"`{key}` bounds or holds the residuals kept beside the base, and "
                    f"methods {cfg.methods} keep none (their update is the averaged "
                    f"factors' product, with no residual and no error feedback); fix: "
                    f"drop --{key.replace('_', '-')}, or add an exact method such as fedex"
                )
    need(
        not plain or cfg.side_rank is None or cfg.side_branch,
        "`side_rank` caps the side branch, which only bf16/fp16 and quantized bases "
        "have (or fp32 ones with --fp32-side-branch, the default with an exact method); "
        "fix: add --dtype bf16, "
        "--quantization nf4 or --fp32-side-branch, or drop --side-rank",
    )
    need(
        not plain or cfg.side_budget is None or cfg.side_branch,
        "`side_budget` bounds the side branch, which only bf16/fp16 and quantized bases "
        "have (or fp32 ones with --fp32-side-branch, the default with an exact method); "
        "fix: add --dtype bf16, --quantization nf4 or --fp32-side-branch, or drop "
        "--side-budget",
    )
    need(
        cfg.export_dtype == "fp32" or cfg.resolved_export_format != "merged" or cfg.allow_inexact,
        f"`export_dtype` {cfg.export_dtype!r}: a merged model in {cfg.export_dtype} "
        "rounds the federated update away, so it cannot be exact; fix: keep "
        "--export-dtype fp32 (or drop it for --export-format adapter), or confirm with "
        "--allow-inexact",
    )
    need(
        cfg.export_dtype == "fp32" or cfg.resolved_export_format != "adapter",
        f"`export_dtype` {cfg.export_dtype!r} applies to a merged model, and this run "
        "exports an adapter (which keeps the run's dtypes, exact on the unchanged base); "
        "fix: drop --export-dtype, or --export-format merged",
    )
    need(
        cfg.dp or not cfg.dp_reproducible,
        "`dp_reproducible` applies only with `dp_epsilon` (it seeds DP-SGD's noise); "
        "fix: drop --dp-reproducible, or set --dp-epsilon",
    )
    if cfg.dp:
        cannot = []  # what the methods cannot run with, each method says (`check`)
        if cfg.gradient_checkpointing:
            cannot.append("--gradient-checkpointing (per-sample gradients need the hooks)")
        if cfg.low_precision:
            cannot.append(
                "a bf16/fp16 or quantized base (per-sample gradients are checked in fp32 only)"
            )
        elif cfg.fp32_side_branch:
            cannot.append("--fp32-side-branch (the DP-SGD checks are made for layers without one)")
        if cannot:
            errs.append("`dp_epsilon`: DP-SGD cannot be combined with " + "; ".join(cannot))
        need(
            importlib.util.find_spec("opacus") is not None,
            "`dp_epsilon` needs opacus, which is not installed; fix: pip install "
            "'fedex-lora[privacy]'",
        )
    if cfg.secure_aggregation:
        _secure_errors(cfg, errs)
    _worker_errors(cfg, errs)
    if cfg.client_ranks is not None:
        need(
            len(cfg.client_ranks) == cfg.num_clients,
            f"`client_ranks` needs one rank per client ({cfg.num_clients}), got "
            f"{len(cfg.client_ranks)}",
        )
        need(
            all(r >= 1 for r in cfg.client_ranks),
            f"`client_ranks` must all be >= 1, got {cfg.client_ranks}",
        )
        need(
            max(cfg.client_ranks, default=0) == cfg.lora_r,
            f"`lora_r` is the global adapter's rank and must equal max(client_ranks) = "
            f"{max(cfg.client_ranks, default=0)}, got {cfg.lora_r}",
        )
        # a method without clients trains one adapter at lora_r: client_ranks is moot
        other = cfg.methods_where(
            lambda s: s.federated and not s.hetero_ranks, unknown=True, unique=False
        )
        exact = " and ".join(method_names(hetero_ranks=True, exact=True))
        inexact = " and ".join(method_names(hetero_ranks=True, exact=False))
        need(
            not other,
            f"`client_ranks` works with {exact} (exact) and {inexact} (not exact; "
            f"`fedexlora methods`), on both engines; it cannot be combined with methods "
            f"{other}",
        )
    if cfg.engine == "flower":
        for m in cfg.methods_where(lambda s: not s.flower):
            errs.append(
                f"method {m!r} has no clients to federate and runs in-process only; "
                "use --engine local for it (or drop it from the methods of a Flower run)"
            )
    lossy = [
        k for k in ("residual_rank", "side_rank", "side_budget") if getattr(cfg, k) is not None
    ]
    if len(lossy) > 1:
        errs.append(f"`{lossy[0]}` and `{lossy[1]}` are two lossy modes; choose one")
    if cfg.residual_rank is not None:
        lossless = cfg.methods_where(lambda s: not s.residual_rank, unknown=True, unique=False)
        need(
            not lossless,
            f"`residual_rank` applies to {' and '.join(method_names(residual_rank=True))} "
            f"only; it cannot be combined with methods {lossless}",
        )
    for m in cfg.methods_where(lambda s: s.check is not None):
        errs.extend(REGISTRY[m].check(cfg))  # each method's own (MethodSpec.check)
    if cfg.num_clients >= 1 and cfg.max_train is not None and cfg.client_data is None:
        need(
            cfg.max_train >= cfg.num_clients * cfg.min_partition_size,
            f"`max_train` {cfg.max_train} is too small for {cfg.num_clients} clients "
            f"of at least `min_partition_size` {cfg.min_partition_size} examples",
        )
    return errs


def _secure_errors(cfg, errs: list[str]) -> None:
    """What ``secure_aggregation`` cannot be combined with, appended to ``errs``."""
    from fedexlora.core.secure import MIN_SURVIVORS, secure_refusal

    for m in cfg.methods:
        why = secure_refusal(REGISTRY[m]) if m in REGISTRY else None
        if why:
            errs.append(f"`secure_aggregation`: {why}")
    if sample_size(cfg.num_clients, cfg.fraction) < MIN_SURVIVORS:
        errs.append(
            f"`secure_aggregation` needs at least {MIN_SURVIVORS} clients per round "
            "(of two, each learns the other's upload from the sum); got "
            f"{cfg.num_clients} clients at fraction {cfg.fraction}"
        )
    for key, why in (
        ("client_ranks", "heterogeneous ranks need each client's own factors"),
        ("max_update_norm", "the server cannot check an upload it cannot see"),
        ("residual_rank", "the residual is rebuilt from the sums and kept exact"),
        ("side_rank", "the residual is rebuilt from the sums and kept exact"),
        ("side_budget", "the residual is rebuilt from the sums and kept exact"),
    ):
        if getattr(cfg, key) is not None:
            errs.append(f"`secure_aggregation` cannot be combined with `{key}`: {why}")
    if importlib.util.find_spec("flwr") is None:
        errs.append(
            "`secure_aggregation` uses Flower's SecAgg+, and flwr is not installed; fix: "
            "pip install 'fedex-lora[flower]'"
        )


def _dora_errors(cfg, errs: list[str]) -> None:
    """What ``dora`` cannot be combined with, appended to ``errs`` (one line each)."""
    other = cfg.methods_where(lambda spec: not spec.dora)
    exact = [m for m, spec in REGISTRY.items() if spec.dora]
    if other:
        errs.append(
            f"`dora`: method {other[0]!r} does not aggregate DoRA exactly; fix: "
            f"--method {','.join(exact)}, or drop --dora"
        )
    if cfg.dtype != "fp32" or cfg.quantization is not None:
        errs.append(
            "`dora` is exact only on an fp32, unquantized model (peft's DoRA norm reads "
            "the base weight, which cannot hold an fp32 update); fix: --dtype fp32 "
            "without --quantization, or drop --dora"
        )
    for key in ("secure_aggregation", "client_ranks"):
        if getattr(cfg, key):
            errs.append(
                f"`dora` cannot be combined with `{key}` (the server needs each client's "
                "row scale and factors); fix: drop one of them"
            )


def _worker_errors(cfg, errs: list[str]) -> None:
    """A client on several processes (``nproc_per_client``): what cannot work with it."""
    if cfg.accelerate_config is not None:
        if cfg.launcher != "accelerate":
            errs.append(
                "`accelerate_config` is read by `accelerate launch` only; fix: add "
                "--launcher accelerate, or drop --accelerate-config"
            )
        elif not Path(cfg.accelerate_config).expanduser().is_file():
            errs.append(
                f"`accelerate_config` {cfg.accelerate_config!r} is not a file; fix: "
                "write one with `accelerate config`, or drop --accelerate-config"
            )
    if cfg.nproc_per_client == 1:
        return
    n = cfg.nproc_per_client
    cannot = []
    if cfg.dp:
        cannot.append(
            "--dp-epsilon (DP-SGD's per-sample gradients and accounting run in one process)"
        )
    if cfg.client_ranks is not None:
        cannot.append("--client-ranks (the group trains one adapter)")
    if cfg.distributed == "fsdp":
        if cfg.trainer == "trl":
            cannot.append(
                "--trainer trl under --distributed fsdp (fedex-lora shards the model "
                "itself; TRL's Trainer trains under --distributed ddp)"
            )
        if cfg.quantization is not None:
            cannot.append(
                f"--quantization {cfg.quantization} under --distributed fsdp "
                "(bitsandbytes' weights cannot be sharded; --distributed ddp can)"
            )
        if cfg.dora:
            cannot.append("--dora under --distributed fsdp (--distributed ddp can)")
        unsharded = cfg.methods_where(lambda s: not s.shards_under_fsdp)
        if unsharded:
            cannot.append(
                f"--method {','.join(unsharded)} under --distributed fsdp (a latent core, "
                "or factors trained by turns, cannot be sharded once; --distributed ddp can)"
            )
        if not cfg.side_branch and cfg.methods_where(lambda s: s.keeps_residual):
            cannot.append(
                "--no-fp32-side-branch under --distributed fsdp (a sharded fp32 base "
                "cannot take the residuals folded in; the side branch is sharded)"
            )
    if cannot:
        errs.append(
            f"`nproc_per_client` {n}: a client on several processes cannot be combined "
            "with " + "; ".join(cannot) + "; fix: drop them, or --nproc-per-client 1"
        )
