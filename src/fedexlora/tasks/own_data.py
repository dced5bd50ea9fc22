"""A client's own training rows, read from its own file onto the run's task.

A client that holds its data itself trains on the rows of its own file, never on a slice of
the run's task:

- ``--client-data DIR`` (a run on one machine: the in-process engine, a Flower
  simulation): client ``i`` reads ``DIR/<i>.jsonl`` (or ``.csv``, ``.json``);
- ``--node-config data=PATH`` (a Flower SuperNode): the node reads its own ``PATH``, which
  the server never sees.

The run's task still gives what every client shares: the test split, the classes (a row's
``label`` names one of the task's classes, as its ``partitions.txt`` spells them) and the
prompt layout of a causal-LM task. A file has the columns of a ``--task FILE``:
``text`` and ``label`` (and ``text_pair`` where the task has one), or ``prompt`` and
``response``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets

from fedexlora.tasks.base import Task
from fedexlora.tasks.data import _FILE_SUFFIXES, _check_texts, _int_label, _read_rows

__all__ = ["client_files", "clients_own_rows", "own_rows", "parts_by_client", "rows_digest"]


def own_rows(path: str | Path, task: Task) -> datasets.Dataset:
    """The training rows of one client's own file, in the columns of ``task``'s splits.

    Args:
        path: A ``.csv``, ``.jsonl`` or ``.json`` file.
        task: The run's task: its kind, its classes and whether it has a ``text_pair``.

    Returns:
        A dataset of ``text`` (, ``text_pair``) and ``label`` (the task's class ids), or of
        ``prompt`` and ``response``.

    Raises:
        ValueError: Naming the file and its problem: not found, not UTF-8, empty, a missing
            column, or a label that is not one of the task's classes; or a task whose kind
            takes no own data (regression).
    """
    path = Path(path).expanduser()
    where = f"client data file {str(path)!r}"
    if path.suffix.lower() not in _FILE_SUFFIXES:
        raise ValueError(f"{where} must be a .csv, .jsonl or .json file")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{where} is empty (no rows)")
    present = sorted({str(k) for row in rows for k in row if k is not None})
    if task.kind == "classification":
        need = ["text", *(["text_pair"] if task.text_pair else []), "label"]
    elif task.kind == "causal_lm":
        need = ["prompt", "response"]
    else:
        raise ValueError(
            f"task {task.name!r} is {task.kind}; a client's own data file takes a "
            "classification or causal-LM task"
        )
    if task.kind == "classification" and not task.text_pair and "text_pair" in present:
        raise ValueError(
            f"{where} has a 'text_pair' column, and the run's task {task.name!r} has single "
            "texts: its pairs would be left out; drop the column or choose a pair task"
        )
    missing = [k for k in need if k not in present]
    if missing:
        raise ValueError(
            f"{where} has columns {present} and lacks {missing}; the run's task "
            f"{task.name!r} ({task.kind}) needs {need}"
        )
    columns: dict[str, list] = {}
    for key in need:
        values = []
        for i, row in enumerate(rows):
            value = row.get(key)
            if value is None or (key == "label" and not str(value).strip()):
                raise ValueError(f"{where}: row {i} has no value for {key!r}")
            if isinstance(value, (list, dict)):
                raise ValueError(
                    f"{where}: row {i}'s {key!r} is a JSON {type(value).__name__}, expected "
                    "a string"
                )
            values.append(value if key == "label" else str(value))
        if key != "label":
            _check_texts(values, key, path)
        columns[key] = values
    if task.kind == "causal_lm":
        features = datasets.Features({k: datasets.Value("string") for k in need})
        return datasets.Dataset.from_dict(columns, features=features)
    index = {name: i for i, name in enumerate(task.label_names)}
    labels = []
    for i, value in enumerate(columns["label"]):
        name = str(value).strip()
        number = _int_label(value)  # 1.0, "1" or true for the class named "1"
        if name not in index and number is not None and str(number) in index:
            name = str(number)
        if name not in index:
            raise ValueError(
                f"{where}: row {i} has label {value!r}, which is not one of the task's "
                f"classes {task.label_names} (a label is written as its class's name)"
            )
        labels.append(index[name])
    columns["label"] = labels
    feats = {k: datasets.Value("string") for k in need if k != "label"}
    feats["label"] = datasets.ClassLabel(names=list(task.label_names))
    return datasets.Dataset.from_dict(columns, features=datasets.Features(feats))


def client_files(directory: str | Path, num_clients: int) -> list[Path]:
    """Each client's own file in ``directory``: ``<i>.jsonl``, ``<i>.csv`` or ``<i>.json``.

    Raises:
        ValueError: If ``directory`` is not a directory, a client has no file or two, or a
            file is there for a client the run does not have (its rows would be left out).
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"`client_data` {str(directory)!r} is not a directory")
    numbered = [
        f
        for f in root.iterdir()
        if f.suffix.lower() in _FILE_SUFFIXES and f.stem.isascii() and f.stem.isdigit()
    ]
    odd = sorted(f.name for f in numbered if f.stem != str(int(f.stem)))
    if odd:  # 01.jsonl: client 1's file, or a typo? It would be left out
        raise ValueError(
            f"`client_data` {str(directory)!r} has {', '.join(odd)}: name a client's file by "
            "its number alone (1.jsonl, not 01.jsonl)"
        )
    files = []
    for i in range(num_clients):
        found = [root / f"{i}{s}" for s in _FILE_SUFFIXES if (root / f"{i}{s}").is_file()]
        if not found:
            raise ValueError(
                f"`client_data` {str(directory)!r} has no file for client {i}; expected "
                f"{i}.jsonl, {i}.csv or {i}.json (one file per client, 0 .. {num_clients - 1})"
            )
        if len(found) > 1:
            raise ValueError(
                f"`client_data` {str(directory)!r} has {len(found)} files for client {i} "
                f"({', '.join(f.name for f in found)}); keep one"
            )
        files.append(found[0])
    beyond = sorted(f.name for f in numbered if int(f.stem) >= num_clients)
    if beyond:
        raise ValueError(
            f"`client_data` {str(directory)!r} has files for clients beyond --num-clients "
            f"{num_clients} ({', '.join(beyond)}); their rows would be left out: raise "
            "--num-clients or move them"
        )
    return files


def clients_own_rows(directory: str | Path, num_clients: int, task: Task) -> datasets.Dataset:
    """Every client's own rows, one client after another, each row's ``client`` beside it.

    Raises:
        ValueError: As :func:`client_files` and :func:`own_rows`.
    """
    sets = []
    for i, path in enumerate(client_files(directory, num_clients)):
        rows = own_rows(path, task)
        sets.append(rows.add_column("client", [i] * len(rows)))
    return datasets.concatenate_datasets(sets)


def parts_by_client(rows: datasets.Dataset, num_clients: int) -> list[list[int]]:
    """Each client's indices into :func:`clients_own_rows`'s rows."""
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for index, client in enumerate(rows["client"]):
        parts[client].append(index)
    return parts


def rows_digest(rows: datasets.Dataset) -> str:
    """A digest of the clients' rows (:func:`clients_own_rows`).

    The run's ``partitions.txt`` keeps it: a resume or an export refuses files that
    changed since.
    """
    text = json.dumps(rows.to_dict(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
