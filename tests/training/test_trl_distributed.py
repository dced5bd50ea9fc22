"""``--trainer trl`` on a client of 2 gloo processes (DDP) against one process.

The ranks (``trl_dist_worker.py``, spawned once for the module) train the tiny Llama of
``dist_worker`` (bf16 base, fp32 adapters, a folded residual in every layer's fp32 side
branch) with TRL's ``SFTTrainer``, 4 steps of global batch 5 over 11 examples (batches of
5, 5 and 1: split 3 + 2, and 1 + an empty share), twice in a row; this process trains the
same model from the same round state on one process. Every trained tensor must agree
within 1e-5, and the loss too.

The same ranks then run the HF Trainer example as ``torchrun --nproc-per-node 2`` runs it
(``trl_dist_worker.hf_example``): every client's ``Trainer`` trains under DDP on the 2
processes, both hold the same global model, and it equals the ideal computed by hand
from the uploads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedexlora.training import distributed as D
from test_distributed_client import _free_port, _rel

pytestmark = pytest.mark.slow(seconds=30)

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_bert_dir, tiny_csv):
    """What the 2 ranks trained (``trl_dist_worker.run``), and the directory they ran in."""
    out = tmp_path_factory.mktemp("trl-dist")
    src = Path(D.__file__).parents[2]
    path = [str(src), str(HERE), str(HERE.parent / "docs")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "trl_dist_worker.py"), str(out), str(_free_port()),
         tiny_bert_dir, tiny_csv],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(torch.load(out / "result.pt", weights_only=False), out=out, stdout=proc.stdout)


@pytest.fixture(scope="module")
def one(ranks):
    """The same rounds trained on one process, from the round state rank 0 loaded."""
    import trl_dist_worker as W
    from dist_worker import tiny
    from fedexlora.bridge.steps import load_client_state

    model = tiny("llama")
    load_client_state(model, ranks["flat"])
    return W.train_rounds(model, W.tokenizer())


def test_trl_on_two_processes_trains_as_one_process(ranks, one):
    assert len(ranks["rounds"]) == len(one) == 2
    for rnd, (got, want) in enumerate(zip(ranks["rounds"], one, strict=True)):
        assert got["steps"] == want["steps"] == 4
        assert set(got["trained"]) == set(want["trained"]) and len(want["trained"]) >= 12
        start = ranks["flat"] if rnd == 0 else None
        for key, w in want["trained"].items():
            if start is not None:  # training moved it: the check is not vacuous
                assert _rel(w, start[f"adapter.{key}"]) > 1e-2, key
            assert _rel(got["trained"][key], w) < 1e-5, (rnd, key)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_the_hf_trainer_example_runs_on_two_processes_exactly(ranks):
    from test_examples import hand_ideal

    ex = ranks["example"]
    assert ex["trained_on"] == [(2, "DistributedDataParallel")] * 3  # DDP, every client
    ((outcome, uploads),) = ex["history"]
    assert sorted(outcome.accepted) == [0, 1, 2]
    want, w0 = hand_ideal(ex["w0"], ex["history"], scale=8 / 4), ex["w0"]
    for glob in ranks["example_globs"]:  # every rank holds the global model
        assert set(glob) == set(want)
        err = max(
            float(torch.linalg.norm(glob[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
            for n in want
        )
        assert err < 1e-5, err
    assert any(float(torch.linalg.norm(want[n] - w0[n])) > 0 for n in want)  # it trained
    assert ranks["stdout"].count("round 1: model vs ideal") == 1  # rank 0 alone prints
    # nothing written by either rank into the Trainers' shared output directory
    assert not [p for p in (ranks["out"] / "hf_trainer").rglob("*") if p.is_file()]
