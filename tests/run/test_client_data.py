"""A run on its clients' own files (``--client-data``): the rows it began with, held to
them across a resume and an export; each client's file checked on its own."""

import json

import pytest

from fedexlora.run.export import export_model
from fedexlora.run.inprocess import run_experiment
from fedexlora.run.layout import RunError


def _own(tmp_path, labels_per_client):
    own = tmp_path / "own"
    own.mkdir()
    for i, labels in enumerate(labels_per_client):
        rows = [{"text": f"goal match vote shares {j}", "label": y} for j, y in enumerate(labels)]
        (own / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return own


def test_a_resume_or_an_export_on_changed_files_is_refused(tiny_cfg, tmp_path):
    own = _own(tmp_path, [["sport", "business"] * 4, ["politics"] * 6, ["sport"] * 5])
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1, client_data=str(own))
    run_experiment(cfg.validate(), tmp_path / "run", progress=False)
    assert "rows digest" in (tmp_path / "run" / "partitions.txt").read_text()
    (own / "1.jsonl").write_text(json.dumps({"text": "another text", "label": "sport"}) + "\n")
    more = cfg.replace(rounds=2).validate()
    with pytest.raises(RunError, match=r"the clients' files changed since the run began"):
        run_experiment(more, tmp_path / "run", resume=True, progress=False)
    with pytest.raises(RunError, match=r"the clients' files changed since the run began"):
        export_model(tmp_path / "run", tmp_path / "export")
    (own / "1.jsonl").write_text("".join(
        json.dumps({"text": f"goal match vote shares {j}", "label": "politics"}) + "\n"
        for j in range(6)
    ))  # fmt: skip
    rows = run_experiment(more, tmp_path / "run", resume=True, progress=False)  # restored
    assert [r["round"] for r in rows] == [1, 2]


def test_each_clients_causal_file_must_leave_an_answer_within_max_length(
    tiny_cfg, tiny_llama_dir, tiny_qa_jsonl, tmp_path
):
    """Pooled, most rows keep an answer; client 1's file alone keeps none: its batches
    would have no loss. It is refused by name."""
    own = tmp_path / "own"
    own.mkdir()
    short = [{"prompt": "1 plus 1?", "response": "2"}] * 6
    long = [{"prompt": " ".join(["word"] * 40) + "?", "response": "2"}] * 2
    for i, rows in enumerate([short, long, short]):
        (own / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg.replace(
        model=tiny_llama_dir, task=tiny_qa_jsonl, methods=["fedex"], rounds=1, local_steps=1,
        max_length=16, target_modules=["q_proj", "v_proj"], client_data=str(own),
    ).validate()  # fmt: skip
    with pytest.raises(ValueError, match=r"client 1's file: every training example's prompt"):
        run_experiment(cfg, tmp_path / "run", progress=False)
