"""A client's own data file, read onto the run's task (``--client-data``, a node's ``data``)."""

import json

import pytest

from fedexlora.tasks.data import load_task
from fedexlora.tasks.own_data import client_files, clients_own_rows, own_rows, parts_by_client


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def topics(tiny_csv):
    return load_task(tiny_csv, seed=0)  # classes business, politics, sport


def test_a_files_labels_are_the_tasks_classes_by_name(topics, tmp_path):
    path = _write(tmp_path / "0.jsonl", [
        {"text": "goal match", "label": "sport"},
        {"text": "vote party", "label": " politics "},
        {"text": "shares bank", "label": "business"},
    ])  # fmt: skip
    rows = own_rows(path, topics)
    assert rows["text"] == ["goal match", "vote party", "shares bank"]
    names = topics.label_names
    assert [names[i] for i in rows["label"]] == ["sport", "politics", "business"]
    assert rows.features["label"].names == names


def test_a_label_outside_the_tasks_classes_is_refused_by_row(topics, tmp_path):
    path = _write(tmp_path / "0.jsonl", [
        {"text": "goal match", "label": "sport"},
        {"text": "a new phone", "label": "tech"},
    ])  # fmt: skip
    with pytest.raises(ValueError, match=r"0\.jsonl'?: row 1 has label 'tech', which is not one"):
        own_rows(path, topics)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"text": "goal"}], r"lacks \['label'\]"),
        ([{"prompt": "1+1?", "response": "2"}], r"lacks \['text', 'label'\]"),
        ([{"text": "goal", "label": ""}], r"row 0 has no value for 'label'"),
        ([], r"is empty"),
        ([{"text": "goal", "text_pair": "cup", "label": "sport"}], r"has a 'text_pair' column"),
    ],
)
def test_a_file_that_does_not_fit_the_task_is_refused(topics, tmp_path, rows, match):
    path = tmp_path / "0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=match):
        own_rows(path, topics)


def test_a_causal_tasks_rows_are_prompts_and_responses(tiny_qa_jsonl, tmp_path):
    task = load_task(tiny_qa_jsonl, seed=0)
    path = _write(tmp_path / "1.jsonl", [{"prompt": "what is 2 plus 2?", "response": "4"}])
    rows = own_rows(path, task)
    assert rows.column_names == ["prompt", "response"] and rows["response"] == ["4"]
    with pytest.raises(ValueError, match=r"lacks \['prompt', 'response'\]"):
        own_rows(_write(tmp_path / "2.jsonl", [{"text": "a", "label": "b"}]), task)


def test_a_directory_holds_one_file_per_client_and_no_more(topics, tmp_path):
    _write(tmp_path / "0.jsonl", [{"text": "goal", "label": "sport"}])
    (tmp_path / "1.csv").write_text("text,label\nvote,politics\nshares,business\n")
    assert [p.name for p in client_files(tmp_path, 2)] == ["0.jsonl", "1.csv"]
    rows = clients_own_rows(tmp_path, 2, topics)
    assert rows["client"] == [0, 1, 1] and parts_by_client(rows, 2) == [[0], [1, 2]]
    with pytest.raises(ValueError, match=r"has no file for client 2; expected 2\.jsonl"):
        client_files(tmp_path, 3)
    with pytest.raises(ValueError, match=r"beyond --num-clients 1 \(1\.csv\)"):
        client_files(tmp_path, 1)
    _write(tmp_path / "1.jsonl", [{"text": "vote", "label": "politics"}])
    with pytest.raises(ValueError, match=r"has 2 files for client 1 \(1\.csv, 1\.jsonl\)"):
        client_files(tmp_path, 2)
    with pytest.raises(ValueError, match=r"is not a directory"):
        client_files(tmp_path / "0.jsonl", 1)


def test_a_label_written_as_a_number_names_its_class_and_odd_values_are_refused(tmp_path):
    from fedexlora.tasks.data import load_task

    csv = tmp_path / "task.csv"
    csv.write_text("text,label\n" + "".join(f"t{i},{i % 2}\n" for i in range(20)))
    task = load_task(str(csv), seed=0)  # classes "0" and "1"
    rows = own_rows(_write(tmp_path / "0.jsonl", [
        {"text": "a", "label": 1.0}, {"text": "b", "label": "0"}, {"text": "c", "label": True},
    ]), task)  # fmt: skip
    assert rows["label"] == [1, 0, 1]
    with pytest.raises(ValueError, match=r"row 0's 'text' is a JSON list, expected a string"):
        own_rows(_write(tmp_path / "1.jsonl", [{"text": ["a"], "label": 1}]), task)


def test_a_file_named_with_a_leading_zero_is_refused(topics, tmp_path):
    for name in ("0.jsonl", "01.jsonl"):
        _write(tmp_path / name, [{"text": "goal", "label": "sport"}])
    with pytest.raises(ValueError, match=r"has 01\.jsonl: name a client's file by its number"):
        client_files(tmp_path, 2)


def test_an_unreadable_file_is_named(topics, tmp_path, monkeypatch):
    from pathlib import Path

    path = _write(tmp_path / "0.jsonl", [{"text": "goal", "label": "sport"}])

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ValueError, match=r"0\.jsonl' cannot be read: Permission denied"):
        own_rows(path, topics)
