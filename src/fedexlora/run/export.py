"""Exports of a run's final global model that stay exact: a PEFT adapter or a merged model.

``adapter`` writes one standard PEFT LoRA adapter directory. Applied with plain peft to
the unchanged base model, loaded the same way as in the run (same dtype, same
quantization), it gives the exact global model: per layer, the global factors and the
accumulated residual's factors are concatenated into one LoRA of rank
``r + rank(residual)``, with the scales absorbed (``lora_alpha`` = rank, so the scale is 1).

``merged`` writes a Hugging Face model directory in fp32 (or, with ``allow_inexact``, in
bf16/fp16) whose adapted weights are the model's effective weights (base, side branch
and adapter). A quantized base is merged into its dequantized weights: every quantized
layer, adapted or not, is written dequantized.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedexlora.bridge import layer_kinds
from fedexlora.bridge.dora import dora_weight_of, is_dora
from fedexlora.bridge.fold import _side, effective_weight, folded_delta
from fedexlora.bridge.latent import is_latent
from fedexlora.bridge.layers import lora_layers
from fedexlora.bridge.masters import master, read_extra
from fedexlora.bridge.models import portable_reference
from fedexlora.bridge.sharing import base_holders
from fedexlora.config import load_run_config
from fedexlora.core.aggregation import Residual
from fedexlora.run.checkpoint import config_fingerprint
from fedexlora.run.layout import RunError, RunLayout
from fedexlora.run.restore import check_client_rows, load_task_for, restore_latest

__all__ = ["ExportResult", "export_dest_error", "export_model", "output_dir_error", "save_adapter"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_INFO = "fedexlora_export.json"  # what an export wrote: its format, method, round, files


@dataclass(frozen=True)
class ExportResult:
    """Where an export went, in which format, and what the user should know."""

    path: Path
    format: str
    note: str


def output_dir_error(path: str | Path) -> str | None:
    """Why ``path`` cannot be a directory to write into, or ``None`` when it can be.

    An existing directory passes, and so does a new one whose nearest existing parent is
    a directory. Either must accept a new entry: an empty directory is made there and
    removed, so that whatever the system would refuse later (permissions, a read-only
    or virtual file system such as ``/proc``, for root too) is found now. Nothing is
    left behind.

    Args:
        path: The directory a run or an export will write.

    Returns:
        The problem, to follow the quoted path, or ``None``.
    """
    p = Path(path).expanduser()
    if p.is_symlink() and not p.exists():
        return "is a broken symbolic link"
    if p.exists() and not p.is_dir():
        return "is a file, not a directory"
    parent = p
    while not parent.exists():  # the nearest ancestor that is there ("/" always is)
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be made: {str(parent)!r} is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".fedexlora-probe-", dir=parent)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if parent == p:
            return f"cannot be written: it accepts no new files ({why})"
        return f"cannot be made: {str(parent)!r} accepts no new directory ({why})"
    os.rmdir(probe)
    return None


def _previous_export(dest: Path) -> list[Path] | None:
    """The files of the fedex-lora export in ``dest``, if that is all ``dest`` holds.

    ``None`` when ``dest`` holds anything else: a file the export did not list, a folder
    that holds none of its files (or is a link), or an export that did not list its files
    (from before it did).
    """
    try:
        listed = json.loads((dest / _INFO).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list) or not all(isinstance(f, str) for f in listed):
        return None
    folders = {Path(f).parent.as_posix() for f in listed} - {"."}
    folders |= {Path(f).as_posix() for x in folders for f in Path(x).parents} - {"."}
    files = []
    for entry in dest.rglob("*"):
        rel = entry.relative_to(dest).as_posix()
        if entry.is_dir() and not entry.is_symlink():
            if rel not in folders:
                return None
        elif rel in listed or rel == _INFO:
            files.append(entry)
        else:
            return None
    return sorted(files)


def export_dest_error(dest: str | Path) -> str | None:
    """Why an export cannot be written to ``dest`` (``None``: it can).

    :func:`output_dir_error`'s checks, and one more: an export goes into a new or empty
    directory, or replaces an earlier fedex-lora export there (the files it listed, and
    nothing else, so an adapter and a merged model never mix). A directory that holds
    anything else is refused, so that nothing of the user's is overwritten.
    """
    problem = output_dir_error(dest)
    if problem is not None:
        return problem
    d = Path(dest).expanduser()
    if not d.is_dir() or not any(d.iterdir()) or _previous_export(d) is not None:
        return None
    names = sorted(p.name for p in d.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"is not empty ({shown}) and is not an earlier fedex-lora export; fix: choose a new "
        "or empty directory"
    )


def _swap_in(stage: Path, dest: Path) -> None:
    """Moves a finished export from ``stage`` to ``dest``, replacing an earlier export.

    ``dest`` is checked again first (between the first check and now, it may have been
    given other files, which are then kept and the export refused).
    """
    problem = export_dest_error(dest)
    if problem is not None:
        raise RunError(f"export destination {str(dest)!r} {problem}")
    if not dest.exists():
        os.replace(stage, dest)  # the caller's clean-up then finds nothing there
        return
    old = _previous_export(dest) or []
    for f in old:
        f.unlink()
    for folder in sorted({f.parent for f in old} - {dest}, key=lambda x: -len(x.parts)):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for entry in stage.iterdir():
        os.replace(entry, dest / entry.name)


def export_model(
    run_dir: str | Path,
    dest: str | Path,
    method: str | None = None,
    *,
    fmt: str | None = None,
    dtype: str | None = None,
    allow_inexact: bool | None = None,
) -> ExportResult:
    """Writes the final global model of a run as a PEFT adapter or a merged model.

    Args:
        run_dir: A run directory written by ``fedexlora run``.
        dest: Where to write.
        method: Which method's model (the run's first by default).
        fmt: ``adapter`` or ``merged``; by default the run's ``export_format``, else
            ``adapter`` for a run with a side branch (half-precision and quantized bases,
            and fp32 ones by default with an exact method) and ``merged`` for one folded
            into fp32 weights.
        dtype: Dtype of a merged model (``fp32`` by default).
        allow_inexact: Allow a merged model in bf16/fp16, which rounds the update.

    Raises:
        RunError: If the run directory or checkpoint is missing, ``dest`` cannot be
            written, or the export would not be exact and ``allow_inexact`` is not set.
    """
    layout = RunLayout(run_dir)
    run = layout.root
    if not layout.config.is_file():
        raise RunError(f"{str(run)!r} is not a run directory (no config.toml)")
    cfg = load_run_config(layout.config)
    fmt = fmt or cfg.resolved_export_format
    dtype = dtype or cfg.export_dtype
    allow = cfg.allow_inexact if allow_inexact is None else allow_inexact
    if fmt not in ("adapter", "merged"):
        raise RunError(f"--format must be adapter or merged, got {fmt!r}")
    if dtype not in _DTYPES:
        raise RunError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if fmt == "adapter" and dtype != "fp32":  # an adapter keeps the run's own dtypes
        raise RunError(
            f"--dtype {dtype} applies to a merged model; an adapter export keeps the run's "
            "dtypes (exact on the unchanged base); fix: drop --dtype, or --format merged"
        )
    if fmt == "merged" and dtype != "fp32" and not allow:
        raise RunError(
            f"--format merged in {dtype} rounds the federated update away, so it cannot be "
            "exact; fix: use --format adapter, keep fp32, or confirm with --allow-inexact"
        )
    method = method or cfg.methods[0]
    if method not in cfg.methods:
        raise RunError(f"method {method!r} is not in this run; it has {cfg.methods}")
    problem = export_dest_error(dest)  # before the model is loaded
    if problem is not None:
        raise RunError(f"export destination {str(dest)!r} {problem}")
    if not any(layout.checkpoints(method).glob("round-*")):
        raise RunError(f"run {str(run)!r} has no checkpoint for method {method!r}")
    task = load_task_for(cfg)
    check_client_rows(cfg, task, layout)  # Fed-SB's frozen factors come from them
    # the newest intact checkpoint; a damaged one is named (and an older one used, said)
    model, tokenizer, server, _ = restore_latest(
        cfg, task, method, layout.checkpoints(method), config_fingerprint(cfg)
    )
    labels = _name_labels(model, task)  # into config.json: predictions carry the task's names
    dest = Path(dest).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    # written beside DEST first: an earlier export there stays whole until this one is
    stage = Path(tempfile.mkdtemp(prefix=".fedexlora-export-", dir=dest.parent))
    try:
        if fmt == "adapter":
            note = _write_adapter(cfg, model, server, stage, labelled=bool(labels))
        else:
            note = _write_merged(cfg, task, method, model, stage, _DTYPES[dtype])
        if fmt == "adapter" and labels:  # the base's config with the task's head and names
            model.config.save_pretrained(str(stage))
        tokenizer.save_pretrained(str(stage))
        load = {
            "model": cfg.model,
            "dtype": cfg.dtype,
            "quantization": cfg.quantization,
            "double_quant": cfg.double_quant,
        }
        load["reference"] = portable_reference(cfg.model)
        info = {"format": fmt, "method": method, "round": server.round, "base": load}
        info["note"] = note
        if labels:
            info["num_labels"], info["id2label"] = len(labels), dict(enumerate(labels))
        if fmt == "merged":
            info["dtype"] = dtype
        written = [p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()]
        info["files"] = sorted(written)
        (stage / _INFO).write_text(json.dumps(info, indent=1))
        _usual_modes(stage)
        _swap_in(stage, dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ExportResult(dest, fmt, note)


def _name_labels(model, task) -> list[str]:
    """Writes the task's label names into the model's config; returns them (causal: ``[]``).

    ``num_labels``, ``id2label`` and ``label2id`` then reach a merged model's
    ``config.json`` and an adapter's (the base's config with the task's head), so that a
    loaded export predicts the task's names, not ``LABEL_0``.
    """
    names = [str(n) for n in task.label_names] if task.kind != "causal_lm" else []
    if names:
        config = model.config
        config.id2label = dict(enumerate(names))
        config.label2id = {n: i for i, n in enumerate(names)}
    return names


def _usual_modes(root: Path) -> None:
    """Gives ``root`` and everything in it the modes of a new file under the umask.

    The staging folder is made private (0700) and some writers make private files; an
    export is a model to share, so folders get ``0777`` and files ``0666``, less the
    umask (0755 and 0644 under the usual 022).
    """
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _as_factors(r: Residual) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, V)`` with ``U @ V == r``; a dense ``(d, n)`` becomes ``(D, I)`` or ``(I, D)``."""
    if r.dense is None:
        return r.U.double(), r.V.double()
    d, n = r.shape
    D = r.dense.double()
    eye = torch.eye(min(d, n), dtype=torch.float64, device=D.device)
    return (D, eye) if n <= d else (eye, D)


def _write_adapter(cfg, model, server, dest: Path, *, labelled: bool = False) -> str:
    """One PEFT adapter of rank ``r + q`` per layer: ``[s B | U] @ [A ; V]``, scale 1."""
    save_adapter(model, dest, delta=server.delta, base=portable_reference(cfg.model))
    top = json.loads((dest / "adapter_config.json").read_text())["r"]
    head = " and this directory's config.json (the task's labels)" if labelled else ""
    return (
        f"PEFT adapter of rank up to {top}: r={cfg.lora_r} plus the rank of the residual "
        "accumulated over the rounds, which one plain LoRA must hold to be exact; load the "
        f"base model as the run did (same dtype and quantization){head}, then "
        "peft.PeftModel.from_pretrained(base, this directory)"
    )


@torch.no_grad()
def save_adapter(
    model: torch.nn.Module,
    dest: str | Path,
    *,
    delta: Callable[[str], Residual | None] | None = None,
    base: str | None = None,
) -> Path:
    """Writes a federated global model as one plain PEFT LoRA adapter, exactly.

    Per layer the adapter is ``[s B | U] @ [A ; V]`` at scale 1: the global factors and the
    factors of everything folded into the base since it was loaded, so that
    ``peft.PeftModel.from_pretrained(base, dest)`` on the unchanged base model, loaded as
    the run loaded it (same dtype and quantization), gives the model's effective weights.
    For a loop of your own (``apply_outcome`` into ``model``): ``save_adapter(model, dir)``.
    A half-precision trained extra (a bf16 head) is written as its fp32 master
    (:mod:`fedexlora.bridge.masters`), the exact average.

    Args:
        model: The global model (a peft model whose base received the folds).
        dest: The adapter directory (created).
        delta: Module -> what was folded into its fp32 base, in the adapter's units
            (``Server.delta``); by default read from the model itself
            (:func:`fedexlora.bridge.fold.folded_delta`). Side branches (bf16/fp16 or
            quantized bases) are always read from the model.
        base: ``base_model_name_or_path`` written into the adapter's config (by default
            what peft recorded).

    Returns:
        ``dest``.
    """
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    layers = lora_layers(model)
    if delta is None:
        delta = lambda name: folded_delta(model, name)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="fedexlora-export-") as tmp:
        model.save_pretrained(tmp)  # peft's own key names and config, then widened
        tensors = load_file(str(Path(tmp) / "adapter_model.safetensors"))
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
    ranks: dict[str, int] = {}
    for name, layer in layers.items():
        scale = float(layer.scaling["default"])
        A = layer_kinds.read_A(layer, "default").detach().double().cpu()
        B = layer_kinds.read_B(layer, "default").detach().double().cpu()
        side = _side(layer)
        if side is not None:
            extra = side.residual if side.rank else None
        else:
            folded = delta(name)
            extra = folded.scaled(scale) if folded is not None and not folded.is_zero else None
        Bs, As = [scale * B], [A]
        if extra is not None:
            U, V = _as_factors(extra)
            Bs.append(U.cpu())
            As.append(V.cpu())
        A_new, B_new = torch.cat(As, 0).float(), torch.cat(Bs, 1).float()
        key = name.removeprefix("base_model.model.")
        try:
            mine = layer_kinds.adapter_tensors(layer, name, A_new, B_new)
        except ValueError as e:
            raise RunError(str(e)) from None
        if is_latent(layer):  # Fed-SB: peft saved lora_B's basis and core, not B = basis @ core
            parts = [k for k in tensors if k.startswith(f"{name}.lora_B.")]
            if len(parts) != 2:  # lora_B.default.basis.weight and lora_B.default.core.weight
                raise RunError(f"peft saved no Fed-SB factors for {name!r}; cannot export it")
            for k in parts:
                del tensors[k]
        elif any(k not in tensors for k in mine):
            raise RunError(f"peft saved no factors for {name!r}; cannot export an adapter")
        tensors.update({k: v.contiguous() for k, v in mine.items()})
        saved_base = f"{name}.base_layer.weight"  # peft saves a targeted embedding's weight
        if saved_base in tensors and side is None and extra is not None:
            # what was folded into it is in the widened factors: save the weight without it
            w = layer_kinds.base_param(layer).detach().cpu().double()
            unfolded = w - layer_kinds.to_stored(layer, extra.to_dense().double().cpu())
            tensors[saved_base] = unfolded.to(tensors[saved_base].dtype).contiguous()
        ranks[re.escape(key)] = int(A_new.shape[0])
    tensors.update(_masters_as_saved(model, tensors))  # a bf16 head: its exact fp32 master
    config.update(
        r=max(ranks.values()),
        lora_alpha=max(ranks.values()),
        rank_pattern=ranks,
        alpha_pattern=dict(ranks),  # alpha = rank: every layer's scale is 1
        use_rslora=False,
        lora_dropout=0.0,
    )
    if base is not None:
        config["base_model_name_or_path"] = base
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return dest


def _masters_as_saved(model: torch.nn.Module, saved: dict) -> dict[str, torch.Tensor]:
    """The fp32 masters of half-precision extras, under the keys peft saved them as."""
    from peft.utils import get_peft_model_state_dict

    masters = {n: read_extra(p) for n, p in model.named_parameters() if master(p) is not None}
    if not masters:
        return {}
    state = {**model.state_dict(), **masters}
    ids = {id(t) for t in masters.values()}
    mapped = get_peft_model_state_dict(model, state_dict=state)
    return {k: v.clone() for k, v in mapped.items() if id(v) in ids and k in saved}


@torch.no_grad()
def _write_merged(cfg, task, method, model, dest: Path, dtype: torch.dtype) -> str:
    """The effective model written as plain weights (dequantized, upcast, merged)."""
    from fedexlora.run.build import new_model

    quantized = cfg.quantization is not None
    if quantized or cfg.dtype != "fp32":
        plain = new_model(cfg.replace(quantization=None, dtype="fp32"), task, method)[0]
        _copy_dequantized(model, plain)
    else:
        plain = model
    src_layers, dst_layers = lora_layers(model), lora_layers(plain)
    shared = base_holders(plain)  # a tied embedding, replicated layers: theirs stay as is
    for name, layer in src_layers.items():
        # (d, n): stored as the layer's kind stores it; a DoRA layer's with its magnitude
        eff = dora_weight_of(layer) if is_dora(layer, "default") else effective_weight(layer)
        eff = eff.float()
        dst = dst_layers[name]
        stored = layer_kinds.to_stored(dst, eff)
        if name in shared:  # a tensor of its own: copy_ would change the other holders
            base = dst.get_base_layer()
            base.weight = torch.nn.Parameter(stored.contiguous().to(base.weight.device), False)
        else:
            layer_kinds.base_param(dst).copy_(stored)
    heads = _trained_copies(plain)  # modules_to_save (a task head), as the run trained them
    # adapters dropped, not merged: the weights already hold them, side branches included
    # (an fp32 model's --fp32-side-branch goes with the LoRA layer that carries it)
    merged = plain.unload()
    for name, module in heads.items():  # peft 0.22's unload() restores the untrained original
        parent, _, child = name.rpartition(".")
        setattr(merged.get_submodule(parent), child, module)
    merged = merged.to(dtype)
    if shared:  # saved and loaded as separate tensors, not tied again
        for config in {id(c): c for c in (merged.config, merged.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    merged.save_pretrained(str(dest))
    what = "dequantized fp32 weights" if quantized else f"{cfg.dtype} base upcast to fp32"
    if cfg.dtype == "fp32" and not quantized:
        what = "fp32 weights"
    note = f"merged model: {what} plus the federated update"
    if dtype != torch.float32:
        note += f", rounded to {dtype} (--allow-inexact)"
    return note


def _trained_copies(model) -> dict[str, torch.nn.Module]:
    """Each ``modules_to_save`` wrapper's active trained copy, by its name in the base model.

    ``unload()`` returned these copies up to peft 0.21; from 0.22 on, without merging, it
    returns the wrapper's original (untrained) module, so the export puts them back.
    """
    from peft.utils import ModulesToSaveWrapper

    out = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapter
            active = active if isinstance(active, str) else (list(active) or [None])[0]
            if active in module.modules_to_save:
                out[name] = module.modules_to_save[active]
    return out


def _copy_dequantized(src, dst) -> None:
    """Copies every parameter of ``src`` into ``dst`` (same architecture, fp32).

    bitsandbytes layers are dequantized with peft's helper; Conv1D targets transposed.
    """
    from peft.utils.integrations import dequantize_bnb_weight
    from transformers.pytorch_utils import Conv1D

    dst_mods = dict(dst.named_modules())
    for name, mod in src.named_modules():
        if type(mod).__module__.split(".")[0] != "bitsandbytes" or name not in dst_mods:
            continue
        w = dequantize_bnb_weight(mod.weight, state=getattr(mod, "state", None)).float()
        target = dst_mods[name]
        target.weight.copy_(w.T if isinstance(target, Conv1D) else w)
        if getattr(mod, "bias", None) is not None:
            target.bias.copy_(mod.bias.float())
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        q = dst_params.get(name)
        if q is not None and p.dtype.is_floating_point and tuple(p.shape) == tuple(q.shape):
            q.copy_(p.detach().float())
