"""One round plan per method and round: what clients train, upload and keep.

``MethodSpec.plan(rnd)`` is the one source the client step, the server and ``bench comm``
read. The registered methods' plans are written out here by hand from their papers (not
read from the code under test), round by round; a method added to the registry must be
added here too.
"""

from dataclasses import replace

import pytest

from fedexlora.core.methods import REGISTRY, MethodSpec, RoundPlan
from fedexlora.core.methods.fedex import aggregate as fedex_aggregate

ROUNDS = (1, 2, 3, 4)
BOTH = {"train": (True, True), "upload": (True, True), "head": True, "keep": (), "only": False}
FROZEN_A = {"train": (False, True), "upload": (False, True), "head": True, "keep": ()}


def _rolora(rnd):  # B in odd rounds (A frozen), A in even ones (B frozen); both sent
    t = (rnd % 2 == 0, rnd % 2 == 1)
    return {"train": t, "upload": t, "head": True, "keep": (), "only": False, "global": True}


# per method, round -> train (A, B), upload (A, B), whether the head is uploaded, what a
# client keeps, whether a client holding the base is sent only the uploaded parts
# ("only"), and whether the server keeps the factors not uploaded bit for bit ("global")
EXPECTED = {
    "fedex": lambda r: {**BOTH, "global": False},
    "fedit": lambda r: {**BOTH, "global": False},
    "ffa": lambda r: {**FROZEN_A, "only": True, "global": True},  # A sent once
    "flora": lambda r: {**BOTH, "global": False},
    "fedsb": lambda r: {**FROZEN_A, "only": True, "global": True},  # the core is B
    "flexlora": lambda r: {**BOTH, "global": False},
    "fedsvd": lambda r: {**FROZEN_A, "only": False, "global": False},  # A re-factored
    "lorafair": lambda r: {**BOTH, "global": False},
    "rolora": _rolora,
    "fedsa": lambda r: {  # trains B and the head, keeps them
        **BOTH,
        "upload": (True, False),
        "head": False,
        "keep": ("B", "head"),
        "only": True,
        "global": True,
    },
    "frlora": lambda r: {**BOTH, "global": False},
    "hetlora": lambda r: {**BOTH, "global": False},
    "centralized": lambda r: {**BOTH, "global": False},
}


def test_every_registered_method_is_in_the_table():
    assert set(EXPECTED) == set(REGISTRY)


@pytest.mark.parametrize("method", sorted(EXPECTED))
@pytest.mark.parametrize("rnd", ROUNDS)
def test_each_methods_plan_is_its_papers(method, rnd):
    spec, want = REGISTRY[method], EXPECTED[method](rnd)
    plan = spec.plan(rnd)
    kept = tuple(p for p, k in zip(("A", "B", "head"), plan.kept.values()) if k)
    got = {
        "train": (plan.train_A, plan.train_B),
        "upload": (plan.upload_A, plan.upload_B),
        "head": plan.upload_extra,
        "keep": kept,
        "only": plan.sends_uploaded_only,
        "global": plan.keeps_global_factors,
    }
    assert got == want
    assert plan.train_extra  # every registered method trains its head every round
    # the old readers read the plan
    assert spec.trained(rnd) == want["train"] and spec.uploaded(rnd) == want["upload"]
    assert spec.keeps_global_factors(rnd) == want["global"]
    assert spec.sends_uploaded_parts_only(False, rnd) == want["only"]
    assert spec.sends_uploaded_parts_only(True, rnd) is False  # a reset client gets all
    assert spec.shares_head == want["head"]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"upload_B": False, "keep_B": False}, "trains B but neither uploads nor keeps it"),
        ({"keep_A": True}, "A is both uploaded and kept"),
        ({"train_A": False}, "uploads A but does not train it"),
        ({"train_extra": False, "upload_extra": False, "keep_extra": True}, "keeps extra but"),
        ({"train_A": False, "upload_A": False, "train_B": False, "upload_B": False},
         "uploads neither A nor B"),
    ],
)  # fmt: skip
def test_a_plan_refuses_parts_that_would_be_lost_or_sent_twice(kw, match):
    with pytest.raises(ValueError, match=match):
        RoundPlan(**kw)


def _odd_b(rnd):
    """B alone in odd rounds (A frozen, not uploaded), A and B in even ones."""
    return RoundPlan(train_A=False, upload_A=False) if rnd % 2 else RoundPlan()


TOY = MethodSpec(
    name="toy_odd_b",
    title="odd-B (test)",
    paper="none: a test of MethodSpec.round_plan",
    trains="B in odd rounds (A frozen), A and B in even rounds",
    keeps_local="nothing",
    uploads="B_i in odd rounds, A_i and B_i in even rounds",
    downloads="A, B and the residual",
    exact=True,
    linear=False,
    bytes_per_round="up 4krd (odd rounds) or 4kr(d+n) (even)",
    aggregate=fedex_aggregate,
    round_plan=_odd_b,
)


def test_a_method_plan_replaces_its_factor_flags():
    assert [TOY.uploaded(r) for r in ROUNDS] == [(False, True), (True, True)] * 2
    assert [TOY.trained(r) for r in ROUNDS] == [(False, True), (True, True)] * 2
    assert [TOY.keeps_global_factors(r) for r in ROUNDS] == [True, False] * 2
    with pytest.raises(ValueError, match="give it or `frozen_A`/`alternating`/`latent`"):
        replace(TOY, frozen_A=True)
    with pytest.raises(ValueError, match="give it its own `aggregate`"):
        replace(TOY, aggregate=None, server_method="fedex")
    with pytest.raises(ValueError, match="its round plan keeps \\['B'\\] in round 1, but"):
        replace(TOY, round_plan=lambda r: RoundPlan(upload_B=False, keep_B=True)).plan(1)


def test_a_method_on_anothers_server_follows_that_plan():
    # the server of a method run on another's math (centralized) reads that method's plan
    for name, spec in REGISTRY.items():
        if spec.server_method is not None:
            other = REGISTRY[spec.server_method]
            assert [spec.plan(r) for r in ROUNDS] == [other.plan(r) for r in ROUNDS], name
