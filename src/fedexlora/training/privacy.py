"""Sample-level differential privacy for every client: DP-SGD with a budget (Opacus).

Each client trains with per-sample clipping to ``max_grad_norm`` and Gaussian noise of
standard deviation ``noise_multiplier * max_grad_norm`` on the summed clipped gradients
of its trainable parameters (the LoRA factors and the head), its batches drawn by
Poisson sampling at rate ``batch_size / n`` as DP-SGD requires. The noise multiplier is
chosen per client (:func:`plan`) so that its privacy loss over all its planned local
steps, in all rounds, is at most ``epsilon`` at ``delta`` under Opacus's RDP accountant.

What the server does with the uploads (averaging, the FedEx residual) is
post-processing of DP outputs, so the guarantee holds for every method. A client whose
next round would take it past its planned steps is not trained (:meth:`Budget.allows`,
which every engine's client asks: :meth:`fedexlora.run.client.Client.refuses`).

The ledger is the record: each round's ``metrics.jsonl`` row carries
:meth:`Ledger.row`, from which anyone can recompute every client's epsilon with an
accountant of their own (``noise_multiplier``, ``sample_rate``, ``steps``, ``delta``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fedexlora.core.sampling import sample_size

ACCOUNTANT = "rdp"
"""The accountant: Renyi DP of the Poisson-subsampled Gaussian (Opacus's analysis)."""

ORDERS = tuple(range(2, 256))
"""RDP orders: whole numbers only. There the subsampled Gaussian's RDP has an exact
closed form, so any accountant reproduces it (at fractional orders implementations
differ: Opacus 1.6 reported 3.890 where Google's dp-accounting reports 3.918 at order
2.8, q=0.2, sigma=1.019, 35 steps, enough to move epsilon 8.00 to 8.02)."""

__all__ = [
    "ACCOUNTANT",
    "Budget",
    "DPCheckError",
    "FirstStepCheck",
    "Ledger",
    "budget_for",
    "per_example_loss",
    "check_delta",
    "check_model",
    "epsilon_spent",
    "noise_multiplier",
    "plan",
    "privacy_row",
    "rdp_one_step",
    "report",
    "steps_per_round",
    "wrap",
]


def rdp_one_step(sample_rate: float, noise_multiplier: float):
    """RDP of one Poisson-subsampled Gaussian step at every order of :data:`ORDERS`.

    The closed form at whole orders (Mironov, Talwar, Zhang 2019, section 3.3), the one
    Opacus's ``compute_rdp`` evaluates, computed for all orders at once: Opacus loops in
    Python over orders and terms (about 0.4 s a call here), and calibrating the noise
    takes dozens of calls per client. RDP adds up over steps, so ``steps`` steps are
    ``steps`` times this. ``tests/training/test_privacy.py`` checks it against Opacus.
    """
    import numpy as np
    from scipy.special import gammaln, logsumexp

    q, sigma = float(sample_rate), float(noise_multiplier)
    alpha = np.asarray(ORDERS, dtype=np.float64)
    if q == 0:
        return np.zeros_like(alpha)
    if sigma == 0:
        return np.full_like(alpha, np.inf)
    if q == 1.0:
        return alpha / (2 * sigma**2)
    i = np.arange(int(alpha.max()) + 1, dtype=np.float64)[None, :]  # (1, max order + 1)
    a = alpha[:, None]  # (orders, 1)
    terms = (
        gammaln(a + 1) - gammaln(i + 1) - gammaln(np.maximum(a - i, 0) + 1)  # log binom
        + i * math.log(q) + (a - i) * math.log1p(-q)
        + (i * i - i) / (2 * sigma**2)
    )  # fmt: skip
    terms = np.where(i <= a, terms, -np.inf)
    return logsumexp(terms, axis=1) / (alpha - 1)


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps at ``delta`` (RDP, :data:`ORDERS`)."""
    if steps <= 0:
        return 0.0
    import warnings

    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = rdp_one_step(sample_rate, noise_multiplier) * int(steps)
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": by design,
        warnings.simplefilter("ignore", UserWarning)  # whole orders only (see ORDERS)
        eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=float(delta))
    return float(eps)


@functools.lru_cache(maxsize=256)
def noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier (to 0.1%) whose epsilon over ``steps`` is <= ``epsilon``.

    Cached: a Flower client asks again every round, and each answer takes dozens of
    accountant calls.
    """
    lo, hi = 0.0, 1.0
    while epsilon_spent(hi, sample_rate, steps, delta) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(
                f"--dp-epsilon {epsilon:g} at --dp-delta {delta:g} cannot be met over "
                f"{steps} steps at sampling rate {sample_rate:.3g}"
            )
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if epsilon_spent(mid, sample_rate, steps, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def steps_per_round(cfg, n: int) -> int:
    """Local steps a client with ``n`` examples takes in one round (as training does)."""
    if cfg.local_steps is not None:
        return int(cfg.local_steps)
    return max(1, math.ceil(cfg.local_epochs * math.ceil(n / cfg.batch_size)))


def planned_rounds(cfg) -> int:
    """Rounds each client is planned to train in: all of them, or its expected share.

    With partial participation the server samples
    :func:`~fedexlora.core.sampling.sample_size` clients a round (the same function), so
    a client expects ``rounds * sampled / clients`` rounds; the plan rounds that up. A
    client sampled more often is refused once its budget is spent.
    """
    if cfg.fraction >= 1.0:
        return int(cfg.rounds)
    per_round = sample_size(cfg.num_clients, cfg.fraction)
    return max(1, math.ceil(cfg.rounds * per_round / cfg.num_clients))


def check_model(model) -> None:
    """Raises ValueError naming each trainable layer Opacus cannot privatise.

    Opacus computes per-sample gradients for any layer (its own rules, else functorch),
    but refuses a trainable layer that holds buffers (batch norm's running statistics
    mix examples, so they are not private).
    """
    from opacus.utils.module_utils import trainable_modules

    bad = [name or "(the model)" for name, m in trainable_modules(model) if list(m.buffers())]
    if bad:
        raise ValueError(
            f"--dp-epsilon: Opacus cannot train {', '.join(bad)} privately (a trainable "
            "layer with buffers, whose statistics mix examples); freeze it or drop DP"
        )


class DPCheckError(RuntimeError):
    """DP-SGD's first step did not train what it must (see :class:`FirstStepCheck`)."""


_ISSUE_820 = (
    "A DP-SGD run in this state trains with a falling loss and a growing epsilon while "
    "these weights never change (Opacus issue 820: parameters created, replaced or moved "
    "to another device after Opacus wrapped the model). Put the model on its device and "
    "add the adapters before DP training starts; fedex-lora's own engines do, so from "
    "`fedexlora run` this is a bug: please report it."
)


def wrap(model):
    """The model with Opacus's per-sample-gradient hooks (what DP-SGD trains through).

    ``loss_reduction="mean"``: the models' losses are batch means, and Opacus rescales so
    that each example's gradient is that of its own share of the loss, times the batch
    size. Undo with ``to_standard_module()``.
    """
    from opacus import GradSampleModule

    return GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)


def per_example_loss(model, batch: dict):
    """The batch's loss as the mean of each example's own loss: what DP-SGD trains on.

    Opacus (``loss_reduction="mean"``) takes each example's gradient as the batch size
    times its share of the loss, then clips it to ``--dp-max-grad-norm``. That bounds one
    example's influence only if its share depends on it alone. A classifier's loss is a
    mean over examples, so it does. A causal LM's loss (transformers') is a mean over the
    batch's answer tokens, so each example's share was scaled by its token count over the
    batch's: its batchmates changed its gradient, and one added record changed all the
    others' (the sensitivity was no longer the clipping norm). Here each example's loss
    is its own tokens' mean, and the batch's loss the mean over examples.
    """
    import torch

    labels = batch.get("labels")
    if labels is None or labels.dim() < 2 or labels.dtype.is_floating_point:
        # one label (or one label vector) per example: the model's loss is per example
        return model(**batch).loss
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    target = labels[:, 1:]  # token t predicts token t + 1, as transformers' causal LM loss
    tokens = torch.nn.functional.cross_entropy(
        logits[:, :-1, :].float().reshape(-1, logits.size(-1)),
        target.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(target.shape)
    answered = (target != -100).to(tokens.dtype)
    own = (tokens * answered).sum(dim=1) / answered.sum(dim=1).clamp(min=1)
    return own.mean()


class FirstStepCheck:
    """Checks DP-SGD's first step with examples: per-sample gradients, and movement.

    Every trainable parameter must get its per-sample gradients, and every one that got
    a gradient must move. Made before the model is wrapped, with the parameters the
    optimizer updates; :meth:`before_forward` runs before each step's forward pass until
    the check is done, :meth:`after_backward` before the first optimizer step with a
    non-empty batch, :meth:`after_step` right after it. Each raises
    :class:`DPCheckError` naming the parameters and the cause, so that a client never
    trains a silent, frozen round.
    """

    def __init__(self, model, params):
        self.model = model
        self.params = list(params)
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names.get(id(p), "(a tensor no longer in the model)") for p in self.params]
        self.before: list | None = None
        self.done = False

    def before_forward(self) -> None:
        """Raises unless the model's trainable parameters are those DP-SGD updates."""
        ours = {id(p) for p in self.params}
        stray = [
            n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ours
        ]
        if stray:
            raise DPCheckError(
                f"DP-SGD: {_names(stray)} {'is' if len(stray) == 1 else 'are'} trainable in the "
                "model but not among the parameters DP-SGD updates. " + _ISSUE_820
            )

    def after_backward(self, batch_size: int) -> None:
        """Raises unless each trainable parameter holds ``batch_size`` per-sample gradients."""
        missing = []
        for name, p in zip(self.names, self.params):
            g = getattr(p, "grad_sample", None)
            if g is None or tuple(g.shape) != (batch_size, *p.shape):
                missing.append(name)
        if missing:
            raise DPCheckError(
                f"DP-SGD: Opacus computed no per-sample gradient (for the {batch_size} examples "
                f"of the first batch) for {_names(missing)}. " + _ISSUE_820
            )
        self.before = [p.detach().clone() for p in self.params]

    def after_step(self) -> None:
        """Raises if a parameter that got a (noised) gradient did not change."""
        import torch

        if self.before is None:
            return
        frozen = [
            name
            for name, p, old in zip(self.names, self.params, self.before)
            if p.grad is not None and bool(p.grad.any()) and torch.equal(p.detach(), old)
        ]
        self.before, self.done = None, True
        if frozen:
            raise DPCheckError(
                f"DP-SGD: {_names(frozen)} got a gradient in the first private step but did "
                "not change. " + _ISSUE_820
            )


def _names(names: list[str], shown: int = 4) -> str:
    head = ", ".join(repr(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_delta(delta: float, sizes: list[int]) -> None:
    """Raises ValueError unless ``delta < 1 / (the smallest client's examples)``."""
    smallest = min(sizes)
    if delta >= 1.0 / smallest:
        raise ValueError(
            f"--dp-delta {delta:g} must be below 1 / {smallest} = {1.0 / smallest:.3g}, "
            f"the inverse of the smallest client's examples ({smallest}); a delta that "
            "large would allow leaking a whole record"
        )


@dataclass
class Budget:
    """One client's DP-SGD settings and what it has spent."""

    client: int
    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    planned_steps: int
    steps: int = 0

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far."""
        return epsilon_spent(self.noise_multiplier, self.sample_rate, self.steps, delta)

    def allows(self, steps: int) -> bool:
        """Whether ``steps`` more steps stay within the plan: every engine's one test."""
        return self.steps + int(steps) <= self.planned_steps

    def record(self) -> dict[str, float]:
        """Its plan and steps taken: what a client keeps (its store, a checkpoint)."""
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "planned_steps": self.planned_steps, "steps": self.steps}  # fmt: skip


def plan(cfg, sizes: list[int]) -> dict[int, Budget]:
    """Each client's noise multiplier for ``cfg.dp_epsilon`` over its planned steps.

    Args:
        cfg: A run configuration with ``dp_epsilon`` set.
        sizes: Examples per client.
    """
    return {c: budget_for(cfg, c, n) for c, n in enumerate(sizes)}


def budget_for(cfg, client: int, n: int) -> Budget:
    """One client's plan, from the run's settings and its own example count alone.

    What a Flower client computes for itself; :func:`plan` does it for every client.
    """
    q = min(1.0, cfg.batch_size / n)
    steps = planned_rounds(cfg) * steps_per_round(cfg, n)
    sigma = noise_multiplier(cfg.dp_epsilon, cfg.dp_delta, q, steps)
    return Budget(client, sigma, q, cfg.dp_max_grad_norm, steps)


def report(budget: Budget, delta: float) -> dict:
    """One client's accounting as it appears in a row: what a Flower client reports."""
    return {
        "epsilon": budget.epsilon(delta),
        "noise_multiplier": budget.noise_multiplier,
        "sample_rate": budget.sample_rate,
        "steps": budget.steps,
        "planned_steps": budget.planned_steps,
        "max_grad_norm": budget.max_grad_norm,
    }


def privacy_row(
    epsilon: float, delta: float, clients: dict, refused: list[int], *, kept: bool = False
) -> dict:
    """A round's ``privacy`` object from each client's :func:`report` (keyed by id).

    ``kept``: under secure aggregation each client keeps its accounting to itself (its
    sampling rate ``batch / n`` would tell its example count): the row then names no
    client's figures (``clients`` empty, ``epsilon`` ``None``) and says so
    (``kept_by_clients``); each client still refuses to train past the budget.
    """
    if kept:
        clients = {}
    clients = {str(c): dict(v) for c, v in sorted(clients.items(), key=lambda kv: int(kv[0]))}
    row = {
        "epsilon": None if kept else max((v["epsilon"] for v in clients.values()), default=0.0),
        "epsilon_budget": float(epsilon),
        "delta": float(delta),
        "accountant": ACCOUNTANT,
        "orders": [ORDERS[0], ORDERS[-1]],
        "clients": clients,
        "refused": sorted(refused),
    }
    if kept:
        row["kept_by_clients"] = True
    return row


@dataclass
class Ledger:
    """What every client may spend and has spent; one ``privacy`` object per round."""

    epsilon: float
    delta: float
    budgets: dict[int, Budget]

    @classmethod
    def for_run(cls, cfg, sizes: list[int]) -> Ledger:
        """The plan for a run with these client sizes (checks ``dp_delta`` against them)."""
        check_delta(cfg.dp_delta, sizes)
        return cls(float(cfg.dp_epsilon), float(cfg.dp_delta), plan(cfg, sizes))

    def restore(self, row: dict) -> None:
        """Continues from a previous round's row (a resume): the plan it was made with.

        The noise multipliers and planned steps are the run's own, whatever ``rounds``
        the resume asks for; rounds beyond the plan find the budgets spent.
        """
        self.load_state((row.get("privacy") or {}).get("clients", {}))

    def row(self, refused: list[int], *, kept: bool = False) -> dict:
        """The round's ``privacy`` object, after its clients trained (:func:`privacy_row`)."""
        clients = {c: report(b, self.delta) for c, b in self.budgets.items()}
        return privacy_row(self.epsilon, self.delta, clients, refused, kept=kept)

    def state(self) -> dict[int, dict[str, float]]:
        """Each client's plan and steps taken: what a client keeps (a checkpoint)."""
        return {c: b.record() for c, b in self.budgets.items()}

    def load_state(self, state: dict[int, dict[str, float]]) -> None:
        """Continues from :meth:`state` (a resume): the plan it was made with, its steps."""
        for c, rec in state.items():
            b = self.budgets.get(int(c))
            if b is not None:
                b.noise_multiplier = float(rec["noise_multiplier"])
                b.sample_rate = float(rec["sample_rate"])
                b.planned_steps = int(rec["planned_steps"])
                b.steps = int(rec["steps"])
