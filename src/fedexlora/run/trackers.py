"""``--report-to tensorboard,mlflow``: watch a run while it trains (optional extras).

Both engines call the same three functions: :func:`open_trackers` once, ``log_row`` for
every ``metrics.jsonl`` row as it is written, and ``finish`` after ``summary.md``.

- TensorBoard: event files under ``RUN/tensorboard``; a scalar per method and value
  (``fedex/accuracy``, ``fedex/bytes_up``, ...) with the round as its step, the
  configuration and the summary as text.
- MLflow: one MLflow run per fedex-lora run, in experiment ``fedex-lora``, at
  ``MLFLOW_TRACKING_URI`` when set, else in a local file store ``RUN/mlruns``. The config
  is logged as params, the same values as metrics, and the PNGs, ``summary.md`` and
  ``config.toml`` as artifacts. A resumed run continues the same MLflow run.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from fedexlora.run.layout import RunLayout

__all__ = ["REPORTERS", "Trackers", "open_trackers", "row_scalars"]

REPORTERS = ("tensorboard", "mlflow")
EXPERIMENT = "fedex-lora"


def row_scalars(row: dict) -> dict[str, float]:
    """The values one ``metrics.jsonl`` row reports, flat: metrics, loss, bytes, deviations."""
    out: dict[str, float] = {}
    for k, v in row.get("metrics", {}).items():
        out[k] = v
    out["train_loss"] = row.get("train_loss")
    for k in ("bytes_up", "bytes_down", "seconds"):
        out[k] = row.get(k)
    for k in ("mean", "max"):
        out[f"deviation_{k}"] = row.get("deviation", {}).get(k)
        out[f"effective_deviation_{k}"] = row.get("effective_deviation", {}).get(k)
    return {
        k: float(v)
        for k, v in out.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class Trackers:
    """The trackers of one run; every method is a no-op when none is configured."""

    def __init__(self, names: list[str], out_dir: Path, config: dict, resume: bool):
        self.names = list(names)
        self.out = Path(out_dir)
        self.layout = RunLayout(self.out)
        self._tb = None
        self._ml = None
        self._ml_run = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.layout.tensorboard))
            if not resume:
                self._tb.add_text("config", _as_code(config))
        if "mlflow" in self.names:
            self._open_mlflow(config, resume)

    def _open_mlflow(self, config: dict, resume: bool) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # Our default: a file store inside the run directory. MLflow 3 keeps file
            # stores in maintenance mode and refuses them unless this is set.
            uri = self.layout.mlruns.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        id_file = self.layout.mlflow_run_id
        try:
            client = MlflowClient(tracking_uri=uri)
            if resume and id_file.is_file():
                run_id = id_file.read_text().strip()
                client.update_run(run_id, status="RUNNING")
            else:
                exp = client.get_experiment_by_name(EXPERIMENT)
                exp_id = exp.experiment_id if exp else client.create_experiment(EXPERIMENT)
                run_id = client.create_run(exp_id, run_name=self.out.name).info.run_id
                id_file.write_text(run_id + "\n")
                for k, v in sorted(config.items()):
                    client.log_param(run_id, k, str(v)[:500])
        except Exception as exc:  # MlflowException, OSError, a bad URI scheme...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--report-to mlflow: cannot log to {uri!r}: {first}") from None
        self._ml, self._ml_run = client, run_id

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run this run logs to, if any."""
        return self._ml_run

    def log_row(self, row: dict) -> None:
        """Logs one round of one method."""
        if not self.names:
            return
        method, step = row["method"], int(row["round"])
        values = row_scalars(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(f"{method}/{k}", v, step)
            self._tb.flush()
        if self._ml is not None:
            for k, v in values.items():
                self._ml.log_metric(self._ml_run, f"{method}/{k}", v, step=step)

    def finish(self) -> None:
        """Adds the summary and plots, and closes every tracker."""
        summary = self.layout.summary
        if self._tb is not None:
            if summary.is_file():
                self._tb.add_text("summary", summary.read_text())
            self._tb.close()
            self._tb = None
        if self._ml is not None:
            for p in [summary, self.layout.config, *sorted(self.out.glob("*.png"))]:
                if p.is_file():
                    self._ml.log_artifact(self._ml_run, str(p))
            self._ml.set_terminated(self._ml_run)
            self._ml = None


def _as_code(config: dict) -> str:
    lines = [f"{k} = {v!r}" for k, v in sorted(config.items())]
    return "    " + "\n    ".join(lines)  # markdown code block in TensorBoard's text tab


def open_trackers(cfg, out_dir, resume: bool = False) -> Trackers:
    """The trackers ``cfg.report_to`` names (none by default)."""
    return Trackers(list(cfg.report_to or []), Path(out_dir), cfg.to_dict(), resume)
