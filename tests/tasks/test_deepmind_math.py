"""deepmind-math: DeepMind's generated mathematics questions, by module, scored exactly."""

import json
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from fedexlora.tasks import deepmind_math as dm
from fedexlora.tasks.data import load_task
from fedexlora.tasks.metrics import exact_match
from fedexlora.tasks.partition import partition

# cheap modules (about a millisecond a question), one of which needs the numpy shims
CHEAP = "deepmind-math:arithmetic__add_or_sub,numbers__gcd,comparison__pair,numbers__is_prime"


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test generates anew (``generate`` caches its last few calls)."""
    dm.generate.cache_clear()
    yield
    dm.generate.cache_clear()


def _rows(ds):
    return list(zip(ds["prompt"], ds["answer"], ds["group"], strict=True))


def test_generation_is_deterministic_by_seed_and_the_test_set_has_its_own():
    a = load_task(CHEAP, seed=0, max_train=40, max_test=12)
    dm.generate.cache_clear()
    b = load_task(CHEAP, seed=0, max_train=40, max_test=12)
    c = load_task(CHEAP, seed=1, max_train=40, max_test=12)
    assert _rows(a.train) == _rows(b.train) and _rows(a.test) == _rows(b.test)
    assert len(a.train) == 40 and len(a.test) == 12
    assert set(_rows(a.train)) != set(_rows(c.train))  # the run's seed draws the training set
    assert _rows(a.test) == _rows(c.test)  # the held-out set: the same for every seed
    assert a.train["response"] == a.train["answer"]
    assert a.kind == "causal_lm" and a.answer_style == "text"
    assert a.metric_names[0] == "exact_match"
    # 40 over 4 modules: 10 each; 12: 3 each
    assert {g: a.train["group"].count(g) for g in set(a.train["group"])} == {
        g: 10 for g in CHEAP.partition(":")[2].split(",")
    }
    assert sorted(set(a.test["group"])) == sorted(CHEAP.partition(":")[2].split(","))
    # the run's own random generators (Python's, sympy's, numpy's) are left as they were
    from sympy.core import random as sympy_random

    def reseed():
        random.seed(5), sympy_random.rng.seed(5), np.random.seed(5)

    def draw():
        return random.random(), sympy_random.rng.random(), np.random.random()

    reseed()
    state = draw()
    reseed()
    dm.generate.cache_clear()
    load_task(CHEAP, seed=3, max_train=8, max_test=4)
    assert draw() == state


def test_a_module_draws_the_same_questions_whatever_else_is_chosen():
    alone = load_task("deepmind-math:numbers__gcd", seed=0, max_train=6, max_test=3)
    both = load_task(CHEAP, seed=0, max_train=24, max_test=12)
    gcd = [r for r in _rows(both.train) if r[2] == "numbers__gcd"]
    assert sorted(_rows(alone.train)) == sorted(gcd)
    assert sorted(_rows(alone.test)) == sorted(
        r for r in _rows(both.test) if r[2] == "numbers__gcd"
    )


COMPOSED = "deepmind-math:algebra__linear_1d,comparison__pair_composed,numbers__gcd_composed"


def test_composed_questions_are_deterministic_too():
    # the package shuffles a set of objects hashed by address: the order must not leak
    a = load_task(COMPOSED, seed=0, max_train=12, max_test=3)
    dm.generate.cache_clear()
    b = load_task(COMPOSED, seed=0, max_train=12, max_test=3)
    assert _rows(a.train) == _rows(b.train) and _rows(a.test) == _rows(b.test)


def test_variable_letters_are_drawn_in_an_order_that_hash_seeds_do_not_change():
    # the package draws a variable with random.choice(list(allowed)), `allowed` a set of
    # letters: listed in set order, the letter drawn would follow PYTHONHASHSEED
    dm.module_names()  # imports the package, with the shims (it needs one to import)
    from mathematics_dataset.util import composition

    letters = composition._ALLOWED_SYMBOLS.difference({"x"}).difference(set("ab"))
    assert list(letters) == sorted(set("cdfghijklmnopqrstuvwyz"))
    assert "e" not in letters and len(letters) == 22


def test_categories_and_difficulty_select_what_they_name():
    task = load_task("deepmind-math:comparison,hard", seed=0, max_train=8, max_test=8)
    names = [m for m in dm.module_names() if m.startswith("comparison__")]
    assert len(names) == 8 and sorted(set(task.train["group"])) == names
    easy = load_task("deepmind-math:comparison__pair,easy", seed=0, max_train=30, max_test=1)
    hard = load_task("deepmind-math:comparison__pair,hard", seed=0, max_train=30, max_test=1)
    # the package's train-easy / train-hard thirds of the entropy range: longer numbers
    assert np.mean([len(q) for q in hard.train["prompt"]]) > np.mean(
        [len(q) for q in easy.train["prompt"]]
    )


def test_every_module_imports_and_the_shimmed_ones_generate():
    # all 56 of the package's modules, none left out (docs/TASKS.md)
    assert len(dm.module_names()) == 56 and dm.EXCLUDED == {}
    # numpy 2 removed ndarray.itemset and np.object: these modules call both
    task = load_task(
        "deepmind-math:polynomials__collect,algebra__linear_1d_composed",
        seed=0, max_train=4, max_test=2,
    )  # fmt: skip
    assert len(task.train) == 4 and all(task.train["answer"])


def test_the_itemset_shim_sets_elements_as_numpy_1_did():
    shim = dm._NumpyOne("numpy")
    a = shim.zeros((2, 3), dtype=np.int64)
    a.itemset((1, 2), 7)
    a.itemset(4, 5)  # a flat index
    assert a.tolist() == [[0, 0, 0], [0, 5, 7]]
    o = shim.empty((2,), dtype=shim.object)
    o.itemset((1,), [1, 2])  # an object array keeps the list as one element
    assert o[1] == [1, 2] and o.dtype == object
    assert shim.ones is np.ones


class _Problem(SimpleNamespace):
    pass


def _tiny_modules(monkeypatch, space: int):
    """Two fake modules whose questions come from ``space`` values (repeats are likely)."""

    def fn(tag):
        return lambda: _Problem(
            question=f"{tag}: what is {(k := random.randrange(space))} + 1?", answer=str(k + 1)
        )

    fake = {"fake__a": fn("a"), "fake__b": fn("b")}
    monkeypatch.setattr(dm, "_modules", lambda split, difficulty: dict(fake))


def test_no_test_question_is_a_training_question(monkeypatch):
    real = load_task(CHEAP, seed=0, max_train=80, max_test=20)
    assert not set(real.test["prompt"]) & set(real.train["prompt"])
    # a module of 12 questions: 8 held out (8 free draws would repeat one), so a training
    # set of 40 drawn freely would hold them; the training draws that repeat one are dropped
    _tiny_modules(monkeypatch, 12)
    task = load_task("deepmind-math", seed=0, max_train=80, max_test=16)
    test = set(task.test["prompt"])
    assert len(test) == 16 == len(task.test)  # distinct
    assert not test & set(task.train["prompt"]) and len(task.train) == 80
    # a module that cannot fill its test set with distinct questions says so
    dm.generate.cache_clear()
    with pytest.raises(ValueError, match=r"module 'fake__a' gave only 12 distinct usable"):
        load_task("deepmind-math:fake__a", seed=0, max_train=5, max_test=13)


def test_partition_by_group_deals_whole_modules_round_robin():
    task = load_task("deepmind-math:numbers", seed=0, max_train=170, max_test=17)
    groups = sorted(set(task.train["group"]))
    assert len(groups) == 17
    parts = partition(task.train, 3, scheme="group", min_partition_size=2)
    assert sorted(i for p in parts for i in p) == list(range(len(task.train)))
    for cid, rows in enumerate(parts):
        held = {task.train["group"][i] for i in rows}
        assert held == set(groups[cid::3])  # the i-th module (sorted) to client i % 3
    with pytest.raises(ValueError, match=r"has 17 groups \(numbers__base_conversion, .* for 18"):
        partition(task.train, 18, scheme="group", min_partition_size=1)
    with pytest.raises(ValueError, match=r"client 2 gets 50 rows, fewer than min_partition"):
        partition(task.train, 3, scheme="group", min_partition_size=55)
    gsm = load_task(CHEAP, seed=0, max_train=8, max_test=4).train.remove_columns("group")
    with pytest.raises(ValueError, match=r"partition 'group' needs a 'group' column"):
        partition(gsm, 2, scheme="group")


def test_exact_match_text_compares_the_whole_answer_string():
    refs = ["-2/21", "-0.5, -1/5, 1, 9", "5*l*(l + 2)", "True", "3:16 AM"]
    good = [" -2/21", "-0.5,  -1/5, 1, 9\nQuestion: more", "\n5*l*(l + 2) ", "True", "3:16\tAM"]
    assert exact_match(good, refs, style="text") == 1.0
    bad = ["-4/42", "-0.5, -1/5, 1", "5*l*(l+2)", "true", "The answer is 3:16 AM"]
    assert exact_match(bad, refs, style="text") == 0.0
    assert exact_match(["", "-2/21"], ["-2/21", "-2/21"], style="text") == 0.5
    with pytest.raises(ValueError, match=r"style must be number, boxed or text, got 'exact'"):
        exact_match(["1"], ["1"], style="exact")


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("deepmind-math:algebra__linear_9d", {}, r"unknown module 'algebra__linear_9d'; choose"),
        ("deepmind-math:", {}, r"name modules, categories or a difficulty after"),
        ("deepmind-math:easy,hard", {}, r"names two difficulties, 'easy' and 'hard'"),
        ("deepmind-math:algebra", {"max_train": 5}, r"max_train=5 gives no example to some of"),
        (CHEAP, {"max_test": 3}, r"max_test=3 gives no example to some of its 4 modules"),
        (CHEAP, {"max_train": 0}, r"max_train must be a positive integer or None, got max_train=0"),
    ],
)
def test_bad_names_and_sizes_are_refused_in_one_line(name, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        load_task(name, seed=0, **kwargs)
    assert "\n" not in str(err.value)


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mathematics_dataset", None)  # import fails
    with pytest.raises(ValueError, match=r"needs the mathematics-dataset package, which is not "):
        load_task("deepmind-math", seed=0)
    with pytest.raises(ValueError, match=r"install it with `pip install mathematics-dataset`$"):
        load_task("deepmind-math:numbers__gcd", seed=0)


def test_a_module_that_raises_is_named_never_skipped(monkeypatch):
    mods = dm._modules

    def broken(split, difficulty):
        out = mods(split, difficulty)
        out["numbers__gcd"] = lambda: np.zeros(2).itemset(0, 1)  # numpy 2: AttributeError
        return out

    monkeypatch.setattr(dm, "_modules", broken)
    with pytest.raises(
        ValueError,
        match=r"module 'numbers__gcd' failed to generate with sympy .* \(AttributeError: .*itemset",
    ):
        load_task(CHEAP, seed=0, max_train=8, max_test=4)


@pytest.mark.parametrize(
    "args,match",
    [
        (["--task", "deepmind-math:nope"], "unknown module 'nope'"),
        (["--task", "deepmind-math", "--max-train", "0"], "`--max-train` must be >= 1, got 0"),
        (
            ["--task", CHEAP, "--max-train", "3", "--clients", "1", "--min-partition-size", "1"],
            "max_train=3 gives no example to some of its 4 modules; use max_train >= 4",
        ),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(args, match, tmp_path, model_never_loads):
    from fedexlora.cli import app

    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "o"), "--no-progress", *args])
    assert res.exit_code == 2, res.output
    assert match in " ".join(res.output.split()) and "Traceback" not in res.output


def test_the_llm_study_by_module(tiny_llama_dir, tmp_path):
    """``compare --study llm`` on a tiny Llama (its task, its group-K clients), one round:
    two clients, each with whole modules, scored by exact match."""
    from fedexlora.cli import app
    from fedexlora.cli.compare import LLM_MODULES

    out = tmp_path / "g"
    res = CliRunner().invoke(app, [
        "compare", "--study", "llm", "--out", str(out), "--model", tiny_llama_dir,
        "--method", "fedex", "--seeds", "0", "--settings", "group-2", "--ranks", "2",
        "--rounds", "1", "--local-steps", "2", "--batch-size", "4", "--max-length", "48",
        "--max-new-tokens", "4", "--max-train", "16", "--max-test", "8",
        "--min-partition-size", "4",
    ], env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 0, res.output
    cell = out / "group-2_r2_seed0"
    saved = (cell / "config.toml").read_text()
    assert "max_new_tokens = 4" in saved and 'partition = "group"' in saved
    table = (cell / "partitions.txt").read_text()
    assert "note:" not in table  # partitioned as asked
    lines = table.splitlines()
    header = lines[0].split()
    assert header[:2] == ["client", "size"] and header[2:] == sorted(LLM_MODULES)
    # the 8 modules sorted, dealt round-robin: client 0 the 1st, 3rd..., 2 rows each
    counts = {int(ln.split()[0]): [int(x) for x in ln.split()[2:]] for ln in lines[1:3]}
    assert counts == {0: [2, 0] * 4, 1: [0, 2] * 4}
    assert "## group-2 (2 clients, group), r=2" in (out / "comparison.md").read_text()
    (row,) = [json.loads(x) for x in (cell / "metrics.jsonl").read_text().splitlines()]
    assert list(row["metrics"])[:3] == ["exact_match", "loss", "perplexity"]
    assert 0.0 <= row["metrics"]["exact_match"] <= 1.0
    assert row["effective_deviation"]["max"] < 1e-5
