"""``--trainer trl`` on a client of two processes (``--nproc-per-client 2``), in-process engine.

Each client's TRL ``SFTTrainer`` trains on its worker group's 2 ranks under DDP, on the
single process's batches (``fedexlora.training.trainer_ranks``); rank 0 alone returns the
result, and the Trainers write nothing. Under both launchers: the global model equals
the fp64 ideal of the SAVED client adapters, and the same run with every client on one
process, within 1e-5; so do the training losses. (The training step itself, against one
process on uneven and empty shares: ``tests/training/test_trl_distributed.py``.)
"""

from __future__ import annotations

import json

import pytest

from fedexlora.run import workers
from fedexlora.run.inprocess import run_experiment
from test_worker_group import (  # the module fixture: its groups in a folder of its own
    _own_workers_dir,  # noqa: F401
    _verify,
    final_weights,
    model_vs_ideal,
)

# a worker group per launcher: two ranks that import torch, transformers, peft and TRL
pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow(seconds=240)]


def _cfg(model: str, task: str, **kw):
    """2 clients of 16 examples, 2 rounds of 4 steps of batch 5 (5, 5, 5, then 1: an
    empty share on rank 1), TRL on 2 processes; no dropout (a rank draws its own masks)."""
    from fedexlora.config import RunConfig

    return RunConfig(
        model=model, task=task, methods=["fedex"], num_clients=2, partition="iid", rounds=2,
        local_steps=4, batch_size=5, lr=2e-2, max_length=32, lora_r=4, lora_alpha=8,
        lora_dropout=0.0, target_modules=["q_proj", "v_proj"], max_test=4, max_new_tokens=4,
        trainer="trl", save_client_adapters=True, fp32_side_branch=True, nproc_per_client=2,
        **kw,
    ).validate()  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, tiny_qa_jsonl, tmp_path_factory):
    """The same run, every client on one process: its config, directory and rows."""
    cfg = _cfg(tiny_llama_dir, tiny_qa_jsonl).replace(nproc_per_client=1)
    run_dir = tmp_path_factory.mktemp("one")
    return cfg, run_dir, run_experiment(cfg, run_dir, progress=False)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_trl_client_on_two_processes_is_exact_and_trains_as_one(
    launcher, tiny_llama_dir, tiny_qa_jsonl, one_process, tmp_path
):
    cfg = _cfg(tiny_llama_dir, tiny_qa_jsonl, launcher=launcher)
    rows = run_experiment(cfg, tmp_path, progress=False)
    assert [r["accepted"] for r in rows] == [[0, 1], [0, 1]]
    err = model_vs_ideal(cfg, tmp_path)
    one_cfg, one_dir, one_rows = one_process
    w0 = _verify().ideal_from_client_adapters(one_dir, one_cfg)[1]
    vs_one = _verify().rel(final_weights(cfg, tmp_path), final_weights(one_cfg, one_dir), w0)
    print(f"trl, {launcher}: model vs ideal {err:.3e}; vs one process {vs_one:.3e}")
    assert err <= 1e-5
    assert vs_one <= 1e-5
    for got, want in zip(rows, one_rows, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    loads = (workers.WorkerGroup(cfg, "fedex").dir / "loads.log").read_text().splitlines()
    assert sorted(json.loads(x)["rank"] for x in loads) == [0, 1]  # 2 ranks trained them
