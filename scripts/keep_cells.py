"""Copies the finished cells of a `fedexlora compare` grid into a study kept in git.

    python scripts/keep_cells.py /path/to/grid studies/convergence

A cell is finished when every method of its own config.toml has run all its rounds or
been stopped by the rule (`fedexlora.run.stopping.cell_done`). Of each, only what
`compare` reads is copied: config.toml, metrics.jsonl, partitions.txt and summary.md
(kilobytes; the checkpoints, megabytes to gigabytes, stay behind). `fedexlora compare
--out DEST` with the same grid then reuses those cells ("(done)"), writes its report from
them without training, and runs only the cells, or the methods of a cell, still missing.
A cell already in DEST is replaced only by one with more rows; an unfinished cell is
never copied. Prints one line per cell.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from fedexlora.config import ConfigError, load_run_config
from fedexlora.run.layout import RunLayout
from fedexlora.run.report import read_metrics
from fedexlora.run.stopping import cell_done

KEPT = ("config.toml", "metrics.jsonl", "partitions.txt", "summary.md")


def keep_cells(src: Path, dest: Path) -> list[str]:
    """Copies ``src``'s finished cells into ``dest``; one line per cell, what was done."""
    said = []
    for d in sorted(p for p in src.iterdir() if p.is_dir() and ".replaced-" not in p.name):
        layout = RunLayout(d)
        if not (layout.config.is_file() and layout.metrics.is_file()):
            continue
        try:
            cfg = load_run_config(layout.config)
        except ConfigError as exc:
            said.append(f"{d.name}: skipped, its config.toml does not load: {exc}")
            continue
        rows = read_metrics(layout.metrics)
        if not cell_done(cfg, rows):
            said.append(f"{d.name}: unfinished ({len(rows)} rows), not copied")
            continue
        target = dest / d.name
        if (target / "metrics.jsonl").is_file():
            if len(read_metrics(target / "metrics.jsonl")) >= len(rows):
                said.append(f"{d.name}: already kept")
                continue
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (d / name).is_file():
                shutil.copy2(d / name, target / name)
        said.append(f"{d.name}: kept ({len(rows)} rows, {', '.join(cfg.methods)})")
    return said


def main(argv: list[str]) -> int:
    """``keep_cells.py SRC DEST``: 0, or 2 with one line on a wrong call."""
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, dest = Path(argv[0]), Path(argv[1])
    if not src.is_dir():
        print(f"keep_cells: {str(src)!r} is not a directory", file=sys.stderr)
        return 2
    for line in keep_cells(src, dest):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
