"""What a loaded task is (:class:`Task`), and the constants its loaders share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import datasets

__all__ = ["GLUE_TASKS", "KINDS", "Task"]

KINDS = ("classification", "regression", "causal_lm")

# name -> (text column, text_pair column or None, metric names, kind)
GLUE_TASKS: dict[str, tuple[str, str | None, list[str], str]] = {
    "sst2": ("sentence", None, ["accuracy"], "classification"),
    "mrpc": ("sentence1", "sentence2", ["f1", "accuracy"], "classification"),
    "rte": ("sentence1", "sentence2", ["accuracy"], "classification"),
    "cola": ("sentence", None, ["matthews"], "classification"),
    "qnli": ("question", "sentence", ["accuracy"], "classification"),
    "stsb": ("sentence1", "sentence2", ["pearson"], "regression"),
}

_CAUSAL_METRICS = ["exact_match", "loss", "perplexity"]
_CALCULATOR = re.compile(r"<<[^<>]*>>")


@dataclass
class Task:
    r"""A loaded task: train/test datasets plus what is needed to train and evaluate.

    Attributes:
        name: Task name as given to :func:`load_task` (normalised; file paths kept as given).
        kind: ``"classification"``, ``"regression"`` or ``"causal_lm"``.
        train: Training split.
        test: Evaluation split.
        num_labels: Number of classes; 1 for regression; 0 for causal LM.
        label_names: Class names indexed by label id (``["score"]`` for regression, empty
            for causal LM).
        metric_names: Metrics to report, primary metric first.
        text_pair: True when the datasets have a second text column ``"text_pair"``.
        answer_style: How a causal task's generations are scored: ``number`` (the last
            number, GSM8K), ``boxed`` (the last ``\\boxed{}``, normalised, MATH), ``choice``
            (the first answer word, accuracy per ``group`` and their mean, commonsense),
            ``text`` (the first line, the whole answer string, whitespace normalised,
            deepmind-math) or ``nlg`` (BLEU, NIST, METEOR, ROUGE-L and CIDEr against the test rows'
            ``references``, E2E).
        template: How a causal prompt is laid out: ``qa``, ``alpaca`` or ``e2e`` (see
            :data:`fedexlora.training.TEMPLATES`).
        generation: Extra :meth:`generate` arguments for evaluation (E2E's decoding).
    """

    name: str
    kind: str
    train: datasets.Dataset
    test: datasets.Dataset
    num_labels: int
    label_names: list[str] = field(default_factory=list)
    metric_names: list[str] = field(default_factory=list)
    text_pair: bool = False
    answer_style: str = "number"
    template: str = "qa"
    generation: dict[str, Any] = field(default_factory=dict)
