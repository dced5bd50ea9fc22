"""BLEU and NIST of fedexlora.tasks.nlg_metrics beside the E2E challenge script's Python port.

Prints both on seeded synthetic multi-reference segments (1 to 5 references each, with
mixed case, punctuation, hyphens and currency, as in E2E). The official port is
``metrics/pymteval.py`` of github.com/tuetschek/e2e-metrics (it needs the ``future``
package); give its path:

    python benchmarks/e2e_metrics_vs_official.py /path/to/e2e-metrics/metrics/pymteval.py
"""

from __future__ import annotations

import importlib.util
import random
import sys

from fedexlora.tasks.nlg_metrics import bleu, nist

WORDS = ("The a Restaurant pub near city centre food is cheap expensive family-friendly not "
         "rated 5 stars , . it's £20-25").split()  # fmt: skip


def segments(n: int = 60, seed: int = 1):
    rng = random.Random(seed)
    hyps, refs = [], []
    for _ in range(n):
        base = rng.choices(WORDS, k=rng.randint(6, 14))
        rs = []
        for _ in range(rng.randint(1, 5)):
            r = list(base)
            for _ in range(2):
                r[rng.randrange(len(r))] = rng.choice(WORDS)
            rs.append(" ".join(r))
        h = list(base)
        h[rng.randrange(len(h))] = rng.choice(WORDS)
        if rng.random() < 0.3:
            h = h[:-2]
        hyps.append(" ".join(h))
        refs.append(rs)
    return hyps, refs


def main(path: str) -> None:
    spec = importlib.util.spec_from_file_location("pymteval", path)
    official = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(official)
    hyps, refs = segments()
    b, n = official.BLEUScore(), official.NISTScore()
    for h, r in zip(hyps, refs, strict=True):
        b.append(h, r)
        n.append(h, r)
    print(f"segments {len(hyps)}, references {sum(map(len, refs))}")
    print(f"BLEU  official port {b.score():.15f}  fedexlora {bleu(hyps, refs):.15f}")
    print(f"NIST  official port {n.score():.15f}  fedexlora {nist(hyps, refs):.15f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
