"""The examples run, and their global model equals the ideal computed by hand."""

import importlib.util
from pathlib import Path

import torch
from datasets import Dataset

from fedexlora.adapters import lora_layers

ROOT = Path(__file__).resolve().parents[1]


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_"), ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _weights(model) -> dict[str, torch.Tensor]:
    """``W + s B A`` of every LoRA layer, read straight from peft, in fp64."""
    out = {}
    for name, layer in lora_layers(model).items():
        W = layer.get_base_layer().weight.detach().double()
        A = layer.lora_A["default"].weight.detach().double()
        B = layer.lora_B["default"].weight.detach().double()
        out[name] = W + float(layer.scaling["default"]) * B @ A
    return out


def hand_ideal(w0: dict, history, scale: float) -> dict[str, torch.Tensor]:
    """``M_t = M_{t-1} - s B̄_{t-1} Ā_{t-1} + sum_i p_i s B_i A_i`` from the uploads."""
    M = {n: w.clone() for n, w in w0.items()}
    prev = {n: 0.0 for n in w0}
    for _outcome, uploads in history:
        n_ex = [u.num_examples for u in uploads]
        p = [k / sum(n_ex) for k in n_ex]
        for n in M:
            As = [u.state.factors[n][0].double() for u in uploads]
            Bs = [u.state.factors[n][1].double() for u in uploads]
            M[n] = M[n] - prev[n] + sum(pi * scale * B @ A for pi, A, B in zip(p, As, Bs))
            prev[n] = (
                scale * sum(pi * B for pi, B in zip(p, Bs)) @ sum(pi * A for pi, A in zip(p, As))
            )
    return M


def test_hf_trainer_example_is_exact(tiny_bert_dir, tiny_csv, tmp_path):
    import pandas as pd

    ex = _load("examples/hf_trainer/train.py")
    df = pd.read_csv(tiny_csv)
    df["label"] = df["label"].astype("category").cat.codes
    full = Dataset.from_pandas(df)
    shards = [full.shard(3, i) for i in range(3)]
    w0 = _weights(ex.lora_model(tiny_bert_dir, 3))
    glob, history = ex.federate(
        tiny_bert_dir, shards, 3, rounds=3, steps=4, out=str(tmp_path / "out")
    )
    assert [len(h[1]) for h in history] == [3, 3, 3]
    got, want = _weights(glob), hand_ideal(w0, history, scale=8 / 4)
    err = max(
        float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
        for n in want
    )
    assert err < 1e-5, err
