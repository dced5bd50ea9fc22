"""Which of mathematics-dataset's 56 modules generate with today's sympy and numpy.

For every module (the package's ``train`` functions at its whole training entropy), the
script draws ``--per-module`` questions twice:

1. **moved import only**: the package imported with nothing but sympy's
   ``base_solution_linear`` supplied where it imports it from (without it, the package
   does not import at all);
2. **fedex-lora's shims**: as ``--task deepmind-math`` loads it
   (:mod:`fedexlora.tasks.deepmind_math`: also numpy 1's ``np.object`` and
   ``ndarray.itemset`` for the one package module that calls them).

It prints one line per module (``ok``, or the error it raises) and the milliseconds per
question with the shims, then the counts. Needs ``mathematics-dataset``
(``pip install 'fedex-lora[math]'``).

Usage::

    python benchmarks/deepmind_math_modules.py --per-module 20
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np


def _raw_modules() -> dict:
    """The package's train modules with only ``base_solution_linear`` supplied."""
    import sympy.solvers.diophantine  # noqa: F401

    dioph = sys.modules["sympy.solvers.diophantine"]
    if not hasattr(dioph, "base_solution_linear"):
        inner = sys.modules["sympy.solvers.diophantine.diophantine"]
        dioph.base_solution_linear = inner.base_solution_linear
    from mathematics_dataset.modules import modules

    from fedexlora.tasks.deepmind_math import _entropy_fn, _flatten

    return _flatten(modules.train(_entropy_fn(0, 1)))


def _try(fn, n: int) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        for _ in range(n):
            problem = fn()
            str(problem.question), str(problem.answer)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}", float("nan")
    return "ok", (time.perf_counter() - start) / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-module", type=int, default=20, help="questions per module")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    raw = {}
    for name, fn in _raw_modules().items():  # before fedex-lora's shims are installed
        random.seed(args.seed)
        np.random.seed(args.seed)
        raw[name] = _try(fn, args.per_module)[0]

    from fedexlora.tasks import deepmind_math as dm

    shimmed = {}
    train = dm._modules("train", None)
    for name, fn in train.items():
        with dm._seeded(args.seed, "train", name):
            shimmed[name] = _try(fn, args.per_module)

    import numpy
    import sympy

    print(f"sympy {sympy.__version__}, numpy {numpy.__version__}, {args.per_module} per module")
    print(f"{'module':40s} {'moved import only':55s} {'with the shims':16s} ms/question")
    for name in train:
        status, ms = shimmed[name]
        print(f"{name:40s} {raw[name][:55]:55s} {status[:16]:16s} {ms:8.1f}")
    print(
        f"moved import only: {sum(v == 'ok' for v in raw.values())} of {len(raw)} generate; "
        f"with the shims: {sum(v[0] == 'ok' for v in shimmed.values())} of {len(shimmed)}"
    )


if __name__ == "__main__":
    main()
