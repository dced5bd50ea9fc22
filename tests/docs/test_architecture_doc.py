"""docs/ARCHITECTURE.md's walk-through of adding a method runs as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def test_adding_a_method_walkthrough_runs(monkeypatch):
    from fedexlora.core import aggregation, methods

    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    monkeypatch.setattr(aggregation, "REGISTRY", methods.REGISTRY)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 5
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), scope)
    assert "fedex_dense" in methods.REGISTRY
    assert methods.get_method("fedex_dense").exact
    # the round-plan and kept-parts kinds: the specs the tests that run them on both engines use
    from test_method_keeps import KEEP_A
    from test_method_local_round import TRAIN_A

    planned, kept = methods.get_method("toy_train_a"), methods.get_method("toy_keep_a")
    assert planned.round_plan is not None and planned.aggregate is TRAIN_A.aggregate
    assert [planned.plan(r) for r in (1, 2, 3)] == [TRAIN_A.plan(r) for r in (1, 2, 3)]
    assert kept.keeps == KEEP_A.keeps == ("A",)
    # each kind's example does what it says on a small round, in fp32 as asked
    import torch

    A, B = torch.randn(3, 2, 5, dtype=torch.float64), torch.randn(3, 4, 2, dtype=torch.float64)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    gA, gB, res = kept.server_math(A, B, p, out_dtype=torch.float32)
    assert gA.dtype == gB.dtype == torch.float32 and torch.equal(gA, A[0].float())
    assert torch.allclose(gB.double(), torch.einsum("k,kdr->dr", p, B), atol=1e-6)
    assert res.is_zero


def test_the_tree_it_describes_exists():
    src = Path(__file__).resolve().parents[2] / "src" / "fedexlora"
    for layer in ("core", "server", "bridge", "tasks", "training", "run", "flower",
                  "experiments", "cli"):  # fmt: skip
        assert (src / layer / "__init__.py").is_file(), layer
        assert f"`{layer}`" in DOC.read_text(), layer
    for path in re.findall(r"`((?:core|server|bridge|tasks|training|run|flower|cli)/[\w/.]+\.py)`",
                           DOC.read_text()):  # fmt: skip
        assert (src / path).is_file(), path


def test_what_exact_promises_is_the_bound_the_run_holds():
    from fedexlora.core.methods.spec import EXACT_BOUND, ROUNDING_MARGIN, MethodSpec

    text = " ".join(DOC.read_text().split())
    section = text[text.index("### What `exact` and `linear` promise") :]
    stated = re.search(r"`EXACT_BOUND` = ([0-9.e-]+) of the update", section)
    assert stated and float(stated.group(1)) == EXACT_BOUND
    margin = re.search(r"`ROUNDING_MARGIN` = ([0-9.e-]+) times", section)
    assert margin and float(margin.group(1)) == ROUNDING_MARGIN
    assert "`aggregate(A, B, p)`" in section
    for field in ("exact", "linear"):  # the spec's docstring defines them too
        assert f"{field}: " in MethodSpec.__doc__
