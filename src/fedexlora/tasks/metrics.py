"""Task metrics: accuracy, F1, Matthews correlation, Pearson, and exact match on numbers.

Plain numpy, no scikit-learn. Used by :mod:`fedexlora.training` to evaluate the global
model and by :mod:`fedexlora.tasks.data` for its task definitions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "MetricTask",
    "compute_metrics",
    "exact_match",
    "choice_accuracy",
    "extract_boxed",
    "extract_choice",
    "extract_final_number",
    "first_line",
    "math_equal",
    "normalize_math_answer",
]


class MetricTask(Protocol):
    """What metrics need of a task (:class:`fedexlora.tasks.base.Task` is one); no import of it.

    Attributes:
        kind: ``classification``, ``regression`` or ``causal_lm``.
        metric_names: The metrics to report, primary first.
    """

    kind: str
    metric_names: Sequence[str]


# --------------------------------------------------------------------------------------
# Answers and metrics
# --------------------------------------------------------------------------------------

_NUMBER = re.compile(
    # A minus counts only when it does not follow a word character or a dot, so the hyphen
    # in "3-4" or "COVID-19" is not read as a sign.
    r"(?:(?<![\w.])(?P<sign>-))?"
    r"(?<![\d.])(?P<num>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def _normalise_number(sign: str, digits: str) -> str:
    digits = digits.replace(",", "")
    whole, _, frac = digits.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    if sign and out != "0":
        out = "-" + out
    return out


def extract_final_number(text: str) -> str | None:
    """Return the last number in ``text``, normalised, or None if there is none.

    Handles GSM8K's ``"#### 42"`` lines, thousands separators (``"1,234"`` → ``"1234"``),
    negatives (``"-3"``; a hyphen between words or numbers as in ``"3-4"`` is not a minus),
    decimals, and trailing zeros (``"42.0"`` → ``"42"``, ``"2.50"`` → ``"2.5"``).

    Args:
        text: Any text, e.g. a model generation or a reference answer.

    Returns:
        The normalised last number as a string, or None.
    """
    if text is None:
        return None
    last = None
    for match in _NUMBER.finditer(str(text)):
        last = match
    if last is None:
        return None
    return _normalise_number(last.group("sign") or "", last.group("num"))


def extract_boxed(text: str) -> str | None:
    r"""The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, or None.

    Braces are balanced. MATH solutions put their final answer there.
    """
    if text is None:
        return None
    text = str(text)
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:  # "\\boxed 5": the rest of the token
        rest = text[start + len("\\boxed") :].strip().split()
        return rest[0].rstrip(".$") if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _fix_slash(s: str) -> str:
    a, sep, b = s.partition("/")
    if sep and a.lstrip("-").isdigit() and b.isdigit():
        return "\\frac{" + a + "}{" + b + "}"
    return s


def normalize_math_answer(answer: str) -> str:
    r"""A MATH answer in canonical form, as Hendrycks et al.'s ``is_equiv`` compares them.

    Drops spaces, ``\\left``/``\\right``, ``\\!``, dollar signs, degrees, percent signs
    and a trailing ``\\text{...}`` unit; reads ``dfrac``/``tfrac`` as ``frac``; writes
    ``\\frac12`` and ``1/2`` as ``\\frac{1}{2}``, ``0.5`` as ``\\frac{1}{2}``, ``\\sqrt2`` as
    ``\\sqrt{2}`` and ``.5`` as ``0.5``; keeps the right side of a short ``x = ...``.
    """
    s = str(answer).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[^}]*\}\s*$", "", s) if not s.startswith("\\text") else s
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and len(lhs.strip()) <= 2:
        s = rhs
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def math_equal(predicted: str | None, reference: str | None) -> bool:
    """Whether two MATH answers are equal after :func:`normalize_math_answer`."""
    if predicted is None or reference is None:
        return False
    return normalize_math_answer(predicted) == normalize_math_answer(reference)


_CHOICES = {
    "boolq": r"true|false",
    "piqa": r"solution1|solution2",
    "social_i_qa": r"answer1|answer2|answer3|answer4|answer5",
    "arc-challenge": r"answer1|answer2|answer3|answer4|answer5",
    "arc-easy": r"answer1|answer2|answer3|answer4|answer5",
    "openbookqa": r"answer1|answer2|answer3|answer4|answer5",
    "hellaswag": r"ending1|ending2|ending3|ending4",
    "winogrande": r"option1|option2",
}


def extract_choice(text: str, task: str) -> str:
    """The answer word a generation gives for a commonsense task, as LLM-Adapters reads it.

    The first of the task's answer words (``true``/``false`` for BoolQ, ``solution1``/
    ``solution2`` for PIQA, ``answer1``..``answer5`` for SIQA, ARC and OBQA, ``ending1``..
    ``ending4`` for HellaSwag, ``option1``/``option2`` for WinoGrande) in the lower-cased
    text, or ``""`` when there is none.
    """
    pattern = _CHOICES.get(task.lower())
    if pattern is None:
        raise ValueError(f"no answer words known for task {task!r}; known: {sorted(_CHOICES)}")
    found = re.findall(pattern, str(text).strip().lower())
    return found[0] if found else ""


def choice_accuracy(
    predicted_texts: Iterable[str], answers: Iterable[str], groups: Iterable[str]
) -> dict[str, float]:
    """Commonsense accuracy: per task (``accuracy_<task>``) and their unweighted mean.

    ``accuracy`` is the mean over the tasks present, as the paper's "Avg." column is.
    """
    preds, refs, tasks = list(predicted_texts), list(answers), list(groups)
    if not (len(preds) == len(refs) == len(tasks)):
        raise ValueError(
            f"predicted_texts, answers and groups differ in length: "
            f"{len(preds)}, {len(refs)}, {len(tasks)}"
        )
    if not preds:
        raise ValueError("choice_accuracy needs at least one example, got 0")
    hits: dict[str, list[int]] = {}
    for p, a, t in zip(preds, refs, tasks, strict=True):
        hits.setdefault(t, []).append(int(extract_choice(p, t) == str(a).strip().lower()))
    per = {f"accuracy_{t}": sum(h) / len(h) for t, h in hits.items()}
    return {"accuracy": sum(per.values()) / len(per)} | dict(sorted(per.items()))


_ANSWER_IS = re.compile(r"the answer is", re.IGNORECASE)


def _answer_is(text: str) -> str | None:
    """What follows the last "The answer is" (MetaMath's closing line), to the line's end."""
    text = str(text)
    last = None
    for last in _ANSWER_IS.finditer(text):  # noqa: B007 - the last match is wanted
        pass
    if last is None:
        return None
    rest = text[last.end() :].lstrip(":").strip()
    line = rest.splitlines()[0].strip().rstrip(".").strip() if rest else ""
    return line or None


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, its runs of whitespace read as one space."""
    for line in str(text).splitlines():
        if line.strip():
            return " ".join(line.split())
    return ""


def exact_match(
    predicted_texts: Iterable[str], answers: Iterable[str], style: str = "number"
) -> float:
    r"""Fraction of predictions whose final answer equals the reference's.

    ``style="number"`` (GSM8K): both sides go through :func:`extract_final_number` (for
    the prediction, of what follows its last "The answer is" when that holds a number); a
    reference without a number is compared as stripped text, and a prediction without a
    number never matches. ``style="boxed"`` (MATH): the prediction's last
    ``\\boxed{...}`` (else what follows MetaMath's "The answer is:", else its last
    number) against the reference answer, both normalised (:func:`math_equal`).
    ``style="text"`` (``deepmind-math``): the prediction's first non-blank line equals the
    whole reference string, both with runs of whitespace read as one space
    (:func:`first_line`); ``"-2/21"`` matches ``" -2/21 "`` but not ``"-2 / 21"`` or ``"-4/42"``.

    Args:
        predicted_texts: Generated texts.
        answers: Reference answers (e.g. ``"42"`` or a full ``"... #### 42"`` solution).
        style: ``number``, ``boxed`` or ``text``.

    Returns:
        The exact-match rate in [0, 1].

    Raises:
        ValueError: If the sequences differ in length or are empty.
    """
    preds = list(predicted_texts)
    refs = list(answers)
    if len(preds) != len(refs):
        raise ValueError(
            f"predicted_texts and answers differ in length: {len(preds)} != {len(refs)}"
        )
    if not preds:
        raise ValueError("exact_match needs at least one example, got 0")
    if style == "boxed":
        got = [extract_boxed(p) or _answer_is(p) or extract_final_number(p) for p in preds]
        return sum(math_equal(g, r) for g, r in zip(got, refs, strict=True)) / len(preds)
    if style == "text":
        hits = [first_line(p) == " ".join(str(r).split()) for p, r in zip(preds, refs, strict=True)]
        return sum(hits) / len(preds)
    if style != "number":
        raise ValueError(f"exact_match style must be number, boxed or text, got {style!r}")
    hits = 0
    for pred, ref in zip(preds, refs, strict=True):
        want = extract_final_number(ref)
        got = extract_final_number(_answer_is(pred) or "") or extract_final_number(pred)
        if want is None:
            hits += int(got is None and str(pred).strip() == str(ref).strip())
        else:
            hits += int(got == want)
    return hits / len(preds)


def _confusion(y_true: np.ndarray, y_pred: np.ndarray, classes: np.ndarray) -> np.ndarray:
    index = {c: i for i, c in enumerate(classes.tolist())}
    cm = np.zeros((len(classes), len(classes)), dtype=np.int64)
    for t, p in zip(y_true.tolist(), y_pred.tolist(), strict=True):
        cm[index[t], index[p]] += 1
    return cm


def _f1_from_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
    denom = 2 * tp + fp + fn
    return np.divide(2 * tp, denom, out=np.zeros(tp.shape, dtype=float), where=denom > 0)


def _binary_f1(y_true: np.ndarray, y_pred: np.ndarray, positive: int = 1) -> float:
    tp = np.sum((y_pred == positive) & (y_true == positive))
    fp = np.sum((y_pred == positive) & (y_true != positive))
    fn = np.sum((y_pred != positive) & (y_true == positive))
    return float(_f1_from_counts(np.array([tp]), np.array([fp]), np.array([fn]))[0])


def _macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    classes = np.union1d(y_true, y_pred)
    cm = _confusion(y_true, y_pred, classes)
    tp = np.diag(cm).astype(float)
    fp = cm.sum(axis=0) - tp
    fn = cm.sum(axis=1) - tp
    return float(np.mean(_f1_from_counts(tp, fp, fn)))


def _matthews(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Matthews correlation (multi-class form of Gorodkin 2004; binary MCC for 2 classes)."""
    classes = np.union1d(y_true, y_pred)
    cm = _confusion(y_true, y_pred, classes).astype(float)
    t = cm.sum(axis=1)
    p = cm.sum(axis=0)
    c = np.trace(cm)
    s = cm.sum()
    cov_tp = c * s - float(t @ p)
    cov_pp = s * s - float(p @ p)
    cov_tt = s * s - float(t @ t)
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return float(cov_tp / math.sqrt(cov_pp * cov_tt))


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x = x.astype(float) - x.mean()
    y = y.astype(float) - y.mean()
    denom = math.sqrt(float(x @ x) * float(y @ y))
    if denom == 0:
        return float("nan")
    return float((x @ y) / denom)


_CLASSIFICATION_METRICS = ("accuracy", "f1", "f1_macro", "matthews")
_REGRESSION_METRICS = ("pearson",)


def compute_metrics(task: MetricTask, predictions: Any, labels: Any) -> dict[str, float]:
    """Compute the metrics that ``task.metric_names`` lists for a classification/regression task.

    For classification, ``predictions`` may be class ids of shape ``(n,)`` or logits of
    shape ``(n, num_labels)`` (arg-maxed); ``"accuracy"`` is always included. ``"f1"`` is
    binary F1 with positive class 1; ``"f1_macro"`` averages per-class F1 over the classes
    present in labels or predictions (as scikit-learn does); ``"matthews"`` is the
    Matthews correlation coefficient (0.0 when undefined). For regression, ``predictions``
    of shape ``(n,)`` or ``(n, 1)``; ``"pearson"`` is NaN when either side is constant.

    Args:
        task: The task the predictions are for.
        predictions: Predicted class ids, logits, or regression outputs.
        labels: Reference labels.

    Returns:
        Metric name → value, in the order of ``task.metric_names`` (accuracy added first
        for classification when not listed).

    Raises:
        ValueError: For causal LM tasks (use :func:`exact_match`), shape mismatches, empty
            inputs, or metric names this function does not know.
    """
    if task.kind not in ("classification", "regression"):
        raise ValueError(
            f"compute_metrics supports classification and regression tasks, got "
            f"task.kind={task.kind!r}; use exact_match() for causal LM tasks"
        )
    preds = np.asarray(predictions)
    refs = np.asarray(labels).reshape(-1)
    if refs.size == 0:
        raise ValueError("compute_metrics needs at least one example, got 0 labels")

    if task.kind == "regression":
        preds = preds.reshape(-1) if preds.ndim == 2 and preds.shape[1] == 1 else preds
        known = _REGRESSION_METRICS
        names = list(task.metric_names)
    else:
        if preds.ndim == 2:
            preds = preds.argmax(axis=-1)
        known = _CLASSIFICATION_METRICS
        names = list(task.metric_names)
        if "accuracy" not in names:
            names.insert(0, "accuracy")
        refs = refs.astype(np.int64)
        preds = preds.astype(np.int64) if preds.ndim == 1 else preds

    if preds.ndim != 1 or preds.shape[0] != refs.shape[0]:
        raise ValueError(
            f"predictions of shape {tuple(np.shape(predictions))} do not match labels of "
            f"length {refs.shape[0]} for a {task.kind} task"
        )
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(
            f"unknown metric(s) {unknown} for a {task.kind} task; supported: {list(known)}"
        )

    out: dict[str, float] = {}
    for metric in names:
        if metric == "accuracy":
            out[metric] = float(np.mean(preds == refs))
        elif metric == "f1":
            out[metric] = _binary_f1(refs, preds, positive=1)
        elif metric == "f1_macro":
            out[metric] = _macro_f1(refs, preds)
        elif metric == "matthews":
            out[metric] = _matthews(refs, preds)
        elif metric == "pearson":
            out[metric] = _pearson(preds, refs)
    return out
