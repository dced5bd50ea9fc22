"""The round loop is written once: both engines close their rounds through it."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fedexlora"


def _callers(name: str) -> set[str]:
    out = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called == name:
                    out.add(str(path.relative_to(SRC)))
    return out


def test_only_the_loop_closes_rounds_and_both_engines_run_it():
    assert _callers("close_round") == {"run/loop.py"}
    # the in-process engine and the Flower ServerApp run their methods through it
    assert {"run/inprocess.py", "flower/server_app.py"} <= _callers("drive")
    assert "run/inprocess.py" in _callers("run_rounds")


def test_flower_rounds_go_through_the_strategys_train_round_not_flowers_own_loop():
    assert "flower/server_app.py" in _callers("train_round")
    assert "flower/server_app.py" not in _callers("start")
