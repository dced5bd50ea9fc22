"""DeepMind's Mathematics Dataset as a built-in causal-LM task: ``deepmind-math``.

The questions and answers are generated on the fly by the ``mathematics-dataset``
package (PyPI, Apache-2.0; Saxton et al., ICLR 2019): 56 modules in 8 categories
(``algebra__linear_1d``, ``arithmetic__mul``, ``polynomials__expand``...), each a
generator of exact-answer questions. Every example carries its module as its ``group``,
so ``--partition group`` gives each client whole modules (non-IID by topic).

* Training examples come from the package's ``train`` modules at its training entropy
  (the whole range, or one third of it: ``easy``, ``medium`` or ``hard``, as the
  package's ``train-easy``/``-medium``/``-hard`` regimes), drawn from the run's seed.
* The held-out test set comes from its ``interpolate`` modules, drawn from a fixed seed
  of its own (:data:`TEST_SEED`), so every run and every seed is scored on the same
  questions. A test question is never a training one: a training draw that repeats a
  test question is dropped (and the test set holds no repeats).
* Each module is seeded on its own (the seed, the split and the module's name), so a
  module's examples do not depend on which other modules are chosen.
* A question or answer longer than the package's limits (160 and 30 characters) is
  redrawn, as the package's own ``generate.sample_from_module`` does.

The package was written for sympy 1.5 and numpy 1. Three shims, installed when it is
first imported, make it run on today's versions without touching its files: sympy's
``base_solution_linear`` is supplied where the package imports it from
(``sympy.solvers.diophantine``; sympy keeps it in ``sympy.solvers.diophantine.
diophantine``), and the one package module that calls numpy's removed ``np.object`` and
``ndarray.itemset`` (``sample/polynomials.py``) sees a numpy whose ``object`` is
Python's and whose ``zeros``/``empty`` arrays have ``itemset`` back. Without the last
two, 18 of the 56 modules raise in 20 draws; with them every module generates (sympy
1.14, numpy 2.4; ``benchmarks/deepmind_math_modules.py``, docs/LARGE_MODELS.md). A module
that still raises stops the load with its name and the error, never silently.

Two more make the package deterministic by seed (it is not on its own): it draws a
variable letter from a set of letters (its order follows ``PYTHONHASHSEED``), and
shuffles a set of its ``Entity`` objects (their order follows their memory addresses).
Here the letters are listed in order and an entity hashes by its creation number.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np

from fedexlora.tasks.base import _CAUSAL_METRICS, Task

__all__ = [
    "DIFFICULTIES",
    "EXCLUDED",
    "INSTALL",
    "TASK_NAME",
    "TEST_PER_MODULE",
    "TEST_SEED",
    "TRAIN_PER_MODULE",
    "generate",
    "is_deepmind_math",
    "load_deepmind_math",
    "module_names",
]

TASK_NAME = "deepmind-math"
INSTALL = "pip install mathematics-dataset"
TRAIN_PER_MODULE = 50
"""Training examples per module when ``max_train`` is not set."""
TEST_PER_MODULE = 10
"""Test examples per module when ``max_test`` is not set."""
TEST_SEED = 58_003
"""The held-out set's seed, the same for every run (the training set follows the run's)."""
DIFFICULTIES = ("easy", "medium", "hard")
EXCLUDED: dict[str, str] = {}
"""Modules left out, with why: none, with the shims (every one of the 56 generates)."""

_MAX_QUESTION = 160  # mathematics_dataset.generate_settings.MAX_QUESTION_LENGTH
_MAX_ANSWER = 30  # ... MAX_ANSWER_LENGTH
_DRAWS = 50  # draws allowed per example before a module is declared unable to fill


def is_deepmind_math(key: str) -> bool:
    """Whether a (lower-cased) task name is ``deepmind-math`` or ``deepmind-math:...``."""
    return key == TASK_NAME or key.startswith(TASK_NAME + ":")


# --------------------------------------------------------------------------------------
# The package, made to run on today's sympy and numpy
# --------------------------------------------------------------------------------------


class _ItemsetArray(np.ndarray):
    """An ndarray with numpy 1's ``itemset(index, value)`` (removed in numpy 2.0)."""

    def itemset(self, *args: Any) -> None:
        """Sets one element: ``itemset(value)`` for a size-1 array, else ``(index, value)``."""
        if len(args) == 1:
            index: Any = (0,) * self.ndim
        elif len(args) == 2:
            index = args[0]
        else:
            index, args = tuple(args[:-1]), (None, args[-1])
        if isinstance(index, (int, np.integer)):
            index = np.unravel_index(int(index), self.shape)
        self[tuple(index)] = args[-1]


class _NumpyOne(types.ModuleType):
    """numpy as the package's ``sample/polynomials.py`` expects it (numpy 1's API).

    Every name is numpy's, except ``object`` (Python's ``object``, numpy 1's alias,
    removed in numpy 1.24) and ``zeros``/``empty``, whose arrays have ``itemset``.
    """

    object = object

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> np.ndarray:
        """``np.zeros``, with ``itemset``."""
        return np.zeros(*args, **kwargs).view(_ItemsetArray)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> np.ndarray:
        """``np.empty``, with ``itemset``."""
        return np.empty(*args, **kwargs).view(_ItemsetArray)


def _generator() -> Any:
    """The package's ``modules.modules``, imported once with the compatibility shims.

    Raises:
        ValueError: When the package is not installed, or sympy has no
            ``base_solution_linear`` to supply.
    """
    try:
        import mathematics_dataset  # noqa: F401 - fails first if the package is missing
    except ImportError as err:
        raise ValueError(
            f"task {TASK_NAME!r} needs the mathematics-dataset package, which is not "
            f"installed; install it with `{INSTALL}`"
        ) from err
    import sympy.solvers.diophantine  # noqa: F401 - the package, not the function

    dioph = sys.modules["sympy.solvers.diophantine"]
    if not hasattr(dioph, "base_solution_linear"):
        inner = sys.modules.get("sympy.solvers.diophantine.diophantine")
        solve = getattr(inner, "base_solution_linear", None)
        if solve is None:
            import sympy

            raise ValueError(
                f"task {TASK_NAME!r}: sympy {sympy.__version__} has no "
                "base_solution_linear, which mathematics-dataset needs; use sympy 1.5-1.14"
            )
        dioph.base_solution_linear = solve
    from mathematics_dataset.sample import polynomials

    if not isinstance(polynomials.np, _NumpyOne):  # numpy 1's API there, whatever numpy's
        polynomials.np = _NumpyOne("numpy")
    from mathematics_dataset.util import composition

    if not isinstance(composition._ALLOWED_SYMBOLS, _SortedSymbols):
        composition._ALLOWED_SYMBOLS = _SortedSymbols(composition._ALLOWED_SYMBOLS)
    if composition.Entity.__hash__ is not _entity_hash:
        init = composition.Entity.__init__

        @functools.wraps(init)
        def numbered(self, *args: Any, **kwargs: Any) -> None:
            self._fedexlora_serial = next(_SERIALS[0])
            init(self, *args, **kwargs)

        composition.Entity.__init__ = numbered
        composition.Entity.__hash__ = _entity_hash
    from mathematics_dataset.modules import modules

    return modules


class _SortedSymbols(frozenset):
    """The package's variable letters, listed in alphabetical order.

    It draws a variable with ``random.choice(list(allowed))``, ``allowed`` a set of
    letters: the order, and so the letter drawn, would change with ``PYTHONHASHSEED``.
    """

    def difference(self, *others: Any) -> _SortedSymbols:
        """The letters not in ``others``, still listed in order."""
        return _SortedSymbols(frozenset.difference(self, *others))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(frozenset.__iter__(self)))


_SERIALS = [itertools.count()]  # reset for every module's draws (_seeded)


def _entity_hash(entity: Any) -> int:
    """A composed question's entity hashed by its creation number, not its address.

    The package shuffles ``list(set(entities))``: with the default hash (the object's
    address) the order before the shuffle, and so the question, changed from run to run.
    """
    return entity._fedexlora_serial


def _entropy_fn(level: int, levels: int):
    """The package's ``generate._make_entropy_fn``: one of ``levels`` thirds of a range."""
    lower, upper = level / levels, (level + 1) / levels

    def modify(range_: tuple[float, float]) -> tuple[float, float]:
        length = range_[1] - range_[0]
        return (range_[0] + lower * length, range_[0] + upper * length)

    return modify


def _flatten(tree: dict, prefix: str | None = None) -> dict[str, Any]:
    """``{"algebra": {"linear_1d": f}}`` -> ``{"algebra__linear_1d": f}``, sorted by name."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}__{key}" if prefix else key
        flat.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return dict(sorted(flat.items()))


def _modules(split: str, difficulty: str | None) -> dict[str, Any]:
    mods = _generator()
    if split == "test":
        return _flatten(mods.test())
    level = (0, 1) if difficulty is None else (DIFFICULTIES.index(difficulty), 3)
    return _flatten(mods.train(_entropy_fn(*level)))


def module_names() -> list[str]:
    """Every module that generates, sorted (the 56 of the package less :data:`EXCLUDED`)."""
    return [m for m in _modules("test", None) if m not in EXCLUDED]


# --------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------


def _generators() -> list[random.Random]:
    """The Python generators the package draws from: ``random``'s, and sympy's own.

    sympy (1.9 and later) keeps its own generators (``sympy.core.random``), which
    ``randprime`` draws from (``numbers__is_prime``).
    """
    found = [random._inst]  # the one behind random.seed / random.random
    sym = sys.modules.get("sympy.core.random")
    for name in ("rng", "_assumptions_rng"):
        gen = getattr(sym, name, None)
        if isinstance(gen, random.Random):
            found.append(gen)
    return found


@contextlib.contextmanager
def _seeded(seed: int, split: str, module: str) -> Iterator[None]:
    """Seeds Python's, sympy's and numpy's global generators (the package draws from them).

    The seed is a hash of ``seed``, the split and the module's name; the run's own
    generator states are restored afterwards.
    """
    digest = hashlib.sha256(f"{seed}/{split}/{module}".encode()).digest()
    value = int.from_bytes(digest[:4], "little")
    gens = _generators()
    states, np_state = [g.getstate() for g in gens], np.random.get_state()
    for gen in gens:
        gen.seed(value)
    np.random.seed(value)
    _SERIALS[0] = itertools.count()
    try:
        yield
    finally:
        for gen, state in zip(gens, states, strict=True):
            gen.setstate(state)
        np.random.set_state(np_state)


def _draw(module: str, fn, count: int, skip: frozenset[str], distinct: bool) -> list[tuple]:
    """``count`` (question, answer) pairs of one module, none of whose questions is in ``skip``."""
    import numpy
    import sympy

    out: list[tuple[str, str]] = []
    seen = set(skip)
    for _ in range(_DRAWS * count):
        if len(out) == count:
            return out
        try:
            problem = fn()
        except Exception as err:  # noqa: BLE001 - any failure of the package, named
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(
                f"task {TASK_NAME!r}: module {module!r} failed to generate with sympy "
                f"{sympy.__version__} and numpy {numpy.__version__} "
                f"({type(err).__name__}: {detail}); name the modules to use, "
                f"e.g. '{TASK_NAME}:arithmetic'"
            ) from err
        question, answer = str(problem.question), str(problem.answer)
        if len(question) > _MAX_QUESTION or len(answer) > _MAX_ANSWER or question in seen:
            continue
        if distinct:
            seen.add(question)
        out.append((question, answer))
    if len(out) == count:
        return out
    raise ValueError(
        f"task {TASK_NAME!r}: module {module!r} gave only {len(out)} distinct usable "
        f"questions of the {count} asked in {_DRAWS * count} draws; ask for fewer examples"
    )


@functools.lru_cache(maxsize=4)
def generate(
    modules: tuple[str, ...],
    difficulty: str | None,
    seed: int,
    train_counts: tuple[int, ...],
    test_counts: tuple[int, ...],
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """The (question, answer, module) rows of the training and the test split.

    The test rows come first, from :data:`TEST_SEED` and distinct; then the training
    rows from ``seed``, none repeating a test question. Cached: a run's checks and the
    run itself generate once.

    Args:
        modules: Module names, in order.
        difficulty: ``None`` (the whole training entropy range), or one of
            :data:`DIFFICULTIES`.
        seed: The training split's seed.
        train_counts: Training examples per module.
        test_counts: Test examples per module.

    Returns:
        ``(train, test)``, each a list of ``(question, answer, module)``, by module.
    """
    test_fns, train_fns = _modules("test", None), _modules("train", difficulty)
    train: list[tuple[str, str, str]] = []
    test: list[tuple[str, str, str]] = []
    for module, n_train, n_test in zip(modules, train_counts, test_counts, strict=True):
        with _seeded(TEST_SEED, "test", module):
            held = _draw(module, test_fns[module], n_test, frozenset(), distinct=True)
        with _seeded(seed, "train", module):
            taken = _draw(
                module, train_fns[module], n_train, frozenset(q for q, _ in held), distinct=False
            )
        test += [(q, a, module) for q, a in held]
        train += [(q, a, module) for q, a in taken]
    return train, test


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


def _parse(key: str) -> tuple[list[str], str | None]:
    """The modules and the difficulty that ``deepmind-math[:ITEM,...]`` names.

    An item is a module (``algebra__linear_1d``), a category (``algebra``: its modules)
    or a difficulty (``easy``, ``medium``, ``hard``; at most one).
    """
    known = module_names()
    items = [s.strip() for s in key.partition(":")[2].split(",") if s.strip()]
    if key != TASK_NAME and not items:
        raise ValueError(
            f"task {key!r}: name modules, categories or a difficulty after "
            f"'{TASK_NAME}:', e.g. '{TASK_NAME}:algebra,arithmetic__mul'"
        )
    chosen: list[str] = []
    difficulty = None
    categories = sorted({m.split("__")[0] for m in known})
    for item in items:
        if item in DIFFICULTIES:
            if difficulty not in (None, item):
                raise ValueError(
                    f"task {key!r} names two difficulties, {difficulty!r} and {item!r}; name one"
                )
            difficulty = item
        elif item in known:
            chosen.append(item)
        elif item in categories:
            chosen += [m for m in known if m.split("__")[0] == item]
        elif item in EXCLUDED:
            raise ValueError(
                f"task {key!r}: module {item!r} is left out ({EXCLUDED[item]}); "
                "see docs/LARGE_MODELS.md"
            )
        else:
            raise ValueError(
                f"task {key!r}: unknown module {item!r}; choose modules such as "
                f"'algebra__linear_1d', the categories {', '.join(categories)}, or a "
                f"difficulty ({', '.join(DIFFICULTIES)}); list them with "
                "`python -c 'from fedexlora.tasks.deepmind_math import module_names; "
                "print(module_names())'`"
            )
    chosen = list(dict.fromkeys(chosen)) or known
    return chosen, difficulty


def _spread(total: int | None, per_module: int, modules: list[str], arg: str) -> tuple[int, ...]:
    """``total`` examples spread over the modules (the first ones get one more), or the default."""
    n = len(modules)
    if total is None:
        return (per_module,) * n
    if total < n:
        raise ValueError(
            f"task {TASK_NAME!r}: {arg}={total} gives no example to some of its {n} "
            f"modules; use {arg} >= {n}, or name fewer modules"
        )
    base, extra = divmod(int(total), n)
    return tuple(base + (i < extra) for i in range(n))


def load_deepmind_math(
    key: str, *, seed: int, max_train: int | None = None, max_test: int | None = None
) -> Task:
    """The ``deepmind-math`` task: generated questions, their module as ``group``.

    Args:
        key: ``deepmind-math`` (every module) or ``deepmind-math:ITEM,...`` (see
            :func:`_parse`), lower-cased.
        seed: The training split's seed (the test split's is :data:`TEST_SEED`).
        max_train: Training examples in all, spread evenly over the modules (default
            :data:`TRAIN_PER_MODULE` per module).
        max_test: Test examples in all, likewise (default :data:`TEST_PER_MODULE`).

    Returns:
        A causal-LM :class:`Task` with ``prompt``, ``response``, ``answer`` and ``group``
        columns, scored by exact match of the answer string (``answer_style="text"``).

    Raises:
        ValueError: For a missing package, an unknown module, fewer examples than
            modules, or a module that fails to generate.
    """
    modules, difficulty = _parse(key)
    train_counts = _spread(max_train, TRAIN_PER_MODULE, modules, "max_train")
    test_counts = _spread(max_test, TEST_PER_MODULE, modules, "max_test")
    train, test = generate(tuple(modules), difficulty, int(seed), train_counts, test_counts)
    features = datasets.Features(
        {k: datasets.Value("string") for k in ("prompt", "response", "answer", "group")}
    )

    def split(rows: list[tuple[str, str, str]], order_seed: int) -> datasets.Dataset:
        order = np.random.default_rng(order_seed).permutation(len(rows))
        picked = [rows[i] for i in order]
        columns = {
            "prompt": [q for q, _, _ in picked],
            "response": [a for _, a, _ in picked],
            "answer": [a for _, a, _ in picked],
            "group": [m for _, _, m in picked],
        }
        return datasets.Dataset.from_dict(columns, features=features)

    return Task(
        name=key,
        kind="causal_lm",
        train=split(train, int(seed)),
        test=split(test, TEST_SEED),
        num_labels=0,
        metric_names=list(_CAUSAL_METRICS),
        answer_style="text",
    )
