"""Local training and evaluation. Knows nothing of federation: it also serves centralized LoRA."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from fedexlora.training.batches import TrainResult, _amp, _collate, _schedule

__all__ = [
    "Encoded",
    "TrainResult",
    "encode",
    "evaluate",
    "train_local",
]


@dataclass
class Encoded:
    """A tokenized split: token ids per example, and labels.

    Attributes:
        input_ids: One list of token ids per example.
        labels: Class ids (classification), floats (regression), or per-token labels
            with ``-100`` on the prompt (causal LM).
        kind: ``classification``, ``regression`` or ``causal_lm``.
        prompts: For causal LM, the prompt ids alone (for generation).
        answers: For causal LM, the reference final answers (or, for text generation,
            each example's list of references).
        pad_id: The tokenizer's pad id.
        groups: For a multi-task test set, each example's task.
    """

    input_ids: list[list[int]]
    labels: list
    kind: str
    pad_id: int
    prompts: list[list[int]] | None = None
    answers: list | None = None
    groups: list[str] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, idx: Sequence[int]) -> Encoded:
        """The examples at ``idx``."""
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return Encoded(
            input_ids=pick(self.input_ids),
            labels=pick(self.labels),
            kind=self.kind,
            pad_id=self.pad_id,
            prompts=pick(self.prompts),
            answers=pick(self.answers),
            groups=pick(self.groups),
        )


TEMPLATES = {
    "qa": "Question: {prompt}\nAnswer:",
    # Alpaca's, as LLM-Adapters (commonsense) and MetaMath train and evaluate with it
    "alpaca": "Below is an instruction that describes a task. Write a response that "
    "appropriately completes the request.\n\n### Instruction:\n{prompt}\n\n### Response:",
    # E2E: the meaning representation, then the text
    "e2e": "{prompt} ||",
}


# Where a generation stops being the answer: the model starting the next example
STOPS = {
    "qa": ("\nQuestion:",),
    "alpaca": ("### Instruction", "### Response", "### Input"),
    "e2e": ("\n",),
}


def cut_at_stop(text: str, template: str = "qa") -> str:
    """``text`` up to the first marker of a new example in ``template`` (:data:`STOPS`).

    Greedy decoding runs on past the answer into a made-up next question; reading a final
    answer from that would score the wrong one. (Fed-SB's evaluation stops generation on
    such markers; LLM-Adapters' splits on them.)
    """
    cut = len(text)
    for stop in STOPS.get(template, ()):
        at = text.find(stop)
        if 0 <= at < cut:
            cut = at
    return text[:cut]


def format_prompt(prompt: str, template: str = "qa") -> str:
    """A causal-LM prompt laid out by one of :data:`TEMPLATES`."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose from {list(TEMPLATES)}")
    return TEMPLATES[template].format(prompt=prompt.strip())


def encode(dataset, tokenizer, *, kind: str, max_length: int, template: str = "qa") -> Encoded:
    """Tokenizes a task split (columns as produced by :func:`fedexlora.tasks.data.load_task`)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if kind == "causal_lm":
        ids, labels, prompts = [], [], []
        eos = tokenizer.eos_token or ""
        for row in dataset:
            text = format_prompt(row["prompt"], template)
            p = tokenizer(text, add_special_tokens=True)["input_ids"]
            r = tokenizer(" " + row["response"].strip() + eos, add_special_tokens=False)[
                "input_ids"
            ]
            full = (p + r)[:max_length]
            ids.append(full)
            labels.append(([-100] * len(p) + r)[:max_length])
            prompts.append(p[:max_length])
        cols = dataset.column_names
        answers = list(dataset["answer"]) if "answer" in cols else None
        if "references" in cols:  # text generation: every reference is an answer
            answers = [list(r) for r in dataset["references"]]
        groups = list(dataset["group"]) if "group" in cols else None
        return Encoded(ids, labels, kind, pad_id, prompts=prompts, answers=answers,
                       groups=groups)  # fmt: skip
    pair = list(dataset["text_pair"]) if "text_pair" in dataset.column_names else None
    enc = tokenizer(list(dataset["text"]), pair, truncation=True, max_length=max_length)
    return Encoded(list(enc["input_ids"]), list(dataset["label"]), kind, pad_id)


def train_local(
    model: torch.nn.Module,
    data: Encoded,
    *,
    epochs: float = 1.0,
    steps: int | None = None,
    batch_size: int = 16,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    desc: str = "train",
    progress: bool = True,
    autocast: torch.dtype | None = None,
    dp=None,
    dp_reproducible: bool = False,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> TrainResult:
    """Trains the model's trainable parameters on ``data`` with AdamW.

    The data order and dropout come from ``seed`` alone. The learning rate warms up
    linearly over ``warmup_ratio`` of the steps, then decays linearly to zero.

    Args:
        model: The model; only parameters with ``requires_grad`` are trained.
        data: The local examples.
        epochs: Passes over the data (fractions allowed); ignored when ``steps`` is set.
        steps: Exact number of optimizer steps, cycling through the data.
        batch_size: Examples per step.
        lr: Peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_ratio: Fraction of steps used for linear warm-up.
        max_grad_norm: Gradient clipping norm.
        seed: Seed for the data order and dropout.
        device: Where the model lives.
        desc: Progress bar label.
        progress: Whether to show a progress bar.
        autocast: Mixed-precision dtype (bf16/fp16) for the forward pass, or ``None``.
        dp: DP-SGD (a :class:`fedexlora.training.privacy.Budget`, or anything with its
            ``noise_multiplier``, ``sample_rate`` and ``max_grad_norm``): Poisson-sampled
            batches, per-sample clipping and Gaussian noise (Opacus), instead of plain
            clipping of the batch gradient. The sampling and the noise come from OS
            entropy (:mod:`fedexlora.core.entropy`), never from ``seed``: no one who
            knows the seed can replay them.
        dp_reproducible: With ``dp``, draw the sampling and the noise from ``seed`` instead
            (a simulation that must repeat bit for bit): not private against anyone who
            knows the seed.
        penalty: A regularizer added to each step's loss (HetLoRA's rank pruning); the
            reported loss is the task's alone. Not with ``dp``.
    """
    if dp is not None and penalty is not None:
        raise ValueError("a loss `penalty` cannot be combined with DP-SGD (`dp`)")
    from fedexlora.training.distributed import get_context, train_sharded

    ctx = get_context()
    if ctx is not None:  # this client trains on several processes (training.distributed)
        return train_sharded(
            model, data, ctx, epochs=epochs, steps=steps, batch_size=batch_size, lr=lr,
            weight_decay=weight_decay, warmup_ratio=warmup_ratio,
            max_grad_norm=max_grad_norm, seed=seed, device=device, desc=desc,
            progress=progress, autocast=autocast, dp=dp, penalty=penalty,
        )  # fmt: skip
    if dp is not None:
        return _train_dp(
            model, data, dp, epochs=epochs, steps=steps, batch_size=batch_size, lr=lr,
            weight_decay=weight_decay, warmup_ratio=warmup_ratio, seed=seed, device=device,
            desc=desc, progress=progress, autocast=autocast, reproducible=dp_reproducible,
        )  # fmt: skip
    n = len(data)
    if n == 0:
        raise ValueError("cannot train on an empty dataset")
    per_epoch = math.ceil(n / batch_size)
    total = steps if steps is not None else max(1, math.ceil(epochs * per_epoch))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total, warmup_ratio))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    model.train()
    order: list[int] = []
    losses = []
    bar = tqdm(range(total), desc=desc, leave=False, disable=not progress, dynamic_ncols=True)
    for _ in bar:
        if len(order) < batch_size:
            order += torch.randperm(n, generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        batch = _collate(data.subset(idx), device)
        with _amp(device, autocast):
            loss = model(**batch).loss
        (loss if penalty is None else loss + penalty()).backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return TrainResult(loss=sum(losses) / len(losses), steps=total, num_examples=n)


def _train_dp(
    model, data: Encoded, dp, *, epochs, steps, batch_size, lr, weight_decay, warmup_ratio,
    seed, device, desc, progress, autocast, reproducible=False,
) -> TrainResult:  # fmt: skip
    """DP-SGD: Poisson sampling, per-sample clipping, Gaussian noise (Opacus).

    The sampling and the noise are drawn from OS entropy (:class:`~fedexlora.core.
    entropy.SecureRandom`), or, ``reproducible``, from ``seed`` (not private against
    anyone who knows it). Dropout, which the guarantee does not rest on, stays seeded.

    The first step with examples is checked (:class:`~fedexlora.training.privacy.
    FirstStepCheck`): every trainable parameter got its per-sample gradients and moved,
    else :class:`~fedexlora.training.privacy.DPCheckError`.
    """
    from opacus.optimizers import DPOptimizer

    from fedexlora.training.privacy import FirstStepCheck, per_example_loss, wrap

    n = len(data)
    if n == 0:
        raise ValueError("cannot train on an empty dataset")
    total = steps if steps is not None else max(1, math.ceil(epochs * math.ceil(n / batch_size)))
    params = [p for p in model.parameters() if p.requires_grad]
    check = FirstStepCheck(model, params)
    dp_args = dict(
        noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.max_grad_norm,
        expected_batch_size=max(1, round(dp.sample_rate * n)),
        loss_reduction="mean",
    )
    if reproducible:  # a simulation's choice: anyone with the seed replays it
        gen = torch.Generator().manual_seed(seed)
        noise = torch.Generator(device=torch.device(device)).manual_seed(seed + 1)

        def draw() -> torch.Tensor:
            return torch.rand(n, generator=gen)
    else:  # OS entropy, on this client only
        from fedexlora.training.entropy import SecureRandom, secure_dp_optimizer

        sampler = SecureRandom()

        def draw() -> torch.Tensor:
            return torch.from_numpy(sampler.random(n))

    torch.manual_seed(seed)  # dropout
    gsm = wrap(model)
    try:
        inner = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        if reproducible:
            opt = DPOptimizer(inner, generator=noise, **dp_args)
        else:
            opt = secure_dp_optimizer(inner, **dp_args)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt.original_optimizer, _schedule(total, warmup_ratio)
        )
        gsm.train()
        losses = []
        bar = tqdm(range(total), desc=desc, leave=False, disable=not progress, dynamic_ncols=True)
        for _ in bar:
            idx = (draw() < dp.sample_rate).nonzero().flatten().tolist()
            if not check.done:
                check.before_forward()
            if idx:
                batch = _collate(data.subset(idx), device)
                with _amp(device, autocast):
                    loss = per_example_loss(gsm, batch)  # each example's own share
                with warnings.catch_warnings():  # Opacus's hook on the first adapted layer,
                    warnings.filterwarnings(  # whose input needs no gradient: as meant
                        "ignore", "Full backward hook is firing", UserWarning
                    )
                    loss.backward()
                losses.append(float(loss.detach()))
                if not check.done:
                    check.after_backward(len(idx))
            else:  # an empty Poisson batch: the step is noise alone
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            opt.step()
            if not check.done:
                check.after_step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if losses:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        gsm.to_standard_module()  # hooks and per-sample gradients removed
    model.eval()
    loss = sum(losses) / len(losses) if losses else float("nan")
    return TrainResult(loss=loss, steps=total, num_examples=n)


@torch.no_grad()
def predict(
    model, data: Encoded, *, batch_size: int = 64, device="cpu", autocast=None
) -> torch.Tensor:
    """Logits (classification) or scores (regression) for every example, in order."""
    model.eval()
    outs = []
    for start in range(0, len(data), batch_size):
        batch = _collate(data.subset(range(start, min(start + batch_size, len(data)))), device)
        batch.pop("labels")
        with _amp(device, autocast):
            outs.append(model(**batch).logits.float().cpu())
    return torch.cat(outs)


@torch.no_grad()
def evaluate(
    model,
    data: Encoded,
    task,
    *,
    batch_size: int = 64,
    device="cpu",
    max_new_tokens: int = 64,
    tokenizer=None,
    autocast: torch.dtype | None = None,
    num_beams: int = 1,
) -> dict[str, float]:
    """Task metrics of the model on ``data`` (see :func:`fedexlora.tasks.data.compute_metrics`).

    A causal task with answers is also scored on generations: greedy, or beam search with
    ``num_beams`` > 1, plus the task's own ``generation`` arguments. ``task.answer_style``
    says how: exact match of the final number or boxed answer, commonsense accuracy
    (:func:`fedexlora.tasks.metrics.choice_accuracy`), or the E2E metrics
    (:func:`fedexlora.tasks.nlg_metrics.e2e_scores`).
    """
    from fedexlora.tasks.metrics import choice_accuracy, compute_metrics, exact_match

    model.eval()
    if data.kind != "causal_lm":
        logits = predict(model, data, batch_size=batch_size, device=device, autocast=autocast)
        preds = logits.squeeze(-1) if data.kind == "regression" else logits.argmax(-1)
        return compute_metrics(task, preds.numpy(), torch.tensor(data.labels).numpy())
    # causal LM: loss and perplexity over response tokens, then greedy exact match
    tot_loss, tot_tok = 0.0, 0
    for start in range(0, len(data), batch_size):
        batch = _collate(data.subset(range(start, min(start + batch_size, len(data)))), device)
        with _amp(device, autocast):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        shift = batch["labels"][:, 1:]
        lp = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            shift.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        tot_loss += float(lp)
        tot_tok += int((shift != -100).sum())
    loss = tot_loss / max(1, tot_tok)
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    if data.answers is not None and tokenizer is not None:
        style = getattr(task, "answer_style", "number")
        gen_kwargs = dict(getattr(task, "generation", None) or {}) if num_beams > 1 else {}
        with _amp(device, autocast):
            texts = _generate(model, data, tokenizer, max_new_tokens, batch_size, device,
                              num_beams=num_beams, **gen_kwargs)  # fmt: skip
        texts = [cut_at_stop(t, getattr(task, "template", "qa")) for t in texts]
        if style == "nlg":
            from fedexlora.tasks.nlg_metrics import e2e_scores

            out.update(e2e_scores(texts, data.answers))
        elif style == "choice":
            groups = data.groups or [task.name.partition("/")[2]] * len(texts)
            out.update(choice_accuracy(texts, data.answers, groups))
        else:
            out["exact_match"] = exact_match(texts, data.answers, style=style)
    # The task's primary metric first (exact match where there are answers): reports and
    # `compare` read the first key as the headline metric.
    order = [k for k in task.metric_names if k in out]
    return {k: out[k] for k in order} | {k: v for k, v in out.items() if k not in order}


class NoRepeatGeneratedNGrams:
    """Bans an n-gram's repeat within the generated tokens only (a ``LogitsProcessor``).

    Hugging Face's ``no_repeat_ngram_size`` also counts the prompt (and its padding), so a
    name of n tokens that the E2E meaning representation holds could never be written
    out. The LoRA paper's beam search (``gpt2_beam.py``) bans repeats of the generated
    text alone; so does this.
    """

    def __init__(self, n: int, prompt_length: int):
        self.n = int(n)
        self.start = int(prompt_length)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        gen = input_ids[:, self.start :].tolist()
        for row, toks in enumerate(gen):
            if len(toks) < self.n:
                continue
            prefix = tuple(toks[len(toks) - self.n + 1 :])
            banned = {
                toks[i + self.n - 1]
                for i in range(len(toks) - self.n + 1)
                if tuple(toks[i : i + self.n - 1]) == prefix
            }
            if banned:
                scores[row, list(banned)] = -float("inf")
        return scores


def _generate(
    model, data: Encoded, tokenizer, max_new_tokens, batch_size, device, num_beams=1, **kwargs
) -> list[str]:
    from transformers import LogitsProcessorList

    texts = []
    pad = data.pad_id
    no_repeat = kwargs.pop("no_repeat_ngram_size", None)
    for start in range(0, len(data), batch_size):
        prompts = data.prompts[start : start + batch_size]
        n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding for generation
            ids[i, n - len(p) :] = torch.tensor(p)
            mask[i, n - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=num_beams,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList(
                [NoRepeatGeneratedNGrams(no_repeat, n)] if no_repeat else []
            ),
            **kwargs,
        )
        texts += tokenizer.batch_decode(gen[:, n:], skip_special_tokens=True)
    return texts


def _orientation(layer, grad: torch.Tensor) -> torch.Tensor:
    """A base-weight gradient in ``(d, n)`` orientation (GPT-2's Conv1D stores ``(n, d)``)."""
    return grad.T if getattr(layer, "fan_in_fan_out", False) else grad


def estimate_gradients(model, data, *, samples: int, batch_size: int, seed: int, layers):
    """The full-weight gradients of the adapted layers, summed over ``samples`` examples.

    The LoRA branch is zero or constant at this point, so these are the base weights'
    gradients. Batches are summed as the authors do (each batch's mean loss).
    """
    n = len(data)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g)[: min(samples, n)].tolist()
    weights = {name: layer.get_base_layer().weight for name, layer in layers.items()}
    was = {name: w.requires_grad for name, w in weights.items()}
    sums = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in weights.items()}
    device = next(model.parameters()).device
    training = model.training
    model.train()
    try:
        for w in weights.values():
            w.requires_grad_(True)
        for start in range(0, len(order), batch_size):
            batch = _collate(data.subset(order[start : start + batch_size]), device)
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            for name, w in weights.items():
                sums[name] += w.grad.detach().float()
                w.grad = None
    finally:
        for name, w in weights.items():
            w.requires_grad_(was[name])
            w.grad = None
        model.zero_grad(set_to_none=True)
        model.train(training)
    return {name: _orientation(layers[name], s) for name, s in sums.items()}
