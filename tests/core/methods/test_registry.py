"""The method registry: every spec is consistent, and no module outside it tests a name."""

import ast
from pathlib import Path

import pytest
import torch

import fedexlora
from fedexlora import aggregate
from fedexlora.core.methods import REGISTRY, MethodSpec, get_method, method_names

SRC = Path(fedexlora.__file__).resolve().parent
METHODS_DIR = SRC / "core" / "methods"
NAMES = frozenset(REGISTRY)
WITH_MATH = [name for name, spec in REGISTRY.items() if spec.aggregate is not None]


# -- (a) every registered spec is consistent -----------------------------------------
@pytest.mark.parametrize("name", list(REGISTRY))
def test_spec_is_consistent(name):
    spec = REGISTRY[name]
    assert isinstance(spec, MethodSpec)
    assert spec.name == name
    assert get_method(name) is spec
    if spec.federated:
        assert spec.aggregate is not None or spec.server_method is not None
    # whoever runs it, the server math exists and is that method's own
    server = get_method(spec.server)
    assert server.aggregate is not None, f"{name}: its server {spec.server!r} has no math"
    assert server.server == spec.server
    if spec.latent:
        assert spec.frozen_A
    if spec.flower:
        assert spec.federated, f"{name}: a method without clients cannot run under Flower"
    if not spec.federated:
        assert not (spec.frozen_A or spec.latent or spec.fresh_adapter or spec.residual_rank)
    if spec.baseline is not None:
        assert spec.baseline in NAMES and spec.baseline != name
        assert not get_method(spec.baseline).exact, "a baseline is the inexact method"
    for other, text in spec.claims:
        assert other in NAMES and other != name
        assert text
    for field in ("title", "paper", "trains", "keeps_local", "uploads", "downloads"):
        assert getattr(spec, field), f"{name}: empty {field}"


def test_method_names_filters_by_flags_in_registry_order():
    assert method_names() == tuple(REGISTRY)
    fed = method_names(federated=True)
    assert fed == tuple(n for n, s in REGISTRY.items() if s.federated)
    assert set(method_names(federated=False)) == NAMES - set(fed)
    assert method_names(frozen_A=True, latent=True) == tuple(
        n for n, s in REGISTRY.items() if s.frozen_A and s.latent
    )


def _factors(spec: MethodSpec, k=3, d=7, r=2, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    if spec.latent:  # latent coordinates: A = I shared, B = the r x r core
        return [torch.eye(r)] * k, [torch.randn(r, r, generator=g) for _ in range(k)]
    As = [torch.randn(r, n, generator=g) for _ in range(k)]
    if spec.frozen_A or spec.alternating:  # one shared, frozen A (RoLoRA: a B round)
        As = [As[0]] * k
    return As, [torch.randn(d, r, generator=g) for _ in range(k)]


def _ideal(As, Bs, weights):
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    return sum(pi * B.double() @ A.double() for pi, A, B in zip(p, As, Bs))


@pytest.mark.parametrize("name", WITH_MATH)
def test_server_math_matches_its_exact_flag(name):
    spec = get_method(name)
    As, Bs = _factors(spec)
    weights = [1.0, 2.0, 4.0]
    g = torch.Generator().manual_seed(1)
    # a method that restarts from the round's global factors (FRLoRA) is given them
    start = (As[0] * 0.5, Bs[0] * 0.5) if spec.restarts else None
    res = aggregate(As, Bs, weights, method=name, generator=g, start=start)
    assert res.method == name
    got = res.B.double() @ res.A.double() + res.residual.to_dense().double()
    ideal = _ideal(As, Bs, weights)
    rel = float((got - ideal).norm() / ideal.norm())
    if spec.exact:
        assert rel < 1e-5, f"{name}: B A + residual is {rel:.2e} from sum p_i B_i A_i"
    else:
        assert rel > 0, f"{name} claims to be inexact but matched the ideal update"


@pytest.mark.parametrize("name", [n for n in WITH_MATH if REGISTRY[n].linear])
def test_a_linear_method_aggregates_the_means_as_the_uploads(name):
    """``linear``: the server math of the weighted means is that of the uploads."""
    spec = get_method(name)
    As, Bs = _factors(spec)
    weights = [1.0, 2.0, 4.0]
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    start = (As[0] * 0.5, Bs[0] * 0.5) if spec.restarts else None
    full = aggregate(As, Bs, weights, method=name, start=start,
                     generator=torch.Generator().manual_seed(1))  # fmt: skip
    A_mean = sum(pi * A.double() for pi, A in zip(p, As)).float()
    B_mean = sum(pi * B.double() for pi, B in zip(p, Bs)).float()
    means = aggregate([A_mean], [B_mean], [1.0], method=name, start=start,
                      generator=torch.Generator().manual_seed(1))  # fmt: skip
    up_A, up_B = spec.uploaded(1)
    if up_A:
        assert torch.allclose(full.A, means.A, rtol=1e-5, atol=1e-6), name
    if up_B:
        assert torch.allclose(full.B, means.B, rtol=1e-5, atol=1e-6), name
    if up_A and up_B:
        got = [r.B.double() @ r.A.double() + r.residual.to_dense().double() for r in (full, means)]
        assert float((got[0] - got[1]).norm() / got[0].norm()) < 1e-5, name


def test_a_method_that_is_not_linear_fails_that_check():
    """FedEx-LoRA's residual needs each client's factors: the means alone lose it."""
    As, Bs = _factors(get_method("fedex"))
    full = aggregate(As, Bs, [1.0, 2.0, 4.0], method="fedex")
    A_mean = sum(w / 7 * A for w, A in zip([1.0, 2.0, 4.0], As))
    B_mean = sum(w / 7 * B for w, B in zip([1.0, 2.0, 4.0], Bs))
    means = aggregate([A_mean], [B_mean], [1.0], method="fedex")
    got = [r.B.double() @ r.A.double() + r.residual.to_dense().double() for r in (full, means)]
    assert float((got[0] - got[1]).norm() / got[0].norm()) > 1e-2


@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if s.aggregate is None])
def test_a_method_without_math_runs_on_its_servers(name):
    spec = get_method(name)
    As, Bs = _factors(spec)
    res = aggregate(As, Bs, method=spec.server)
    assert res.method == spec.server
    with pytest.raises(ValueError, match="unknown aggregation `method`"):
        aggregate(As, Bs, method=name)


# -- (c) an unknown name -------------------------------------------------------------
def test_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="unknown method 'nope'; choose from") as err:
        get_method("nope")
    for name in REGISTRY:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="unknown method"):
        get_method(["fedex"])  # not even a name


# -- (b) no module outside core/methods tests a method's name ------------------------
def _named(node: ast.AST | None, consts: dict[str, ast.AST]) -> list[str]:
    """The registered names ``node`` spells out: a literal, or a literal collection of them.

    A module-level constant bound to such a collection (``FOO = ("fedex", "flora")``) counts
    as its literal, so ``m in FOO`` is caught as ``m in ("fedex", "flora")`` is.
    """
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) and node.value in NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for e in node.elts for x in _named(e, {})]
    if isinstance(node, ast.Dict):
        return [x for e in node.keys for x in _named(e, {})]
    if isinstance(node, ast.Name) and node.id in consts:
        return _named(consts[node.id], {})
    return []


def _module_constants(tree: ast.Module) -> dict[str, ast.AST]:
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if isinstance(value, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            out.update({t.id: value for t in targets if isinstance(t, ast.Name)})
    return out


def _pattern_names(pattern: ast.AST) -> list[str]:
    return [
        p.value.value
        for p in ast.walk(pattern)
        if isinstance(p, ast.MatchValue)
        and isinstance(p.value, ast.Constant)
        and p.value.value in NAMES
    ]


_TESTS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def name_tests(source: str, filename: str = "<src>") -> list[str]:
    """Every comparison, membership test or ``case`` in ``source`` that names a method."""
    tree = ast.parse(source, filename)
    consts = _module_constants(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Compare) and any(isinstance(op, _TESTS) for op in node.ops):
            for operand in (node.left, *node.comparators):
                names += _named(operand, consts)
        elif isinstance(node, ast.match_case):
            names = _pattern_names(node.pattern)
        if names:
            line = getattr(node, "lineno", None) or node.pattern.lineno
            found.append((line, f"{filename}:{line}: tests {sorted(set(names))}"))
    return [text for _, text in sorted(found)]


def test_the_scan_catches_what_it_must_and_passes_plain_data():
    bad = """
FOO = ("fedex", "flora")
if method == "ffa": pass
if m in ("fedex", "flora"): pass
if "centralized" not in methods: pass
x = "fedsb" != m
y = [m for m in ms if m in FOO]
z = m in {"fedit": 1}
match method:
    case "fedex" | "flora":
        pass
    case other:
        pass
"""
    found = name_tests(bad)
    assert [f.split(":")[1] for f in found] == ["3", "4", "5", "6", "7", "8", "10"], found
    plain = """
methods = ["fedex"]
PAPER = {"fedex": 84.39, "centralized": 86.71}
def f(method="fedex"):
    '''Runs ``fedex``.'''
    raise ValueError("`residual_rank` applies to fedex only")
if method == "fedexx" or spec.latent or x in ALL_METHODS or m == ours: pass
aggregate(As, Bs, method="flora")
"""
    assert name_tests(plain) == []


def test_no_module_outside_the_registry_tests_a_method_name():
    files = [p for p in sorted(SRC.rglob("*.py")) if METHODS_DIR not in p.parents]
    assert len(files) > 20
    found = []
    for path in files:
        found += name_tests(path.read_text(), str(path.relative_to(SRC.parent)))
    assert not found, (
        "a module branches on a method's name; ask the registry "
        "(fedexlora.core.methods.get_method(name).<flag>) instead:\n" + "\n".join(found)
    )


@pytest.mark.parametrize("name", WITH_MATH)
def test_math_deviation_agrees_with_the_exact_flag(name):
    """The check a run makes of an exact method's math, against every registered one."""
    spec = get_method(name)
    if spec.exact:
        assert spec.math_deviation() < 1e-12
    else:
        assert spec.math_deviation() > 1e-2


def test_math_deviation_of_a_method_without_math_names_its_server():
    spec = next(s for s in REGISTRY.values() if s.aggregate is None)
    with pytest.raises(ValueError, match=f"runs on {spec.server!r}'s server math"):
        spec.math_deviation()


# What one method does is its own: these flags switch behaviour that only its file and
# the spec's hooks may read (the shared code asks the hooks; #46).
_OWN_FLAGS = {
    "latent", "alternating", "prunes_rank", "restarts", "fresh_adapter", "refactors_A",
    "hetero_drops_tail", "hetero_slices", "hetero_orthonormal_A", "effective_is_deviation",
    "frozen_A",
}  # fmt: skip


def test_no_module_outside_the_methods_reads_a_methods_own_flag():
    src = Path(__file__).resolve().parents[3] / "src" / "fedexlora"
    found = []
    for path in src.rglob("*.py"):
        if "methods" in path.relative_to(src).parts[:2]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _OWN_FLAGS:
                found.append(f"{path.relative_to(src)}:{node.lineno} .{node.attr}")
    assert not found, "read outside core/methods: " + ", ".join(found)
