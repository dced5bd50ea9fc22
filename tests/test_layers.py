"""The house's rules, checked on the source: layers only import downwards, no circles,
and the pure layers load neither peft, transformers nor flwr.
"""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fedexlora"

# layer -> the layers it may import (besides itself and the leaves config and quiet)
ALLOWED = {
    "core": set(),
    "server": {"core"},
    "bridge": {"core"},
    "tasks": {"core"},
    "secagg": {"core"},
    "training": {"core", "bridge", "tasks"},
    "run": {"core", "server", "bridge", "tasks", "training", "secagg"},
    "flower": {"core", "server", "bridge", "tasks", "training", "run", "secagg"},
    "experiments": {"core", "server", "bridge", "tasks", "training", "run", "flower", "secagg"},
    "cli": {
        "core",
        "server",
        "bridge",
        "tasks",
        "training",
        "run",
        "flower",
        "experiments",
        "api",
        "secagg",
    },
    "leaf": {"core"},  # config.py, config_checks.py, quiet.py: config asks the registry
}
LEAVES = {"config", "config_checks", "quiet"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every fedexlora module ``name`` imports, at the top or inside a function."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t.startswith("fedexlora") and t != name:
                found.add(t)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] == "__main__":
        return "cli"
    return "leaf" if parts[1] in LEAVES else parts[1]


def test_arrows_only_go_down():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        src = _layer(name)
        if src in ("api",) or name.count(".") == 0:
            continue
        for target in _imports(path, name, modules):
            dst = _layer(target)
            if dst == src or dst == "leaf" and src != "leaf":
                continue
            if dst not in ALLOWED[src]:
                wrong.append(f"{name} ({src}) -> {target} ({dst})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    graph.pop("fedexlora", None)  # the package's front door re-exports; nothing imports it
    graph = {k: {t for t in v if t != "fedexlora"} for k, v in graph.items()}
    circles = _cycles(graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_test_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


PURE_STATEMENTS = [
    "import fedexlora; fedexlora.aggregate",
    "from fedexlora import aggregate, Server, AdapterState",
    "from fedexlora.server import Server",
    "from fedexlora.core.methods import REGISTRY",
    "import fedexlora.core.hetero, fedexlora.core.side, fedexlora.core.messages",
]


def test_pure_layers_load_no_model_libraries():
    """Each statement in turn in one fresh interpreter: what is loaded after each one.

    Imports only add modules, so a library absent after all of them was loaded by none.
    """
    code = "import sys\n" + "".join(
        f"{s}\nprint(sorted(m for m in ('peft', 'transformers', 'flwr') if m in sys.modules))\n"
        for s in PURE_STATEMENTS
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(out) == len(PURE_STATEMENTS)
    for statement, loaded in zip(PURE_STATEMENTS, out):
        assert loaded == "[]", f"{statement!r} loaded {loaded}"


def test_tests_mirror_the_package_and_every_test_folder_is_importable():
    """tests/ is laid out like src/fedexlora/: each folder of tests names a package, and
    is on pytest's ``pythonpath`` (test files import each other's helpers by name)."""
    from fedexlora.config import tomllib  # tomli before Python 3.11

    root = SRC.parents[1]
    declared = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "pythonpath"
        ]
    )
    tests = root / "tests"
    folders = {p.parent for p in tests.rglob("test_*.py")}
    for folder in folders:
        rel = folder.relative_to(root).as_posix()
        assert rel in declared, f"{rel} holds tests but is not on pytest's pythonpath"
        if folder != tests and folder.name != "docs":
            package = SRC / folder.relative_to(tests)
            assert package.is_dir(), f"{rel} mirrors no package of src/fedexlora"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "test file names must be unique across folders"
