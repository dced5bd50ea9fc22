"""The docs' study figures are what ``fedexlora compare`` reports from the kept cells.

A doc quotes a study between two markers::

    <!-- figures: fedexlora compare --study convergence --out studies/convergence -->
    | setting | method | final accuracy | 95% CI | bytes per round |
    |---|---|---|---|---|
    | iid-3 | fedex | 0.9438 | ... | 1.77 MB |

    Held by each client beside its base after the last round (...): ...
    <!-- /figures -->

This test runs the command (``--report-only``, on a copy of its ``--out`` directory, so
nothing trains and the repository is not written) and holds every quoted figure to the
``comparison.md`` it writes: a table's header names comparison.md's columns (with
``setting`` for the section, when the block quotes several), each of its rows one
method's, cell by cell; every other line of the block is one of comparison.md's own, in
the report's order (so a setting's lines are quoted after the setting before it).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- figures: (fedexlora compare .*?) -->\n(.*?)<!-- /figures -->", re.S)


def _blocks() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        blocks = [(doc, *m.groups()) for m in BLOCK.finditer(text)]
        # a marker the pattern misses (a typo, no end marker) would go unchecked
        assert len(blocks) == text.count("<!-- figures:") == text.count("<!-- /figures -->"), (
            f"{doc}: a '<!-- figures: fedexlora compare ... -->' marker without its "
            "'<!-- /figures -->', or one the test cannot read"
        )
        found += blocks
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _report(md: str) -> dict[tuple[str, str], dict[str, str]]:
    """comparison.md's tables: per (setting, method), its figures by column."""
    out, setting, header, headings = {}, None, None, []
    for line in md.splitlines():
        if line.startswith("## "):
            setting, header = line[3:].split()[0], None
            headings.append(setting)
        elif line.startswith("| method |"):
            header = _cells(line)
        elif not line.strip():
            header = None
        elif header and line.startswith("| ") and not line.startswith("|---"):
            row = dict(zip(header, _cells(line), strict=True))
            out[(setting, row["method"])] = row
    # one table per setting: a grid over ranks, steps or budgets would need more than
    # the setting to tell its rows apart
    assert len(headings) == len(set(headings)), f"several tables per setting: {headings}"
    return out


def _run_report_only(command: str, tmp_path: Path) -> str:
    args = shlex.split(command)[1:]  # without "fedexlora"
    assert "--out" in args, f"`{command}`: give its directory as '--out DIR'"
    out = Path(args[args.index("--out") + 1])
    copy = tmp_path / out.name
    shutil.copytree(ROOT / out, copy)
    (copy / "comparison.md").unlink(missing_ok=True)
    args[args.index("--out") + 1] = str(copy)
    res = CliRunner().invoke(app, [*args, "--report-only"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, f"{command}: {res.output}"
    return (copy / "comparison.md").read_text()


def test_some_doc_quotes_a_study():
    """The markers are found (a renamed marker would leave the test below with nothing)."""
    assert {doc for doc, _, _ in BLOCKS} >= {"README.md", "docs/METHODS.md"}


BLOCKS = _blocks()


@pytest.mark.parametrize(
    "doc,command,block", BLOCKS, ids=[f"{doc}#{i}" for i, (doc, _, _) in enumerate(BLOCKS)]
)
def test_quoted_study_figures_are_the_kept_cells_report(doc, command, block, tmp_path):
    md = _run_report_only(command, tmp_path)
    report, lines = _report(md), md.splitlines()
    settings = {s for s, _ in report}
    header, checked, at = None, 0, -1
    for line in block.strip().splitlines():
        if not line.strip():
            header = None
            continue
        if line.startswith("|---"):
            continue
        if line.startswith("| setting |") or line.startswith("| method |"):
            header = _cells(line)
            assert "method" in header, f"{doc}: a quoted table names its method column 'method'"
            continue
        if line.startswith("|"):
            assert header, f"{doc}: a table row before a '| method |' header: {line}"
            row = dict(zip(header, _cells(line), strict=True))
            setting = row.pop("setting", None)
            if setting is None:
                assert len(settings) == 1, f"{doc}: name the setting of each row ({settings})"
                setting = next(iter(settings))
            key = (setting, row["method"])
            assert key in report, f"{doc}: {key} is not in the report of `{command}`"
            for col, said in row.items():
                assert col in report[key], f"{doc}: comparison.md has no column {col!r}"
                assert said == report[key][col], (doc, key, col, said, report[key][col])
                checked += 1
        else:
            assert line in lines, f"{doc}: not a line of the report of `{command}`: {line}"
            # in the report's order: a line quoted under another setting's (the same
            # comparison on two settings reads alike) is out of it
            later = [i for i, x in enumerate(lines) if x == line and i > at]
            assert later, f"{doc}: quoted out of the report's order (another setting's?): {line}"
            at = later[0]
            checked += 1
    assert checked, f"{doc}: the block of `{command}` quotes nothing"
