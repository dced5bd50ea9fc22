"""The paper's experiments as recipes: ``fedexlora run --recipe NAME``.

A recipe fixes what the FedEx-LoRA paper (Singhal, Ponkshe and Vepakomma, ACL 2025) fixed
for one of its tables: model, task(s), LoRA targets, rank, alpha, learning rate, batch,
rounds and local epochs, three IID clients, and the four methods it compares. It also
carries the paper's figure for every method, so that a run's summary puts the measured
figure beside the published one. Flags given with ``--recipe`` override it, and the run
says which.

A multi-task recipe (GLUE) runs each task as a run of its own, in ``RUN/<task>/``, and
reports each task and the average, as the paper's tables do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "RECIPES",
    "Recipe",
    "apply_recipe",
    "departures",
    "get_recipe",
    "load_config_file",
    "paper_beside",
    "paper_section",
    "recipe_table",
    "unknown_recipe",
]

PAPER_METHODS = ("centralized", "fedit", "ffa", "fedex")
_LLM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GLUE = ("cola", "rte", "mrpc", "sst2", "qnli", "stsb")


@dataclass(frozen=True)
class Recipe:
    """One of the paper's experiments.

    Attributes:
        name: The recipe's name (``--recipe``).
        title: What it reproduces, in a line.
        settings: Run-config fields it fixes.
        tasks: The tasks run (one run each); the metric is averaged over them.
        metric: The metric the paper reports, as fedex-lora names it (x100 in tables).
        paper: The paper's figure per method (the average over ``tasks``).
        source: Where in the paper the figures are.
    """

    name: str
    title: str
    settings: Mapping[str, Any]
    tasks: tuple[str, ...]
    metric: str
    paper: Mapping[str, float]
    source: str
    notes: tuple[str, ...] = field(default_factory=tuple)


def _glue(size: str, paper: dict[str, float]) -> Recipe:
    return Recipe(
        name=f"paper-glue-roberta-{size}",
        title=f"RoBERTa-{size} on GLUE (6 tasks, averaged), r=4",
        settings=dict(
            model=f"FacebookAI/roberta-{size}",
            target_modules=["query", "value"],
            lora_r=4,
            lora_alpha=8.0,
            lr=1e-3,
            batch_size=128,
            rounds=50,
            local_epochs=3.0,
            num_clients=3,
            device="auto",
            partition="iid",
            max_length=128,
            methods=list(PAPER_METHODS),
        ),
        tasks=tuple(f"glue/{t}" for t in _GLUE),
        metric="glue",
        paper=paper,
        source="FedEx-LoRA, GLUE table (r=4, average of 6 tasks)",
        notes=(
            "each task's primary metric: Matthews correlation (CoLA), Pearson (STS-B), "
            "F1 (MRPC), accuracy (the rest); validation split as test split",
        ),
    )


def _llm(name, title, model, task, metric, paper, notes=(), max_new_tokens=512) -> Recipe:
    return Recipe(
        name=name,
        title=title,
        settings=dict(
            model=model,
            target_modules=list(_LLM_TARGETS),
            lora_r=32,
            lora_alpha=16.0,
            rounds=1,
            local_epochs=1.0,
            num_clients=3,
            device="auto",
            partition="iid",
            dtype="bf16",
            max_length=512,
            max_new_tokens=max_new_tokens,
            methods=list(PAPER_METHODS),
        ),
        tasks=(task,),
        metric=metric,
        paper=paper,
        source="FedEx-LoRA, LLM tables (r=32, 1 round of 1 epoch)",
        notes=tuple(notes) + ("bf16 base; add --quantization nf4 for a 4-bit one",),
    )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _glue("base", {"centralized": 84.31, "fedit": 83.42, "ffa": 82.13, "fedex": 84.39}),
        _glue("large", {"centralized": 86.71, "fedit": 85.49, "ffa": 83.97, "fedex": 86.39}),
        Recipe(
            name="paper-e2e-gpt2",
            title="GPT-2 on E2E NLG, r=4 (BLEU; NIST, METEOR, ROUGE-L, CIDEr beside)",
            settings=dict(
                model="openai-community/gpt2",
                target_modules=["c_attn", "c_proj"],
                lora_r=4,
                lora_alpha=32.0,
                lr=2e-3,
                batch_size=8,
                rounds=5,
                local_epochs=1.0,
                num_clients=3,
                device="auto",
                partition="iid",
                max_length=128,
                max_new_tokens=64,
                num_beams=10,
                methods=list(PAPER_METHODS),
            ),
            tasks=("e2e_nlg",),
            metric="bleu",
            paper={"centralized": 68.91, "fedit": 67.60, "ffa": 66.79, "fedex": 68.15},
            source="FedEx-LoRA, E2E table (r=4)",
            notes=(
                "beam 10, length penalty 0.8, no repeated 4-grams, 64 new tokens, as in "
                "the LoRA paper's GPT-2 E2E runs; batch 8 and 5 rounds of 1 epoch are our "
                "choice (the paper's round count for E2E was not found offline)",
                "metrics as the E2E challenge defines them; where they differ from the "
                "official script, see fedexlora.tasks.nlg_metrics (METEOR most)",
            ),
        ),
        _llm(
            "paper-commonsense-llama3.2-3b",
            "Llama-3.2-3B on commonsense-170k, 8 tasks averaged",
            "meta-llama/Llama-3.2-3B",
            "commonsense",
            "accuracy",
            {"centralized": 86.37, "fedit": 83.57, "ffa": 77.35, "fedex": 85.99},
            notes=(
                "trained on LLM-Adapters' commonsense-170k; tested on BoolQ, PIQA, SIQA, "
                "HellaSwag, WinoGrande, ARC-e, ARC-c and OBQA; the answer is the first "
                "answer word generated (32 new tokens, greedy); the average is over tasks",
            ),
            max_new_tokens=32,
        ),
        _llm(
            "paper-gsm8k-mistral-7b",
            "Mistral-7B, GSM8K exact match",
            "mistralai/Mistral-7B-v0.1",
            "metamath-gsm8k",
            "exact_match",
            {"centralized": 62.77, "fedit": 56.94, "ffa": 56.41, "fedex": 62.62},
            notes=(
                "trained on MetaMathQA's first 20,000 examples; tested on GSM8K's 1,319; "
                "the answer is the number after the last 'The answer is' (else the last "
                "number)",
            ),
        ),
        _llm(
            "paper-math-gemma2-9b",
            "Gemma-2-9B, MATH exact match",
            "google/gemma-2-9b",
            "metamath-math",
            "exact_match",
            {"centralized": 39.32, "fedit": 37.16, "ffa": 35.18, "fedex": 39.00},
            notes=(
                "trained on MetaMathQA's first 20,000 examples; tested on MATH's test set; "
                "the answer is the last \\boxed{} (else what follows 'The answer is', else "
                "the last number), normalised as Hendrycks et al. do",
            ),
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``.

    Raises:
        ValueError: Naming the recipes there are.
    """
    if name not in RECIPES:
        raise ValueError(f"--recipe: unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


def apply_recipe(recipe: Recipe, overrides: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """The run-config mapping of a recipe with the user's flags on top, and what changed.

    Returns:
        ``(mapping, notes)``: one note per flag that overrides a value the recipe fixes.
    """
    out = dict(recipe.settings)
    out["task"] = recipe.tasks[0]
    notes = []
    for key, value in overrides.items():
        if key in recipe.settings and recipe.settings[key] != value:
            flag = "--" + ("rank" if key == "lora_r" else key.replace("_", "-"))
            was = _show(recipe.settings[key])
            notes.append(f"{flag} {_show(value)} overrides recipe {recipe.name}'s {was}")
        out[key] = value
    out["recipe"] = recipe.name
    return out, notes


def unknown_recipe(name) -> str | None:
    """Why ``name`` (a config's ``recipe``) names no recipe, or ``None`` when it names one."""
    if name in RECIPES:
        return None
    return f"`recipe`: unknown recipe {name!r}; choose from {', '.join(RECIPES)}"


def load_config_file(path, overrides: Mapping[str, Any] | None = None):
    """A config file's :class:`~fedexlora.config.RunConfig`, a recipe it names applied.

    ``recipe = NAME`` in the file is ``--recipe NAME``: the recipe's settings, with the
    file's own keys and ``overrides`` (the flags) on top. What ``fedexlora run --config``
    and ``fedexlora validate`` read.

    Raises:
        ConfigError: Listing every error: the file's, its values', an unknown recipe.
    """
    from fedexlora.config import ConfigError, read_config, setting_name, validate_mapping

    data = read_config(path, dict(overrides or {}))
    name = next((v for k, v in data.items() if setting_name(k) == "recipe"), None)
    if name:
        if unknown_recipe(name):
            raise ConfigError([unknown_recipe(name)])
        rest = {setting_name(k): v for k, v in data.items() if setting_name(k) != "recipe"}
        data = apply_recipe(RECIPES[name], rest)[0]
    cfg, errs = validate_mapping(data)
    if errs:
        raise ConfigError(errs)
    return cfg


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def recipe_table() -> tuple[list[str], list[list[str]]]:
    """``fedexlora recipes``: header and one row per recipe, with the paper's figures."""
    header = ["recipe", "reproduces", *PAPER_METHODS, "tasks"]
    rows = []
    for r in RECIPES.values():
        rows.append(
            [
                r.name,
                r.title,
                *(f"{r.paper[m]:.2f}" for m in PAPER_METHODS),
                ", ".join(r.tasks),
            ]
        )
    return header, rows


def _measured(rows: list[dict], metric: str) -> dict[str, float]:
    """Per method, the final value of the task's primary metric x100."""
    from fedexlora.run.report import primary_metric

    if not rows:
        return {}
    key = primary_metric(rows)
    last: dict[str, float] = {}
    for r in rows:
        last[r["method"]] = float(r["metrics"][key])
    return {m: 100.0 * v for m, v in last.items()}


def paper_beside(recipe: Recipe, rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Per method of a one-task run: the paper's figure, and the run's final x100 minus it.

    Empty for one task of a multi-task recipe: the paper's figure is their average.
    """
    if len(recipe.tasks) > 1:
        return {}
    measured = _measured(rows, recipe.metric)
    return {m: (recipe.paper[m], v - recipe.paper[m]) for m, v in measured.items()
            if m in recipe.paper}  # fmt: skip


def _every_metric(rows: list[dict]) -> list[str]:
    """Markdown: each method's final value of every task metric, when there are several.

    E2E's five metrics, or each commonsense task's accuracy.
    """
    last: dict[str, dict] = {}
    for r in rows:
        last[r["method"]] = r["metrics"]
    keys = [k for k in next(iter(last.values()), {}) if k not in ("loss", "perplexity")]
    if len(keys) < 2:
        return []
    lines = ["This run, every metric (final round; BLEU, METEOR, ROUGE-L and accuracies "
             "x100):", "", "| method | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]  # fmt: skip
    for m, vals in last.items():
        cells = [f"{(1 if k in ('nist', 'cider') else 100) * float(vals[k]):.2f}" for k in keys]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def departures(recipe: Recipe, cfg) -> list[str]:
    """Each setting the recipe fixes that ``cfg`` runs otherwise: ``lora_r = 8 (recipe: 4)``.

    Read from the configuration the run ran, whichever way it got there: flags over
    ``--recipe``, a config file's keys, or a Flower run config (which declares every key,
    so that there ``recipe`` names the paper's figures and fixes nothing).
    """
    out = []
    if cfg.task is not None and cfg.task not in recipe.tasks:
        out.append(f"task = {cfg.task} (recipe: {', '.join(recipe.tasks)})")
    for key, want in recipe.settings.items():
        have = getattr(cfg, key)
        if isinstance(have, (list, tuple)) and isinstance(want, (list, tuple)):
            same = list(have) == list(want)
        else:
            same = have == want
        if not same:
            out.append(f"{key} = {_show(have)} (recipe: {_show(want)})")
    return out


def paper_section(recipe: Recipe, per_task: Mapping[str, list[dict]], cfg=None) -> str:
    """Markdown: the paper's figure beside the measured one, and the difference.

    Args:
        recipe: The recipe run.
        per_task: Each task's metrics rows (one task for a single-task recipe).
        cfg: The run's configuration: the settings in which it departs from the recipe
            are listed.
    """
    measured = {t: _measured(rows, recipe.metric) for t, rows in per_task.items()}
    methods = [m for m in PAPER_METHODS if any(m in v for v in measured.values())]
    lines = [f"## Paper beside this run: recipe `{recipe.name}`", ""]
    lines += [f"{recipe.title}. Paper figures: {recipe.source}.", ""]
    if len(per_task) > 1:
        lines += ["| task | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        for t, vals in measured.items():
            cells = [f"{vals[m]:.2f}" if m in vals else "—" for m in methods]
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| method | paper | this run | this run − paper |", "|---|---|---|---|"]
    for m in methods:
        vals = [v[m] for v in measured.values() if m in v]
        if len(vals) != len(per_task):
            continue
        ours = sum(vals) / len(vals)
        theirs = recipe.paper.get(m, math.nan)
        lines.append(f"| {m} | {theirs:.2f} | {ours:.2f} | {ours - theirs:+.2f} |")
    lines.append("")
    if len(per_task) == 1:
        lines += _every_metric(next(iter(per_task.values())))
    if len(per_task) < len(recipe.tasks):
        lines.append(
            f"- This run covers {', '.join(per_task)} only; the paper's figure is the "
            f"average over {', '.join(recipe.tasks)}."
        )
    lines += [f"- {n}" for n in recipe.notes]
    differ = departures(recipe, cfg) if cfg is not None else []
    if differ:
        lines.append(f"- This run departs from the recipe: {'; '.join(differ)}.")
    lines.append(
        "- The paper's figures are for its full setting; a run with fewer rounds, "
        "examples or a smaller model is not expected to match them."
    )
    return "\n".join(lines) + "\n"


def recipe_section(cfg, rows: list[dict]) -> str | None:
    """The paper's figures beside a run's ``rows`` for ``summary.md`` (``None``: no recipe)."""
    if cfg.recipe is None:
        return None
    r = get_recipe(cfg.recipe)
    return paper_section(r, {cfg.task or r.tasks[0]: rows}, cfg)
