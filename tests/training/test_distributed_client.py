"""One client trained on 2 gloo processes (DDP and FSDP ``fully_shard``) against one process.

The two ranks are spawned once for the module (``dist_worker.py``): for a tiny BERT
classifier (fp32 base, trained head) and a tiny Llama causal LM (bf16 base, fp32
adapters), each with a folded residual in every layer's fp32 side branch, both modes
train 3 steps of global batch 5 (split 3 + 2) from the same round state, with warm-up,
weight decay and clipping that bites; rank 0 also trains the same model in one process
on the same global batches. Compared here: every trained tensor, every frozen tensor and
side branch, the loss, each rank's bytes, and the refusals.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedexlora.training import distributed as D

pytestmark = pytest.mark.slow(seconds=40)

KINDS = ("bert", "llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What the 2 ranks and the single process produced (``dist_worker.run``)."""
    out = tmp_path_factory.mktemp("dist")
    here = Path(__file__).parent
    src = Path(D.__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(here)]),
               OMP_NUM_THREADS="1")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(here / "dist_worker.py"), str(out), str(_free_port()), "ddp,fsdp"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", KINDS)
def test_trained_tensors_equal_one_process(ranks, kind, mode):
    one, got = ranks[(kind, "one")], ranks[(kind, mode)]
    assert set(got["trained"]) == set(one["trained"])
    assert any(k.startswith("extra.") for k in one["trained"]) == (kind == "bert")
    for key, want in one["trained"].items():
        start = one["flat"][f"adapter.{key}"]
        assert _rel(want, start) > 1e-2, key  # training moved it: the check is not vacuous
        assert got["trained"][key].dtype == want.dtype
        assert _rel(got["trained"][key], want) < 1e-5, key
    assert got["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", ["grads", "solo"])
def test_gradient_of_a_global_batch_equals_one_process(ranks, kind, mode, batch):
    """The summed gradient itself (AdamW's step would hide a wrong overall scale).

    fp32 base: within 1e-5. bf16 base: within bf16's arithmetic, which changes with the
    batch's shape: one process summing the same batch as 3 + 2 micro-batches differs from
    its whole-batch gradient by 3.7e-3 (measured); a lost all-reduce or a wrong scale
    shows as 0.5. ``solo``: a batch of one example, rank 1's share empty (it runs one
    example at weight 0, so that the collectives match).
    """
    one, got = ranks[(kind, "one")][batch], ranks[(kind, mode)][batch]
    assert set(got) == set(one) and len(one) >= 12
    tol = 1e-5 if kind == "bert" else 1e-2
    for name, want in one.items():
        assert float(torch.linalg.norm(want)) > 0, name
        assert _rel(got[name], want) < tol, name


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_tensors_and_side_branch_unchanged(ranks, kind, mode):
    one, got = ranks[(kind, "one")], ranks[(kind, mode)]
    assert set(got["frozen"]) == set(one["frozen"])
    sides = [k for k in one["frozen"] if k.startswith("side.")]
    assert len(sides) >= 6 and any(k.endswith(".dense") for k in sides)
    for key, want in one["frozen"].items():  # the bits loaded before one process trained
        assert torch.equal(got["frozen"][key], want), key
    for key in sides:  # the round's state, as the coordinator sent it
        assert torch.equal(one["frozen"][key], one["flat"][key].to(one["frozen"][key].dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_rank_holds_its_share_of_base_and_side_branch(ranks, kind):
    """Base + side branch per rank <= 1.1/N of one process's (here no overhead is needed:
    fully_shard pads each tensor to whole rows per rank, the side branch to N elements)."""
    (one,) = ranks[(kind, "one")]["bytes"]
    whole = one["frozen"] + one["side"]
    assert one["side"] > 0
    for mine in ranks[(kind, "fsdp")]["bytes"]:
        assert mine["frozen"] + mine["side"] <= 1.1 * whole / 2
        assert mine["side"] <= 1.1 * one["side"] / 2
        assert mine["trained"] <= 1.1 * one["trained"] / 2
    for mine in ranks[(kind, "ddp")]["bytes"]:  # ddp: every rank holds the model
        assert mine == one


def test_refusals_in_the_ranks(ranks):
    refused = ranks["refusals"]
    assert refused["dora"].startswith("--distributed fsdp: module ") and "DoRA" in refused["dora"]
    assert refused["dp"].startswith("--distributed ddp cannot train with DP-SGD")
    assert refused["trl"].startswith("--distributed fsdp cannot train with --trainer trl")


@pytest.mark.parametrize(
    ("mode", "flags", "match"),
    [
        ("ddp", dict(dp=True), r"--distributed ddp cannot train with DP-SGD \(--dp-epsilon\)"),
        ("fsdp", dict(dp=True), r"--distributed fsdp cannot train with DP-SGD"),
        ("fsdp", dict(trainer="trl"), r"--distributed fsdp cannot train with --trainer trl"),
        ("fsdp", dict(quantization="nf4"),
         r"--distributed fsdp cannot shard a bitsandbytes base \(--quantization nf4\)"),
        ("fsdp", dict(dora=True), r"--distributed fsdp cannot train DoRA \(--dora\)"),
        ("fsdp", dict(penalty=True), r"--distributed fsdp cannot add a loss penalty"),
        ("tp", {}, r"distributed mode 'tp' is unknown"),
    ],
)  # fmt: skip
def test_check_supported_refuses_with_one_line(mode, flags, match):
    with pytest.raises(ValueError, match=match) as err:
        D.check_supported(mode, **flags)
    assert "\n" not in str(err.value)


def test_supported_combinations_pass():
    D.check_supported("ddp", quantization="nf4", dora=True, penalty=True)
    D.check_supported("fsdp")


def test_context_needs_torch_distributed():
    with pytest.raises(ValueError, match="needs torch.distributed initialized first"):
        D.set_context(D.DistContext(mode="ddp"))
    assert D.get_context() is None


@pytest.mark.parametrize(("n", "world"), [(5, 2), (1, 2), (7, 3), (4, 4)])
def test_shares_cover_the_batch_in_order(n, world):
    spans = [D.share(n, r, world) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    sizes = [hi - lo for lo, hi in spans]
    assert max(sizes) - min(sizes) <= 1
