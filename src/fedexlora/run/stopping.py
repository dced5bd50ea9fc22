"""When a method stops before its last round: the study's stopping rule.

``stop_patience`` P: a method stops once P rounds in a row have not improved the best
value of the metric the rule reads: ``stop_metric``, or else the task's primary metric
(the first metric of its rows: accuracy, exact match, ...; lower is better for a loss or
perplexity). ``stop_min_rounds`` M: not before round M (a warm-up, in which the metric
may wander before a method learns; the best is still read from round 1). ``stop_at`` X:
it stops once that metric reaches X. Either way it never runs
past ``rounds``, so every method of a run has the same budget and the same rule. The rule
reads only the method's rows, so a resumed run stops where a straight one did, and
``fedexlora compare`` knows a stopped cell is done.
"""

from __future__ import annotations

from fedexlora.config import RunConfig
from fedexlora.run.report import higher_is_better, primary_metric

__all__ = ["RULE", "cell_done", "method_done", "stop_metric_error", "stop_reason", "until_stop"]

RULE = ("stop_patience", "stop_min_rounds", "stop_at", "stop_metric")
"""The settings of the rule (all resume-safe: they change no row, only where it ends)."""


def stop_reason(cfg: RunConfig, rows: list[dict]) -> str | None:
    """Why a method whose rows so far are ``rows`` (in round order) runs no more rounds.

    Returns:
        ``None`` while it goes on; else one line (the rule that stopped it, and when).
    """
    if not rows or (cfg.stop_patience is None and cfg.stop_at is None):
        return None
    metric = cfg.stop_metric or primary_metric(rows)
    values = [r["metrics"][metric] for r in rows if metric in r.get("metrics", {})]
    if not values:
        return None
    up = higher_is_better(metric)
    last = values[-1]
    if cfg.stop_at is not None and (last >= cfg.stop_at if up else last <= cfg.stop_at):
        return f"{metric} {last:.4g} reached stop_at {cfg.stop_at:g} in round {rows[-1]['round']}"
    warm = cfg.stop_min_rounds is not None and rows[-1]["round"] < cfg.stop_min_rounds
    if cfg.stop_patience is not None and not warm:
        best_at = max(range(len(values)), key=lambda i: (values[i] if up else -values[i], -i))
        since = len(values) - 1 - best_at
        if since >= cfg.stop_patience:
            return (
                f"{metric} not better than round {rows[best_at]['round']}'s "
                f"{values[best_at]:.4g} for {since} rounds (stop_patience {cfg.stop_patience})"
            )
    return None


def stop_metric_error(cfg: RunConfig, metric_names: list[str]) -> str | None:
    """Why ``cfg.stop_metric`` is not one of the task's ``metric_names``, or ``None``.

    A metric the rows never hold would never stop a method, so it is refused up front.
    """
    if cfg.stop_metric is None or cfg.stop_metric in metric_names:
        return None
    return (
        f"--stop-metric {cfg.stop_metric!r} is not a metric of task {cfg.task!r}; "
        f"choose from {', '.join(metric_names)}"
    )


def method_done(cfg: RunConfig, rows: list[dict]) -> bool:
    """Whether a method with these rows has finished: every round run, or stopped.

    A row that failed the exactness check (``exactness_error``, written as evidence with
    no checkpoint) never finishes a method: its round runs again on a resume.
    """
    if any("exactness_error" in r for r in rows):
        return False
    return (bool(rows) and rows[-1]["round"] >= cfg.rounds) or stop_reason(cfg, rows) is not None


def until_stop(cfg: RunConfig, rows: list[dict]) -> list[dict]:
    """Each method's rows up to where ``cfg``'s rule stops it, in their order.

    A run made under another rule, or none, may have gone further.
    """
    kept, seen, done = [], {}, set()
    for row in rows:
        m = row["method"]
        if m in done:
            continue
        seen.setdefault(m, []).append(row)
        kept.append(row)
        if row["round"] >= cfg.rounds or stop_reason(cfg, seen[m]) is not None:
            done.add(m)
    return kept


def cell_done(cfg: RunConfig, rows: list[dict]) -> bool:
    """Whether every method of ``cfg`` has finished in ``rows`` (all rounds, or stopped)."""
    return all(method_done(cfg, [r for r in rows if r["method"] == m]) for m in cfg.methods)
