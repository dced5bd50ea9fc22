"""Checks a run's export against the exact global model rebuilt by hand.

The ideal is rebuilt from the saved client adapters alone (``--save-client-adapters``:
their factors and example counts) and the pristine base weights, without fedex-lora's
aggregation, server or side-branch code:
``M_t = M_{t-1} - s B̄_{t-1} Ā_{t-1} + sum_i p_i s B_i^t A_i^t`` with ``M_0 = W0``
(FedEx-LoRA, one LoRA scale ``s = alpha / r``). The export is loaded as a user would: a
merged model with plain transformers, an adapter with plain peft on the unchanged base.

Usage::

    fedexlora run --dtype bf16 --save-client-adapters --export DEST --out RUN ...
    python benchmarks/verify_export.py RUN DEST

Prints the largest error over the adapted layers twice: ``||export - ideal|| / ||ideal -
W0||`` (relative to the total update) and ``||export - ideal|| / ||ideal||`` (relative to
the weight). Exits 0 when the export is exact, 1 when it is not:

- an adapter export is exact when its error is at most ``--tol`` (1e-5) of the total
  update: it never rounds into a weight (the factors are fp32, the ideal is applied in
  fp64), so this holds at any learning rate;
- a merged export stores its weights in fp32, so it is exact when it is within ``--tol``
  of the update *or* within fp32's rounding of the weights it stores: at most
  ``(rounds + 1) * 2**-24`` of the weight, one rounding per round (an fp32 base takes each
  round's residual into its weight with one ``addmm_``) and one for the merge. That is
  what docs/LARGE_MODELS.md says a merged export is ("exact to fp32 rounding"): with a
  small update next to the weight (small learning rate, few local steps) it is more than
  1e-5 of the update (docs/BENCHMARKS.md: 1.4e-5 to 1.7e-5 on MiniLM at the defaults),
  while a missing residual or round is orders of magnitude above either bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils.integrations import dequantize_bnb_weight
from safetensors.torch import load_file

from fedexlora.bridge.layers import lora_layers
from fedexlora.config import load_config
from fedexlora.core.methods import get_method
from fedexlora.run.build import new_model
from fedexlora.run.restore import load_task_for


def w0(layer):
    """The pristine base weight (d, n) in fp64, read without fedex-lora's helpers."""
    base = layer.get_base_layer()
    if type(base).__module__.startswith("bitsandbytes"):
        return dequantize_bnb_weight(base.weight, state=getattr(base, "state", None)).double()
    return base.weight.detach().double()


def fresh(cfg):
    """The pristine LoRA model of a run, loaded as the run loaded it (dtype, quantization)."""
    return new_model(cfg, load_task_for(cfg), "fedex")[0]


def accepted_clients(run_dir: Path, method: str = "fedex") -> dict[int, list[int]]:
    """Each round's accepted clients, as ``metrics.jsonl``'s rows of ``method`` say."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl: which clients counted?")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["round"]): sorted(r["accepted"]) for r in rows if r["method"] == method}


def ideal_from_client_adapters(run_dir: Path, cfg) -> dict[str, torch.Tensor]:
    """The exact global model's adapted weights, from W0 and the saved client adapters.

    Each round's clients weigh in by their examples, or alike with ``--weighting uniform``.
    Only the clients the round's row in ``metrics.jsonl`` lists as ``accepted`` count: an
    adapter saved by a client that trained in a refused round (secure aggregation with too
    few survivors), or whose upload was rejected or lost, is in no model.
    """
    model = fresh(cfg)
    layers = lora_layers(model)
    if cfg.client_ranks:
        raise ValueError("heterogeneous client ranks are not rebuilt by this check")
    scale = cfg.lora_alpha / (cfg.lora_r**0.5 if cfg.rslora else cfg.lora_r)
    weighting = cfg.weighting or get_method("fedex").weighting  # the run's, else fedex's own
    uniform = weighting == "uniform"
    M = {n: w0(layer) for n, layer in layers.items()}
    W0 = {n: w.clone() for n, w in M.items()}
    prev_global = {n: 0.0 for n in layers}
    accepted = accepted_clients(run_dir)
    for rnd in range(1, cfg.rounds + 1):
        if not accepted.get(rnd):  # a refused round: the global model is unchanged
            continue
        folder = run_dir / "clients" / f"round-{rnd}"
        clients = [folder / f"client-{c}" for c in accepted[rnd]]
        missing = [c.name for c in clients if not (c / "meta.json").is_file()]
        if missing:
            raise ValueError(f"round {rnd}: no saved adapter for accepted {missing}")
        metas = [json.loads((c / "meta.json").read_text()) for c in clients]
        tensors = [load_file(str(c / "adapter_model.safetensors")) for c in clients]
        if uniform:  # --weighting uniform: every client the same
            p = [1.0 / len(metas)] * len(metas)
        else:
            total = sum(m["num_examples"] for m in metas)
            p = [m["num_examples"] / total for m in metas]
        for m, pi in zip(metas, p):
            if m.get("weight") is not None and abs(m["weight"] - pi) > 1e-9:  # secure: none
                raise ValueError(f"round {rnd}: client weight {m['weight']} != {pi} ({weighting})")
        for n in layers:
            As = [t[f"{n}.lora_A.weight"].double() for t in tensors]
            Bs = [t[f"{n}.lora_B.weight"].double() for t in tensors]
            avg = sum(pi * scale * B @ A for pi, A, B in zip(p, As, Bs))
            M[n] = M[n] - prev_global[n] + avg
            A_bar = sum(pi * A for pi, A in zip(p, As))
            B_bar = sum(pi * B for pi, B in zip(p, Bs))
            prev_global[n] = scale * B_bar @ A_bar
    return M, W0


def rel(got: dict, want: dict, w0: dict) -> float:
    """max over layers of ||got - want|| / ||want - W0|| (relative to the total update)."""
    return max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]).detach())
        for n in want
    )


def rel_weight(got: dict, want: dict) -> float:
    """max over layers of ||got - want|| / ||want|| (relative to the weight)."""
    return max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n])) for n in want
    )


FP32_UNIT_ROUNDOFF = 2.0**-24
"""fp32 rounds to nearest within ``2**-24`` of the value (unit roundoff)."""


def fp32_rounding_bound(rounds: int) -> float:
    """The most fp32 rounding can move a merged export's weight, relative to the weight.

    One rounding per round (an fp32 base takes each round's residual into its weight with
    one ``addmm_``; a side branch is added to the upcast weight once, at the merge) and
    one for the merge of ``s B A``: ``(rounds + 1) * 2**-24``.
    """
    return (int(rounds) + 1) * FP32_UNIT_ROUNDOFF


def verdict(kind: str, err_update: float, err_weight: float, rounds: int, tol: float) -> str:
    """Why the export counts as exact, or ``""`` when it does not.

    Args:
        kind: ``adapter`` or ``merged``.
        err_update: Its error relative to the total update (:func:`rel`).
        err_weight: Its error relative to the weight (:func:`rel_weight`).
        rounds: The run's rounds.
        tol: The bound relative to the update (``--tol``).

    Returns:
        The bound the export meets, in words; ``""`` when it meets neither.
    """
    if err_update <= tol:
        return f"within {tol:g} of the total update"
    bound = fp32_rounding_bound(rounds)
    if kind == "merged" and err_weight <= bound:
        return (
            f"over {tol:g} of the update, but within fp32 rounding of the stored weights "
            f"({rounds} + 1 roundings: {bound:.1e} of the weight)"
        )
    return ""


@torch.no_grad()
def exported(path: Path, cfg) -> dict[str, torch.Tensor]:
    """Effective adapted weights of an export, loaded the way a user would."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model0 = fresh(cfg)
    names = list(lora_layers(model0))
    if (path / "adapter_config.json").is_file():
        base = model0.unload()  # the unchanged base, loaded as in the run
        model = PeftModel.from_pretrained(base, str(path))
        layers = dict(model.named_modules())
        out = {}
        for n in names:
            layer = layers[n]
            A = layer.lora_A["default"].weight.double()
            B = layer.lora_B["default"].weight.double()
            out[n] = w0(layer) + float(layer.scaling["default"]) * B @ A
        return out
    causal = load_task_for(cfg).kind == "causal_lm"
    cls = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = cls.from_pretrained(str(path))
    mods = dict(model.named_modules())
    return {n: mods[n.removeprefix("base_model.model.")].weight.double() for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description="Check an export against the hand-built ideal.")
    ap.add_argument("run", type=Path, help="run directory (with clients/ adapters)")
    ap.add_argument("export", type=Path, help="what fedexlora export wrote")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = load_config(args.run / "config.toml")
    if cfg.methods[0] != "fedex" or not (args.run / "clients").is_dir():
        sys.exit("needs a fedex run with --save-client-adapters")
    ideal, base = ideal_from_client_adapters(args.run, cfg)
    got = exported(args.export, cfg)
    err = rel(got, ideal, base)
    err_w = rel_weight(got, ideal)
    kind = "adapter" if (args.export / "adapter_config.json").is_file() else "merged"
    prec = cfg.quantization or cfg.dtype
    print(f"{prec} base, {kind} export, {len(ideal)} layers, {cfg.rounds} rounds: "
          f"max relative error {err:.2e} of the total update, {err_w:.2e} of the weight "
          f"({err_w / FP32_UNIT_ROUNDOFF:.2f} x fp32's 2**-24)")  # fmt: skip
    why = verdict(kind, err, err_w, cfg.rounds, args.tol)
    print(f"exact: {why}" if why else "NOT exact: over both bounds")
    sys.exit(0 if why else 1)


if __name__ == "__main__":
    main()
