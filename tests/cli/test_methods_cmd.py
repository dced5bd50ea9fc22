"""`fedexlora methods` prints the registry: every method, its paper, exact, linear, bytes."""

from typer.testing import CliRunner

from fedexlora.cli import app
from fedexlora.core.methods import REGISTRY


def test_methods_prints_the_registry():
    res = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    lines = {ln.split("│")[1].strip(): ln for ln in res.output.splitlines() if ln.count("│") > 5}
    for name, spec in REGISTRY.items():
        line = " ".join(lines[name].split())
        assert spec.title in line and spec.paper.split(",")[0] in line
        cells = [c.strip() for c in lines[name].split("│")[1:-1]]
        assert cells[3:5] == ["yes" if spec.exact else "no", "yes" if spec.linear else "no"]
        assert cells[-1] == spec.bytes_per_round  # brackets shown, not eaten as markup
    assert "down 4k[r(d+n) + min((k-1)r(d+n), dn)]" in res.output
