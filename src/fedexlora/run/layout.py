"""The run directory's layout: every file name a run writes, spelled here and only here.

A run directory holds:

- ``config.toml``: the resolved configuration (re-runnable with ``--config``);
- ``metrics.jsonl``: one JSON row per (method, round), appended and fsynced;
- ``summary.md`` with ``metrics.png`` and ``deviation.png``;
- ``partitions.txt``: each client's examples per label;
- ``checkpoints/<method>/round-XXXX/``: safetensors + JSON after every round;
- ``clients/round-N/client-C/``: client adapters (``--save-client-adapters``);
- ``tensorboard/``, ``mlruns/`` and ``mlflow_run_id.txt`` (``--report-to``);
- under Flower: ``run-token`` (this run's identity, for the clients' state),
  ``client-state/`` (what simulated clients keep between rounds) and, after a failed
  run, ``flower-logs/``.

A multi-task recipe writes one such directory per task, ``<out>/<task>/``, and its own
``summary.md``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunError", "RunLayout", "append_row", "write_atomic", "write_rows"]


class RunError(ValueError):
    """A run that cannot start or continue, for a reason the user can fix."""


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        """``config.toml``."""
        return self.root / "config.toml"

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``."""
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        """``summary.md``."""
        return self.root / "summary.md"

    @property
    def metrics_plot(self) -> Path:
        """``metrics.png``."""
        return self.root / "metrics.png"

    @property
    def deviation_plot(self) -> Path:
        """``deviation.png``."""
        return self.root / "deviation.png"

    @property
    def partitions(self) -> Path:
        """``partitions.txt``."""
        return self.root / "partitions.txt"

    @property
    def run_token(self) -> Path:
        """``run-token`` (Flower)."""
        return self.root / "run-token"

    @property
    def client_state(self) -> Path:
        """``client-state/`` (Flower simulation)."""
        return self.root / "client-state"

    @property
    def flower_logs(self) -> Path:
        """``flower-logs/``, kept after a failed Flower run."""
        return self.root / "flower-logs"

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``."""
        return self.root / "tensorboard"

    @property
    def mlruns(self) -> Path:
        """``mlruns/``, MLflow's file store when no tracking URI is set."""
        return self.root / "mlruns"

    @property
    def mlflow_run_id(self) -> Path:
        """``mlflow_run_id.txt``: the MLflow run a resume continues."""
        return self.root / "mlflow_run_id.txt"

    def checkpoints(self, method: str) -> Path:
        """``checkpoints/<method>/``."""
        return self.root / "checkpoints" / method

    def client_adapter(self, rnd: int, client: int) -> Path:
        """``clients/round-<rnd>/client-<client>/``."""
        return self.root / "clients" / f"round-{rnd}" / f"client-{client}"

    def client_adapter_meta(self, rnd: int, client: int) -> Path:
        """``clients/round-<rnd>/client-<client>/meta.json``: its examples and weight."""
        return self.client_adapter(rnd, client) / "meta.json"

    def weigh_client_adapters(self, rnd: int, weights: dict[int, float]) -> list[int]:
        """Adds each client's aggregation weight to the ``meta.json`` its client wrote.

        Every engine's client saves its own adapter as it trained it
        (:meth:`fedexlora.run.client.Client.save_adapter`); the server knows only the
        weights, which it adds here after the round.

        Returns:
            The clients whose adapter is not here (a Flower client on another machine
            keeps it on its node, or could not write it).
        """
        missing = []
        for c, w in sorted(weights.items()):
            meta = self.client_adapter_meta(rnd, c)
            if not meta.is_file():
                missing.append(c)
                continue
            write_atomic(meta, json.dumps({**json.loads(meta.read_text()), "weight": w}, indent=2))
        return missing

    def task(self, task: str) -> RunLayout:
        """The run directory of one task of a multi-task recipe."""
        return RunLayout(self.root / re.sub(r"[^A-Za-z0-9._-]+", "-", task))

    def holds_run(self) -> bool:
        """Whether rows have been written here."""
        return self.metrics.is_file() and self.metrics.stat().st_size > 0


def write_atomic(path: Path, text: str | bytes) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename: whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Writes ``metrics.jsonl`` with exactly ``rows``, atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_row(path: Path, row: dict) -> None:
    """Appends one JSON row to ``metrics.jsonl`` and fsyncs it."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
