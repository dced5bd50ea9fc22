"""--report-to tensorboard,mlflow: every round read back with each library's own reader."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app
from fedexlora.run.report import read_metrics

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed")

runner = CliRunner()


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of a run's TensorBoard logs: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _run(tiny_bert_dir, tiny_csv, out, *extra, env=None):
    return runner.invoke(
        app,
        [
            "run",
            "--model",
            tiny_bert_dir,
            "--task",
            tiny_csv,
            "--min-partition-size",
            "5",
            "--method",
            "fedex,fedit",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--rank",
            "2",
            "--max-length",
            "16",
            "--max-test",
            "20",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ],  # fmt: skip
        env={"COLUMNS": "300", **(env or {})},
    )


def _expected(rows):
    for r in rows:
        m, k = r["method"], r["round"]
        yield f"{m}/accuracy", k, r["metrics"]["accuracy"]
        yield f"{m}/train_loss", k, r["train_loss"]
        yield f"{m}/bytes_up", k, r["bytes_up"]
        yield f"{m}/bytes_down", k, r["bytes_down"]
        yield f"{m}/deviation_mean", k, r["deviation"]["mean"]
        yield f"{m}/deviation_max", k, r["deviation"]["max"]
        yield f"{m}/effective_deviation_max", k, r["effective_deviation"]["max"]


def test_report_to_tensorboard_and_mlflow(tiny_bert_dir, tiny_csv, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    res = _run(tiny_bert_dir, tiny_csv, out, "--report-to", "tensorboard,mlflow")
    assert res.exit_code == 0, res.output
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 4

    tb = tensorboard_scalars(out)
    for tag, step, value in _expected(rows):
        assert tb[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-7), tag

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = (out / "mlflow_run_id.txt").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["lr"] == "0.001" and run.data.params["methods"] == "['fedex', 'fedit']"
    for tag, step, value in _expected(rows):
        hist = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        assert hist[step] == pytest.approx(value, rel=1e-9), tag
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.md", "config.toml", "metrics.png", "deviation.png"} <= arts

    # a resume continues the same MLflow run and adds the new rounds
    res = runner.invoke(app, ["run", "--resume", str(out), "--rounds", "3", "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = read_metrics(out / "metrics.jsonl")
    assert (out / "mlflow_run_id.txt").read_text().strip() == run_id
    hist = {m.step: m.value for m in client.get_metric_history(run_id, "fedit/accuracy")}
    assert sorted(hist) == [1, 2, 3]
    last = [r for r in rows if r["method"] == "fedit"][-1]
    assert hist[3] == pytest.approx(last["metrics"]["accuracy"])
    assert tensorboard_scalars(out)["fedex/accuracy"].keys() == {1, 2, 3}


def test_mlflow_tracking_uri_is_honoured(tiny_bert_dir, tiny_csv, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's choice of store
    out = tmp_path / "run"
    res = _run(tiny_bert_dir, tiny_csv, out, "--report-to", "mlflow")
    assert res.exit_code == 0, res.output
    assert not (out / "mlruns").exists() and not (out / "tensorboard").exists()
    client = MlflowClient(tracking_uri=store)
    (exp,) = [e for e in client.search_experiments() if e.name == "fedex-lora"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == (out / "mlflow_run_id.txt").read_text().strip()
    assert len(client.get_metric_history(run.info.run_id, "fedex/accuracy")) == 2


def test_nothing_is_tracked_by_default(tiny_bert_dir, tiny_csv, tmp_path):
    res = _run(tiny_bert_dir, tiny_csv, tmp_path / "run", "--rounds", "1")
    assert res.exit_code == 0, res.output
    for name in ("tensorboard", "mlruns", "mlflow_run_id.txt"):
        assert not (tmp_path / "run" / name).exists()


def test_report_to_errors_are_one_line(tmp_path, monkeypatch):
    import importlib.util

    res = runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--report-to", "wandb"])
    assert res.exit_code == 2 and "`--report-to`: unknown 'wandb'; choose from" in res.output
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a)
    )
    res = runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--report-to", "mlflow"],
                        env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "needs mlflow, which is not installed; fix: pip install 'fedex-lora[mlflow]'" in (
        " ".join(res.output.split())
    )
    assert not (tmp_path / "o").exists()


def test_unusable_mlflow_store_is_one_line(tiny_bert_dir, tiny_csv, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus-scheme://nowhere")
    res = _run(tiny_bert_dir, tiny_csv, tmp_path / "run", "--report-to", "mlflow")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--report-to mlflow: cannot log to 'bogus-scheme://nowhere':" in res.output
