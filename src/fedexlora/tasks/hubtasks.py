"""The tasks behind the paper's tables, loaded by name, or from a local copy in the same layout.

* GLUE (``nyu-mll/glue``), GSM8K (``openai/gsm8k``) and MATH (``EleutherAI/hendrycks_math``)
  come from the Hugging Face hub.
* E2E NLG (``tuetschek/e2e_nlg``) comes from the hub's parquet conversion of that dataset.
* The commonsense-170k mixture and its eight evaluation sets come from the LLM-Adapters
  repository (``AGI-Edgerunners/LLM-Adapters``), in its own JSON files, as the authors of
  FedEx-LoRA and Fed-SB download them.
* MetaMathQA (``meta-math/MetaMathQA``), whose first 20,000 examples train the GSM8K and
  MATH recipes, comes from the hub.

A local copy lives under ``DATA_DIR/<owner>/<name>/`` in the source's own file layout
(``--data-dir`` or ``FEDEXLORA_DATA_DIR``); anything not found there is fetched by name.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from fedexlora.tasks.base import _CALCULATOR, _CAUSAL_METRICS, GLUE_TASKS, Task
from fedexlora.tasks.metrics import extract_boxed, extract_final_number

__all__ = [
    "COMMONSENSE_TASKS",
    "HUB_DATASETS",
    "MATH_SUBJECTS",
    "METAMATH_TRAIN",
    "commonsense_tasks",
    "load_commonsense",
    "load_e2e",
    "load_glue",
    "load_gsm8k_full",
    "load_math",
    "load_metamath",
    "math_subjects",
]

HUB_DATASETS = {
    "glue": "nyu-mll/glue",
    "gsm8k-full": "openai/gsm8k",
    "math": "EleutherAI/hendrycks_math",
    "e2e_nlg": "tuetschek/e2e_nlg",
    "commonsense": "AGI-Edgerunners/LLM-Adapters",
    "metamath": "meta-math/MetaMathQA",
}
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
# The eight evaluation sets, as LLM-Adapters names its folders (the paper's table order)
COMMONSENSE_TASKS = (
    "boolq",
    "piqa",
    "social_i_qa",
    "hellaswag",
    "winogrande",
    "ARC-Easy",
    "ARC-Challenge",
    "openbookqa",
)
COMMONSENSE_TRAIN = "ft-training_set/commonsense_170k.json"
METAMATH_TRAIN = 20_000  # the paper (and Fed-SB) train on MetaMathQA's first 20k examples
METAMATH_FILE = "MetaMathQA-395K.json"
_RAW_GITHUB = "https://raw.githubusercontent.com/{repo}/main/{path}"


def _root(data_dir) -> Path | None:
    root = data_dir if data_dir is not None else os.environ.get("FEDEXLORA_DATA_DIR")
    return Path(root) if root else None


def _hub(
    task: str, repo: str, config: str | None, data_dir, *, revision: str | None = None
) -> datasets.DatasetDict:
    """A hub dataset, from a local copy when there is one, else by name.

    The copy is ``<data_dir>/<repo>/<config>`` in the hub's own file layout (e.g.
    parquet shards named by split, or one folder per split).
    """
    root = _root(data_dir)
    local = root / repo if root else None
    if local is not None and local.is_dir():
        sub = local / config if config else local
        if not sub.is_dir():
            raise ValueError(
                f"task {task!r}: {str(local)!r} holds no {config!r} folder; lay the files "
                f"out as on the hub ({repo}/{config}/<split>-*.parquet)"
            )
        try:
            return datasets.load_dataset(str(local), data_dir=config)
        except Exception as err:  # a local copy that does not parse
            raise ValueError(
                f"task {task!r}: cannot read the local copy {str(sub)!r}: "
                f"{type(err).__name__}: {err}"
            ) from err
    try:
        if revision is not None:
            return datasets.load_dataset(repo, config, revision=revision)
        return datasets.load_dataset(repo, config)
    except Exception as err:  # any failure here means the data could not be fetched
        raise ValueError(
            f"task {task!r} needs the Hugging Face dataset {repo!r}"
            + (f" (subset {config!r})" if config else "")
            + f", and loading it failed: {type(err).__name__}: {err}. Run online once, or "
            f"put a copy in the hub's file layout under --data-dir DIR (DIR/{repo}/"
            f"{config or ''}), or use 'bbc-news', 'gsm8k' or a local .csv/.jsonl file"
        ) from err


def _github_json(task: str, repo: str, path: str, data_dir) -> list[dict]:
    """A JSON file of a GitHub repository: ``<data_dir>/<repo>/<path>``, else downloaded.

    A download is kept in ``~/.cache/fedexlora/<repo>/<path>`` and read from there after.
    """
    root = _root(data_dir)
    local = root / repo / path if root else None
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedexlora"
    if local is None or not local.is_file():
        if root is not None and (root / repo).is_dir():
            raise ValueError(
                f"task {task!r}: the local copy {str(root / repo)!r} has no {path!r}; lay "
                f"the files out as in the {repo} repository"
            )
        local = cache / repo / path
    if not local.is_file():
        url = _RAW_GITHUB.format(repo=repo, path=path)
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_suffix(".part")
            with urllib.request.urlopen(url, timeout=60) as resp, tmp.open("wb") as fh:
                size = int(resp.headers.get("Content-Length") or 0) or None
                with tqdm(total=size, unit="B", unit_scale=True, desc=path, leave=False) as bar:
                    while chunk := resp.read(1 << 20):
                        fh.write(chunk)
                        bar.update(len(chunk))
            tmp.replace(local)
        except Exception as err:  # offline, or the file moved
            raise ValueError(
                f"task {task!r} needs {path!r} from github.com/{repo}, and downloading "
                f"{url} failed: {type(err).__name__}: {err}. Put a copy in the repository's "
                f"layout under --data-dir DIR (DIR/{repo}/{path})"
            ) from err
    try:
        rows = json.loads(local.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"task {task!r}: cannot read {str(local)!r}: {err}") from err
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"task {task!r}: {str(local)!r} is not a JSON list of objects")
    return rows


def _causal(name, train, test, *, answer_style="number", template="qa", generation=None):
    metrics = ["bleu", "nist", "meteor", "rouge_l", "cider"] if answer_style == "nlg" else None
    if answer_style == "choice":
        metrics = ["accuracy"]
    return Task(
        name,
        "causal_lm",
        train,
        test,
        0,
        [],
        list(metrics or _CAUSAL_METRICS),
        answer_style=answer_style,
        template=template,
        generation=dict(generation or {}),
    )


def load_gsm8k_full(*, seed: int, data_dir) -> Task:
    """GSM8K's own splits (7,473 train / 1,319 test), ``openai/gsm8k`` subset ``main``."""
    return _causal("gsm8k-full", _gsm8k_split("train", data_dir).shuffle(seed=seed),
                   _gsm8k_split("test", data_dir).shuffle(seed=seed))  # fmt: skip


def _gsm8k_split(split: str, data_dir) -> datasets.Dataset:
    raw = _hub("gsm8k-full", HUB_DATASETS["gsm8k-full"], "main", data_dir)
    cols: dict[str, list[str]] = {"prompt": [], "response": [], "answer": []}
    for row in raw[split]:
        response = _CALCULATOR.sub("", str(row["answer"])).strip()
        answer = extract_final_number(response)
        if answer is None:
            raise ValueError(f"task 'gsm8k-full': no final number in {response[-60:]!r}")
        cols["prompt"].append(str(row["question"]).strip())
        cols["response"].append(response)
        cols["answer"].append(answer)
    return datasets.Dataset.from_dict(cols)


def math_subjects(key: str) -> list[str]:
    """The MATH subjects of task ``math`` (all) or ``math/<subject>`` (one).

    Raises:
        ValueError: For a subject MATH does not have.
    """
    subject = key.partition("/")[2]
    if subject and subject not in MATH_SUBJECTS:
        raise ValueError(
            f"unknown MATH subject {subject!r} in task {key!r}; choose from "
            f"{', '.join(MATH_SUBJECTS)}"
        )
    return [subject] if subject else list(MATH_SUBJECTS)


def commonsense_tasks(key: str) -> list[str]:
    """The tasks of ``commonsense`` (all eight) or ``commonsense/<task>`` (one).

    Raises:
        ValueError: For a task commonsense-170k does not have.
    """
    only = key.partition("/")[2]
    names = {t.lower(): t for t in COMMONSENSE_TASKS}
    if only and only.lower() not in names:
        raise ValueError(
            f"unknown commonsense task {only!r}; choose from {', '.join(COMMONSENSE_TASKS)}"
        )
    return [names[only.lower()]] if only else list(COMMONSENSE_TASKS)


def _math_split(key: str, split: str, data_dir) -> datasets.Dataset:
    subjects = math_subjects(key)
    cols: dict[str, list[str]] = {"prompt": [], "response": [], "answer": []}
    for sub in subjects:
        raw = _hub(key, HUB_DATASETS["math"], sub, data_dir)
        for row in raw[split]:
            answer = extract_boxed(row["solution"])
            if answer is None:
                continue  # a handful of MATH solutions box nothing: not gradable
            cols["prompt"].append(str(row["problem"]).strip())
            cols["response"].append(str(row["solution"]).strip())
            cols["answer"].append(answer)
    return datasets.Dataset.from_dict(cols)


def load_math(key: str, *, seed: int, data_dir) -> Task:
    r"""MATH (Hendrycks et al.), every subject or ``math/<subject>``.

    The answer is the solution's last ``\\boxed{}``.
    """
    return _causal(key, _math_split(key, "train", data_dir).shuffle(seed=seed),
                   _math_split(key, "test", data_dir).shuffle(seed=seed),
                   answer_style="boxed")  # fmt: skip


def load_metamath(key: str, *, seed: int, data_dir) -> Task:
    """``metamath-gsm8k`` / ``metamath-math``: train on MetaMathQA, test on GSM8K or MATH.

    The training set is MetaMathQA's first 20,000 examples in file order (its ``query``
    and ``response``), as the paper and Fed-SB take them; the test set is GSM8K's or
    MATH's own. Prompts use the Alpaca template that MetaMath was trained with.
    """
    target = key.removeprefix("metamath-")
    raw = _hub(key, HUB_DATASETS["metamath"], None, data_dir)
    split = raw["train"] if "train" in raw else next(iter(raw.values()))
    split = split.select(range(min(METAMATH_TRAIN, len(split))))
    missing = {"query", "response"} - set(split.column_names)
    if missing:
        raise ValueError(f"task {key!r}: MetaMathQA copy lacks columns {sorted(missing)}")
    answers = [extract_final_number(r) or "" for r in split["response"]]
    train = datasets.Dataset.from_dict(
        {"prompt": [str(q).strip() for q in split["query"]],
         "response": [str(r).strip() for r in split["response"]], "answer": answers}
    ).shuffle(seed=seed)  # fmt: skip
    if target == "gsm8k":
        test, style = _gsm8k_split("test", data_dir), "number"
    else:
        test, style = _math_split("math", "test", data_dir), "boxed"
    return _causal(key, train, test.shuffle(seed=seed), answer_style=style, template="alpaca")


def load_glue(sub: str, *, seed: int, data_dir=None) -> Task:
    """One GLUE task; its validation split is the test split."""
    text_col, pair_col, metrics, kind = GLUE_TASKS[sub]
    raw = _hub(sub, HUB_DATASETS["glue"], sub, data_dir)

    rename = {text_col: "text"}
    if pair_col is not None:
        rename[pair_col] = "text_pair"
    keep = [*rename, "label"]

    def prepare(split: datasets.Dataset) -> datasets.Dataset:
        split = split.select_columns(keep).rename_columns(rename)
        return split.shuffle(seed=seed)

    train, test = prepare(raw["train"]), prepare(raw["validation"])
    if kind == "regression":
        num_labels, label_names = 1, ["score"]
    else:
        label_names = list(getattr(train.features["label"], "names", None) or ["0", "1"])
        num_labels = len(label_names)
    return Task(
        name=sub,
        kind=kind,
        train=train,
        test=test,
        num_labels=num_labels,
        label_names=label_names,
        metric_names=list(metrics),
        text_pair=pair_col is not None,
    )


# E2E decoding as in the LoRA paper's GPT-2 runs, which FedEx-LoRA follows
E2E_GENERATION = {"no_repeat_ngram_size": 4, "length_penalty": 0.8}


def load_e2e(*, seed: int, data_dir) -> Task:
    """E2E NLG: a restaurant's meaning representation to a sentence about it.

    Train on every (MR, reference) pair of the train split. The test set has one row per
    distinct MR, in first-seen order, with all its human references: BLEU, NIST, METEOR,
    ROUGE-L and CIDEr score a generation against all of them, as the E2E challenge does.
    From ``tuetschek/e2e_nlg`` (the hub's parquet conversion, subset ``default``).
    """
    from fedexlora.tasks.nlg_metrics import check_installed

    check_installed()  # before training, not after it
    raw = _hub("e2e_nlg", HUB_DATASETS["e2e_nlg"], "default", data_dir,
               revision="refs/convert/parquet")  # fmt: skip
    for split in ("train", "test"):
        if split not in raw:
            raise ValueError(f"task 'e2e_nlg': the data has no {split!r} split")
        missing = {"meaning_representation", "human_reference"} - set(raw[split].column_names)
        if missing:
            raise ValueError(f"task 'e2e_nlg': the {split} split lacks columns {sorted(missing)}")
    tr = raw["train"]
    train = datasets.Dataset.from_dict(
        {"prompt": [str(m).strip() for m in tr["meaning_representation"]],
         "response": [str(r).strip() for r in tr["human_reference"]]}
    ).shuffle(seed=seed)  # fmt: skip
    grouped: dict[str, list[str]] = {}
    for mr, ref in zip(raw["test"]["meaning_representation"], raw["test"]["human_reference"],
                       strict=True):  # fmt: skip
        grouped.setdefault(str(mr).strip(), []).append(str(ref).strip())
    test = datasets.Dataset.from_dict(
        {"prompt": list(grouped), "response": [refs[0] for refs in grouped.values()],
         "references": list(grouped.values())}
    )  # fmt: skip
    return _causal("e2e_nlg", train, test, answer_style="nlg", template="e2e",
                   generation=E2E_GENERATION)  # fmt: skip


def load_commonsense(key: str, *, seed: int, data_dir) -> Task:
    """Commonsense: train on commonsense-170k, test on eight tasks.

    The tests are BoolQ, PIQA, SIQA, HellaSwag, WinoGrande, ARC-e, ARC-c and OBQA, each
    row marked with its task (``group``).

    ``commonsense/<task>`` tests on one of the eight only. Files and fields as in
    LLM-Adapters: ``instruction``, ``input``, ``output``, ``answer``. The answer a model
    gives is the first of the task's answer words in its generation (``true``/``false``,
    ``solution1``..., ``answer1``..., ``ending1``..., ``option1``...), as LLM-Adapters'
    evaluation reads it.
    """
    repo = HUB_DATASETS["commonsense"]
    tasks = commonsense_tasks(key)

    def columns(rows, where, group=None):
        cols: dict[str, list[str]] = {"prompt": [], "response": [], "answer": []}
        if group:
            cols["group"] = []
        for i, row in enumerate(rows):
            if "instruction" not in row or "answer" not in row:
                raise ValueError(f"task {key!r}: {where} item {i} lacks 'instruction'/'answer'")
            prompt = str(row["instruction"]).strip()
            if str(row.get("input") or "").strip():
                prompt += "\n\n" + str(row["input"]).strip()
            cols["prompt"].append(prompt)
            cols["response"].append(str(row.get("output") or row["answer"]).strip())
            cols["answer"].append(str(row["answer"]).strip().lower())
            if group:
                cols["group"].append(group)
        return cols

    train = datasets.Dataset.from_dict(
        columns(_github_json(key, repo, COMMONSENSE_TRAIN, data_dir), COMMONSENSE_TRAIN)
    ).shuffle(seed=seed)
    parts = []
    for t in tasks:
        path = f"dataset/{t}/test.json"
        parts.append(datasets.Dataset.from_dict(
            columns(_github_json(key, repo, path, data_dir), path, group=t.lower())))  # fmt: skip
    test = datasets.concatenate_datasets(parts).shuffle(seed=seed)
    return _causal(key, train, test, answer_style="choice", template="alpaca")
