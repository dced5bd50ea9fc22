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

pytestmark = pytest.mark.slow(seconds=50)  # spawns 2 ranks that import TRL: CPU-bound

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_bert_dir, tiny_csv):
    """What the 2 ranks trained (``trl_dist_worker.run``), and the directory they ran in."""
    out = tmp_path_factory.mktemp("trl-dist")
    src = Path(D.__file__).parents[2]
    path = [str(src), str(HERE), str(HERE.parent / "docs"), str(HERE.parent)]  # conftest too
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
    worst = max(
        _rel(got["trained"][k], w)
        for got, want in zip(ranks["rounds"], one, strict=True)
        for k, w in want["trained"].items()
    )
    print(f"trl on 2 processes vs one: largest relative error {worst:.2e}")
    for rnd, (got, want) in enumerate(zip(ranks["rounds"], one, strict=True)):
        assert got["steps"] == want["steps"] == 4
        assert set(got["trained"]) == set(want["trained"]) and len(want["trained"]) >= 12
        start = ranks["flat"] if rnd == 0 else None
        for key, w in want["trained"].items():
            if start is not None:  # training moved it: the check is not vacuous
                assert _rel(w, start[f"adapter.{key}"]) > 1e-2, key
            assert _rel(got["trained"][key], w) < 1e-5, (rnd, key)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_trl_packing_on_two_processes_is_refused_in_one_line(ranks):
    assert ranks["packing"].startswith("TRL's packing / padding_free flattens a batch into one")
    assert "\n" not in ranks["packing"]


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


def _pad_collate(features: list[list[int]]) -> dict:
    """Pads to the batch's longest, as TRL's collator does (pad id 0, labels = the ids)."""
    longest = max(len(f) for f in features)
    ids = torch.tensor([f + [0] * (longest - len(f)) for f in features])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": (ids != 0).long(), "n": 7}


def test_each_rank_keeps_its_rows_of_the_whole_padded_batch():
    from fedexlora.training.trainer_ranks import rank_share_collator

    features = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]
    whole = _pad_collate(features)
    parts = [rank_share_collator(_pad_collate, r, 3)(features) for r in range(3)]
    assert [len(p["input_ids"]) for p in parts] == [2, 1, 1]  # contiguous, sizes differ by <= 1
    for key in ("input_ids", "labels", "attention_mask"):  # padded as the whole batch is
        assert torch.equal(torch.cat([p[key] for p in parts]), whole[key]), key
    assert all(p["n"] == 7 for p in parts)  # what is not per example passes as it is


def test_an_empty_share_trains_a_fully_masked_row():
    """2 examples on 3 ranks: rank 2 runs the first example (DDP needs its backward) with
    every label masked, so it adds no token to the global count and no gradient."""
    from fedexlora.training.trainer_ranks import rank_share_collator

    features = [[1, 2, 3], [4, 5]]
    stand_in = rank_share_collator(_pad_collate, 2, 3)(features)
    whole = _pad_collate(features)
    assert torch.equal(stand_in["input_ids"], whole["input_ids"][:1])
    assert (stand_in["labels"] == -100).all()
    assert torch.equal(
        rank_share_collator(_pad_collate, 1, 3)(features)["labels"], whole["labels"][1:]
    )
    with pytest.raises(
        ValueError, match="leaves rank 2 of 3 nothing, and the batch has no `labels`"
    ):
        rank_share_collator(lambda f: {"input_ids": _pad_collate(f)["input_ids"]}, 2, 3)(features)
