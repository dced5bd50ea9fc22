"""Copies the finished cells of a `fedexlora compare` grid into a study kept in git.

    python scripts/keep_cells.py /path/to/grid studies/convergence [--study convergence]

A method has finished when it has run all its rounds or been stopped by the rule
(`fedexlora.run.stopping.method_done`). Of a cell whose methods have all finished, only
what `compare` reads is copied: config.toml, metrics.jsonl, partitions.txt and summary.md
(kilobytes; the checkpoints, megabytes to gigabytes, stay behind). Of a cell interrupted
part way, its finished methods are kept (their rows; config.toml as the cell ran,
listing every method it ran or was to run); the method it was in is not, and the next
`compare` runs it, and those after it, from their first round. (A config.toml listing the
finished methods alone would not load where they keep no residual and the cell's
settings, resolved for an exact method beside them, hold one: FedIT beside FedEx-LoRA's
`fp32_side_branch = true`.) The methods a resume finished beyond
those its config.toml lists count as finished too (`compare` rewrites that file only once
the cell has run them all). `fedexlora compare --out DEST` with the same grid then reuses
the whole cells ("(done)"), writes its report from them without training, and runs only
what is missing: whole cells, or the methods a kept cell lacks. A cell already in DEST is
replaced only by one with more rows, of every method it holds. Prints one line per cell.

A method is judged by the stopping rule in its cell's config.toml, which a resume
rewrites only once the cell has finished; ``--study NAME`` judges every cell by that
preset grid's rule and budget instead (`fedexlora compare --study NAME`), as the grid
that runs next will.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fedexlora.config import ConfigError, load_run_config
from fedexlora.experiments.compare import cell_changes
from fedexlora.run.layout import RunLayout, write_rows
from fedexlora.run.report import intact_rows
from fedexlora.run.stopping import method_done

KEPT = ("config.toml", "metrics.jsonl", "partitions.txt", "summary.md")


def keep_cells(src: Path, dest: Path, rule: dict | None = None) -> list[str]:
    """Copies ``src``'s finished cells, and the finished methods of the others, into ``dest``.

    ``rule``: the stopping settings (``rounds``, ``stop_patience``...) to judge a method
    finished by, in place of its cell's config.toml's.

    Returns one line per cell: what was done.
    """
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
        rows = intact_rows(layout.metrics)
        # a resume that gains methods rewrites config.toml only once the cell has run them
        # all: the rows of a method it finished before being stopped count too
        ran = list(dict.fromkeys([*cfg.methods, *(r["method"] for r in rows)]))
        judge = cfg.replace(**rule) if rule else cfg
        done = [m for m in ran if method_done(judge, [r for r in rows if r["method"] == m])]
        if not done:
            said.append(f"{d.name}: unfinished ({len(rows)} rows), not copied")
            continue
        kept_rows = [r for r in rows if r["method"] in done]
        target = dest / d.name
        if (target / "metrics.jsonl").is_file():
            held = intact_rows(target / "metrics.jsonl")
            if len(held) >= len(kept_rows):
                said.append(f"{d.name}: already kept")
                continue
            lost = [m for m in dict.fromkeys(r["method"] for r in held) if m not in done]
            if lost:  # more rows, but not of every method kept: nothing kept is dropped
                said.append(
                    f"{d.name}: not copied, the kept one holds rows of {', '.join(lost)}, "
                    "which this one has not finished"
                )
                continue
            kept = tomllib.loads((target / "config.toml").read_text())  # as it ran
            differ = [c for c in cell_changes(kept, cfg) if not c.startswith("rounds:")]
            if differ:
                said.append(
                    f"{d.name}: not copied, the kept one ran otherwise: {'; '.join(differ)}"
                )
                continue
        target.mkdir(parents=True, exist_ok=True)
        if done == ran == cfg.methods:
            for name in KEPT:
                if (d / name).is_file():
                    shutil.copy2(d / name, target / name)
            said.append(f"{d.name}: kept ({len(rows)} rows, {', '.join(done)})")
            continue
        # the methods that finished; config.toml names every method the cell ran or was to
        # run (its settings were resolved for them all): compare runs the rest
        (target / "config.toml").write_text(cfg.replace(methods=ran).to_toml())
        write_rows(target / "metrics.jsonl", kept_rows)
        if layout.partitions.is_file():
            shutil.copy2(layout.partitions, target / "partitions.txt")
        (target / "summary.md").unlink(missing_ok=True)  # of an earlier, smaller keep
        left = [m for m in ran if m not in done]
        said.append(
            f"{d.name}: kept {', '.join(done)} ({len(kept_rows)} rows)"
            + (f"; unfinished, not copied: {', '.join(left)}" if left else "")
        )
    return said


def main(argv: list[str]) -> int:
    """``keep_cells.py SRC DEST [--study NAME]``: 0, or 2 with one line on a wrong call."""
    from fedexlora.cli.compare import study_rule

    rule = None
    if len(argv) == 4 and argv[2] == "--study":
        try:
            rule = study_rule(argv[3])
        except KeyError:
            print(f"keep_cells: --study: unknown study {argv[3]!r}", file=sys.stderr)
            return 2
        argv = argv[:2]
    if len(argv) != 2:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, dest = Path(argv[0]), Path(argv[1])
    if not src.is_dir():
        print(f"keep_cells: {str(src)!r} is not a directory", file=sys.stderr)
        return 2
    for line in keep_cells(src, dest, rule):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
