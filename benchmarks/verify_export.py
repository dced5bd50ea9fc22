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

Prints, per layer and at most, ``||export - ideal|| / ||ideal - W0||`` (relative to the
total update) and exits 1 above ``--tol`` (1e-5).
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

from fedexlora.bridge.adapters import lora_layers
from fedexlora.config import load_config
from fedexlora.run.engine import new_model
from fedexlora.run.pipeline import load_task_for


def w0(layer):
    """The pristine base weight (d, n) in fp64, read without fedex-lora's helpers."""
    base = layer.get_base_layer()
    if type(base).__module__.startswith("bitsandbytes"):
        return dequantize_bnb_weight(base.weight, state=getattr(base, "state", None)).double()
    return base.weight.detach().double()


def fresh(cfg):
    """The pristine LoRA model of a run, loaded as the run loaded it (dtype, quantization)."""
    return new_model(cfg, load_task_for(cfg), "fedex")[0]


def ideal_from_client_adapters(run_dir: Path, cfg) -> dict[str, torch.Tensor]:
    """The exact global model's adapted weights, from W0 and the saved client adapters."""
    model = fresh(cfg)
    layers = lora_layers(model)
    if cfg.client_ranks:
        raise ValueError("heterogeneous client ranks are not rebuilt by this check")
    scale = cfg.lora_alpha / (cfg.lora_r**0.5 if cfg.rslora else cfg.lora_r)
    M = {n: w0(layer) for n, layer in layers.items()}
    W0 = {n: w.clone() for n, w in M.items()}
    prev_global = {n: 0.0 for n in layers}
    for rnd in range(1, cfg.rounds + 1):
        clients = sorted((run_dir / "clients" / f"round-{rnd}").iterdir())
        metas = [json.loads((c / "meta.json").read_text()) for c in clients]
        tensors = [load_file(str(c / "adapter_model.safetensors")) for c in clients]
        total = sum(m["num_examples"] for m in metas)
        p = [m["num_examples"] / total for m in metas]
        for m, pi in zip(metas, p):
            if m.get("weight") is not None and abs(m["weight"] - pi) > 1e-9:  # secure: none
                raise ValueError(f"round {rnd}: client weight {m['weight']} != {pi} (examples)")
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
    kind = "adapter" if (args.export / "adapter_config.json").is_file() else "merged"
    prec = cfg.quantization or cfg.dtype
    print(f"{prec} base, {kind} export, {len(ideal)} layers, {cfg.rounds} rounds: "
          f"max relative error {err:.2e} of the total update")  # fmt: skip
    sys.exit(0 if err <= args.tol else 1)


if __name__ == "__main__":
    main()
