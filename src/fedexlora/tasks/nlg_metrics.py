"""The E2E NLG challenge's metrics: BLEU, NIST, METEOR, ROUGE-L and CIDEr, multi-reference.

The official script (github.com/tuetschek/e2e-metrics, ``measure_scores.py``) runs Perl
``mteval-v13a`` for BLEU and NIST, the Java METEOR 1.5 with paraphrase tables, and the
MS-COCO caption code for ROUGE-L and CIDEr after the Java Stanford PTB tokenizer. Here:

* **BLEU**: sacrebleu, lower-cased, ``13a`` tokenization (mteval-v13a's), closest
  reference length (shorter on ties), no smoothing. The same definition as mteval-v13a
  run case-insensitively, as the script runs it.
* **NIST**: written here to mteval-v13a's definition (5-grams, information weights from
  all references, its length penalty), on the same tokens as BLEU. With a varying number
  of references per segment the official Perl script (an edited mteval) gives slightly
  different figures; the script's own Python port agrees with this one.
* **METEOR**: nltk's METEOR with exact and Porter-stem matching, averaged over segments.
  It differs from the official METEOR 1.5: no WordNet synonyms (not available offline),
  no paraphrase table, METEOR 1.0 parameters, and a mean of segment scores rather than
  METEOR's corpus aggregate. Expect a lower figure than the official one.
* **ROUGE-L** and **CIDEr** (CIDEr-D): the MS-COCO caption code itself (the
  ``pycocoevalcap`` package, which the official script vendors). The official script
  first runs the Java PTB tokenizer, which lower-cases and drops punctuation; here a
  Python stand-in does the same with mteval tokens, so figures can differ slightly where
  the two tokenizers split words differently (e.g. "it's").

BLEU, METEOR and ROUGE-L are in [0, 1] (the official script prints them so too); NIST
and CIDEr are unbounded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

__all__ = [
    "E2E_METRICS",
    "bleu",
    "check_installed",
    "cider",
    "e2e_scores",
    "meteor",
    "nist",
    "rouge_l",
]

E2E_METRICS = ("bleu", "nist", "meteor", "rouge_l", "cider")
_INSTALL = "pip install 'fedex-lora[nlg]'"
# pycocoevalcap's PTB tokenizer drops these tokens
_PUNCTUATION = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",",
                ":", "-", "--", "...", ";", "(", ")", "[", "]", "{", "}", '"'}  # fmt: skip


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ValueError(
            f"the E2E metrics need the {module.split('.')[0]!r} package; install them with "
            f"`{_INSTALL}`"
        ) from err


def check_installed() -> None:
    """Raises the install hint now if a package the metrics need is missing."""
    for module in ("sacrebleu.metrics", "nltk.translate.meteor_score", "pycocoevalcap.cider.cider"):
        _need(module)


def _check(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} generations but {len(refs)} reference lists")
    if not hyps:
        raise ValueError("the E2E metrics need at least one example, got 0")
    for i, r in enumerate(refs):
        if isinstance(r, str) or not r:
            raise ValueError(f"example {i}: references must be a non-empty list of strings")


def mteval_tokens(text: str) -> list[str]:
    """mteval-v13a's tokens of ``text``, lower-cased (sacrebleu's 13a tokenizer)."""
    tok = _need("sacrebleu.tokenizers.tokenizer_13a").Tokenizer13a()
    return tok(str(text).lower()).split()


def _ptb_tokens(text: str) -> list[str]:
    """A stand-in for pycocoevalcap's PTB tokenization: lower-cased, punctuation dropped."""
    return [t for t in mteval_tokens(text) if t not in _PUNCTUATION]


def bleu(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU-4 in [0, 1] against every reference of each example."""
    _check(hyps, refs)
    metrics = _need("sacrebleu.metrics")
    width = max(len(r) for r in refs)
    streams = [[r[j] if j < len(r) else None for r in refs] for j in range(width)]
    scorer = metrics.BLEU(lowercase=True, tokenize="13a", smooth_method="none")
    return scorer.corpus_score([str(h) for h in hyps], streams).score / 100.0


def nist(hyps: Sequence[str], refs: Sequence[Sequence[str]], max_n: int = 5) -> float:
    """Corpus NIST-5, mteval-v13a's definition.

    The information weight of an n-gram w1..wn is log2(count(w1..wn-1) / count(w1..wn)),
    counted over all references (a unigram's history is the total reference length). The
    score sums, per n, the weights of the clipped matches over the hypothesis n-grams, times
    ``exp(-beta log(ratio)^2)`` when the hypotheses are shorter than the average reference
    length (beta puts that factor at 0.5 for a ratio of 2/3).
    """
    _check(hyps, refs)
    hyp_toks = [mteval_tokens(h) for h in hyps]
    ref_toks = [[mteval_tokens(r) for r in rs] for rs in refs]
    counts: Counter = Counter()
    for rs in ref_toks:
        for r in rs:
            counts[()] += len(r)
            for n in range(1, max_n + 1):
                counts.update(tuple(r[i : i + n]) for i in range(len(r) - n + 1))

    def info(g: tuple) -> float:
        return math.log2(counts[g[:-1]] / counts[g]) if counts[g] else 0.0

    gain = [0.0] * max_n
    total = [0] * max_n
    avg_ref_len = 0.0
    hyp_len = 0
    for h, rs in zip(hyp_toks, ref_toks, strict=True):
        hyp_len += len(h)
        avg_ref_len += sum(len(r) for r in rs) / len(rs)
        for n in range(1, max_n + 1):
            grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            most: Counter = Counter()
            for r in rs:
                most |= Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            gain[n - 1] += sum(info(g) * min(c, most[g]) for g, c in grams.items())
            total[n - 1] += max(0, len(h) - n + 1)
    score = sum(g / t for g, t in zip(gain, total, strict=True) if t > 0)
    ratio = hyp_len / avg_ref_len if avg_ref_len else 0.0
    if ratio >= 1:
        penalty = 1.0
    elif ratio <= 0:
        penalty = 0.0
    else:
        beta = -math.log(0.5) / math.log(1.5) ** 2
        penalty = math.exp(-beta * math.log(ratio) ** 2)
    return penalty * score


class _NoSynonyms:
    """Stands in for WordNet in nltk's METEOR: no synonym matches (WordNet is not offline)."""

    def synsets(self, *args, **kwargs):
        return []


def meteor(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean segment METEOR in [0, 1] (nltk; exact and stem matches, best reference)."""
    _check(hyps, refs)
    score = _need("nltk.translate.meteor_score").meteor_score
    total = 0.0
    for h, rs in zip(hyps, refs, strict=True):
        total += score([_ptb_tokens(r) for r in rs], _ptb_tokens(h), wordnet=_NoSynonyms())
    return total / len(hyps)


def _coco(hyps, refs):
    gts = {i: [" ".join(_ptb_tokens(r)) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(_ptb_tokens(h))] for i, h in enumerate(hyps)}
    return gts, res


def rouge_l(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean segment ROUGE-L in [0, 1], MS-COCO's.

    The best precision and the best recall over the references, F-measure with beta 1.2.
    """
    _check(hyps, refs)
    rouge = _need("pycocoevalcap.rouge.rouge").Rouge()
    gts, res = _coco(hyps, refs)
    # MS-COCO's code divides by the hypothesis length: an empty generation scores 0 here
    return sum(rouge.calc_score(res[i], gts[i]) if res[i][0] else 0.0 for i in gts) / len(gts)


def cider(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus CIDEr-D, MS-COCO's (document frequencies from these references)."""
    _check(hyps, refs)
    scorer = _need("pycocoevalcap.cider.cider").Cider()
    return float(scorer.compute_score(*_coco(hyps, refs))[0])


def e2e_scores(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> dict[str, float]:
    """All five E2E metrics, BLEU first."""
    _check(hyps, refs)
    hyps = [str(h).strip() for h in hyps]
    refs = [[str(x) for x in r] for r in refs]
    return {
        "bleu": bleu(hyps, refs),
        "nist": nist(hyps, refs),
        "meteor": meteor(hyps, refs),
        "rouge_l": rouge_l(hyps, refs),
        "cider": cider(hyps, refs),
    }
