"""A Flower client's own DP-SGD accounting: its plan and the steps it has taken.

The client plans its budget from the run's settings and its own example count, keeps the
plan and its steps in its Context and its state directory, and reports them to the
server, which records them (and sends them back to a client that lost its state). Under
secure aggregation it reports nothing but a refusal: its record is its own. Its store
(:class:`fedexlora.flower.client_store.ContextStore`) keeps the record, and its
:class:`fedexlora.run.client.Client` refuses a spent budget and counts the steps, as
the in-process engine's clients do.
"""

from __future__ import annotations

import warnings

__all__ = ["plan_budget", "report_metrics"]

_PLAN = ("noise_multiplier", "sample_rate", "planned_steps")


def plan_budget(cfg, store, conf, pid: int, n: int):
    """This client's DP-SGD plan and the steps it has taken: its own accounting.

    The plan is made once, from the run's settings and this client's example count, and
    kept: a resume that extends the run finds the budget spent rather than a new plan.
    A client that lost its state takes the plan and count it last reported, which the
    server sends back; the count is the largest of all it knows, so a budget is never
    spent twice.

    Args:
        cfg: The run configuration.
        store: The client's store (its record).
        conf: The training message's config (what the server sends back).
        pid: Its partition.
        n: Its example count.
    """
    from fedexlora.training.privacy import budget_for, check_delta

    check_delta(cfg.dp_delta, [n])
    budget = budget_for(cfg, pid, n)
    saved = store.dp_record(pid)
    echo = {
        k: conf[f"dp-{k.replace('_', '-')}"] for k in _PLAN if f"dp-{k.replace('_', '-')}" in conf
    }
    plan = saved if all(k in saved for k in _PLAN) else echo if len(echo) == len(_PLAN) else {}
    if not saved and not echo and int(conf.get("dp-trained-before", 0)):
        # secure aggregation: the server holds none of this client's figures to send back,
        # and this client has trained in this run but lost its record: it cannot know
        # what it has spent, so it spends nothing more
        warnings.warn(
            f"partition {pid} has trained in this run but lost its DP-SGD record (its "
            "Context and state directory); under secure aggregation the server cannot send "
            "it back, so this client refuses to train for the rest of the run",
            stacklevel=2,
        )
        budget.steps = budget.planned_steps
        return budget
    if plan and not saved and not _within(cfg, budget, plan):
        # the server's word alone: a plan that spends more than this client's budget
        # (less noise, more steps, another sampling rate) is not one it made
        raise ValueError(
            f"partition {pid}: the DP-SGD plan the server sent back is not one this client "
            "would have made: it spends more than the run's --dp-epsilon at its sampling "
            "rate; refusing to train on it"
        )
    if plan:
        budget.noise_multiplier = float(plan["noise_multiplier"])
        budget.sample_rate = float(plan["sample_rate"])
        budget.planned_steps = int(plan["planned_steps"])
    budget.steps = max(int(saved.get("steps", 0)), int(conf.get("dp-steps", 0)))
    return budget


def _within(cfg, own, plan: dict) -> bool:
    """Whether ``plan`` samples at this client's own rate and spends at most its ε."""
    import math

    from fedexlora.training.privacy import epsilon_spent

    sigma, q, steps = (float(plan["noise_multiplier"]), float(plan["sample_rate"]),
                       int(plan["planned_steps"]))  # fmt: skip
    if not (math.isfinite(sigma) and sigma > 0 and steps >= 0):
        return False
    if not math.isclose(q, own.sample_rate, rel_tol=1e-9):
        return False
    return epsilon_spent(sigma, q, steps, cfg.dp_delta) <= cfg.dp_epsilon * (1 + 1e-9)


def report_metrics(budget, delta: float, *, secure: bool = False) -> dict:
    """The budget as the reply's ``dp-*`` metrics (what the server records).

    Under secure aggregation (``secure``) nothing: the sampling rate ``batch / n`` alone
    would tell the server this client's example count. The client keeps its record.
    """
    from fedexlora.training.privacy import report

    if secure:
        return {}
    return {f"dp-{k.replace('_', '-')}": v for k, v in report(budget, delta).items()}
