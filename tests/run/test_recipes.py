"""The paper's recipes (#18): hub-layout fixtures, MATH answers by hand, recipes end to end."""

import json
import random

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=10)

runner = CliRunner()
SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
            "number_theory", "prealgebra", "precalculus")  # fmt: skip


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    """Small copies of GLUE, GSM8K and MATH in the hub's own file layout and columns."""
    root = tmp_path_factory.mktemp("hub")
    rng = random.Random(0)
    words = ["good", "bad", "fine", "awful", "great", "poor", "nice", "sad"]
    glue = {
        "cola": lambda i: {"sentence": " ".join(rng.sample(words, 3)), "label": i % 2, "idx": i},
        "sst2": lambda i: {"sentence": " ".join(rng.sample(words, 3)), "label": i % 2, "idx": i},
        "rte": lambda i: {"sentence1": "a b", "sentence2": words[i % 8], "label": i % 2, "idx": i},
        "mrpc": lambda i: {"sentence1": "a", "sentence2": words[i % 8], "label": i % 2, "idx": i},
        "qnli": lambda i: {"question": "q?", "sentence": words[i % 8], "label": i % 2, "idx": i},
        "stsb": lambda i: {"sentence1": "a", "sentence2": words[i % 8], "label": float(i % 5),
                           "idx": i},
    }  # fmt: skip
    for sub, make in glue.items():
        for split, n in (("train", 30), ("validation", 12), ("test", 5)):
            _parquet(root / "nyu-mll/glue" / sub / f"{split}-00000-of-00001.parquet",
                     [make(i) for i in range(n)])  # fmt: skip
    for split, n in (("train", 24), ("test", 8)):
        rows = [
            {"question": f"Tom has {i} apples and buys 2. How many?",
             "answer": f"He has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"}
            for i in range(n)
        ]  # fmt: skip
        _parquet(root / "openai/gsm8k/main" / f"{split}-00000-of-00001.parquet", rows)
    metamath = [
        {
            "query": f"What is {i} plus 2?",
            "type": "GSM_Rephrased",
            "response": f"{i} + 2 = {i + 2}.\nThe answer is: {i + 2}",
        }
        for i in range(24)
    ]
    (root / "meta-math/MetaMathQA").mkdir(parents=True)
    (root / "meta-math/MetaMathQA/MetaMathQA-395K.json").write_text(json.dumps(metamath))
    for sub in SUBJECTS:
        for split, n in (("train", 4), ("test", 2)):
            rows = [
                {"problem": f"What is $\\frac{{{i}}}{{2}}$ plus one half?", "level": "Level 1",
                 "type": sub, "solution": f"It is $\\boxed{{\\frac{{{i + 1}}}{{2}}}}$."}
                for i in range(n)
            ]  # fmt: skip
            _parquet(root / "EleutherAI/hendrycks_math" / sub / f"{split}-00000-of-00001.parquet",
                     rows)  # fmt: skip
    return root


def test_math_answers_by_hand():
    from fedexlora.tasks.metrics import exact_match, extract_boxed, math_equal

    assert extract_boxed(r"so $\boxed{\frac{1}{2}}$, not \boxed{3}") == "3"
    assert extract_boxed(r"nested \boxed{\sqrt{x^{2}}} end") == r"\sqrt{x^{2}}"
    assert extract_boxed("no box") is None
    for a, b in [(r"\dfrac{3}{4}", "3/4"), (r"\frac12", r"\frac{1}{2}"), ("0.5", r"\frac12"),
                 ("x = 5", "5"), (r"10\%", "10"), (r"\left( 3, \pi \right)", r"(3,\pi)"),
                 (r"\sqrt2", r"\sqrt{2}"), (r"5\text{ cm}", "5"), (r"90^\circ", "90")]:  # fmt: skip
        assert math_equal(a, b), (a, b)
    assert not math_equal("4", "5") and not math_equal(None, "5")
    preds = [r"The answer is \boxed{\dfrac{1}{2}}.", "so it is 7", r"\boxed{3}", "none"]
    assert exact_match(preds, [r"\frac{1}{2}", "7", "4", "2"], style="boxed") == 0.5
    # GSM8K style is unchanged: the last number on both sides
    assert exact_match(["... so 1,234 in all"], ["#### 1234"]) == 1.0


def test_hub_layout_copies_load_offline(hub_dir):
    from fedexlora.tasks.data import load_task

    sst2 = load_task("glue/sst2", data_dir=hub_dir)
    assert (len(sst2.train), len(sst2.test)) == (30, 12)  # validation is the test split
    assert set(sst2.train.column_names) == {"text", "label"}
    stsb = load_task("stsb", data_dir=hub_dir)
    assert stsb.kind == "regression" and "text_pair" in stsb.train.column_names
    gsm = load_task("gsm8k-full", data_dir=hub_dir)
    assert (len(gsm.train), len(gsm.test)) == (24, 8) and gsm.answer_style == "number"
    row = next(r for r in gsm.test if r["prompt"].startswith("Tom has 3 "))
    assert row["answer"] == "5" and "<<" not in row["response"]  # calculator notes dropped
    math_task = load_task("math", data_dir=hub_dir)
    assert (len(math_task.train), len(math_task.test)) == (28, 14)
    assert math_task.answer_style == "boxed"
    assert sorted(set(math_task.test["answer"])) == [r"\frac{1}{2}", r"\frac{2}{2}"]
    with pytest.raises(ValueError, match="unknown MATH subject 'poetry'"):
        load_task("math/poetry", data_dir=hub_dir)


def test_a_missing_hub_dataset_is_one_clear_error(tmp_path):
    from fedexlora.tasks.data import load_task

    (tmp_path / "openai/gsm8k").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no 'main' folder"):
        load_task("gsm8k-full", data_dir=tmp_path)


def test_recipes_lists_all_six_with_the_papers_figures():
    res = runner.invoke(app, ["recipes"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    expected = [("paper-glue-roberta-base", "84.39"), ("paper-glue-roberta-large", "86.39"),
                ("paper-e2e-gpt2", "68.15"), ("paper-commonsense-llama3.2-3b", "85.99"),
                ("paper-gsm8k-mistral-7b", "62.62"), ("paper-math-gemma2-9b", "39.00")]  # fmt: skip
    for name, fedex in expected:
        line = next(ln for ln in res.output.splitlines() if name in ln)
        assert fedex in line, line


def _run(tmp_path, *args):
    return runner.invoke(app, ["run", "--out", str(tmp_path / "run"), "--no-progress", *args],
                         env={"COLUMNS": "250"})  # fmt: skip


def test_unknown_recipe(tmp_path):
    res = _run(tmp_path, "--recipe", "paper-nope")
    assert res.exit_code == 2 and "unknown recipe 'paper-nope'; choose from" in res.output


def test_a_recipe_in_a_config_file_is_applied_or_refused_before_training(
    tmp_path, model_never_loads
):
    """``recipe = ...`` in a TOML file is --recipe: its settings under the file's own keys;
    an unknown name is refused by validate and by run, before anything loads."""
    from fedexlora.run.recipes import load_config_file as load_config

    good = tmp_path / "good.toml"
    good.write_text('recipe = "paper-glue-roberta-base"\nlora-alpha = 3.0\n')
    cfg = load_config(good)
    assert (cfg.lora_r, cfg.lora_alpha, cfg.task) == (4, 3.0, "glue/cola")  # recipe's r = 4
    assert load_config(good, {"lora_r": 2}).lora_r == 2  # a flag on top of both
    bad = tmp_path / "bad.toml"
    bad.write_text('recipe = "paper-nope"\n')
    for res in (runner.invoke(app, ["validate", str(bad)]),
                _run(tmp_path, "--config", str(bad))):  # fmt: skip
        assert res.exit_code == 2, res.output
        assert "`recipe`: unknown recipe 'paper-nope'; choose from" in " ".join(res.output.split())
    assert not (tmp_path / "run").exists()


def test_a_recipe_in_a_flower_run_config_labels_and_the_summary_says_how_it_departs():
    """A Flower run config declares every key, so there ``recipe`` fixes nothing: the
    summary's paper section lists each setting the run holds otherwise, read from the
    configuration itself (as for flags over --recipe)."""
    from pathlib import Path

    import tomllib

    from fedexlora.flower.records import resolve_run_config
    from fedexlora.run.recipes import RECIPES, recipe_section

    root = Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    name = "paper-glue-roberta-base"
    cfg, _ = resolve_run_config({**declared["config"], "recipe": name})
    rows = [{"method": "fedex", "round": 1, "metrics": {"mcc": 0.5}}]
    text = " ".join(recipe_section(cfg, rows).split())
    assert "This run departs from the recipe: task = bbc-news (recipe: glue/cola, " in text
    assert "lora_r = 8 (recipe: 4)" in text and "rounds = 3 (recipe: 50)" in text
    agrees = cfg.replace(task="glue/cola", **RECIPES[name].settings)
    assert "departs" not in recipe_section(agrees, rows)


def test_a_recipe_in_a_config_file_runs_every_task(tmp_path, hub_dir, tiny_bert_dir):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'recipe = "paper-glue-roberta-base"\nmodel = "{tiny_bert_dir}"\n'
                   f'data_dir = "{hub_dir}"\nrounds = 1\nlocal_steps = 1\nbatch_size = 8\n'
                   'max_length = 16\nmin_partition_size = 2\nmethods = ["fedex"]\n')  # fmt: skip
    res = _run(tmp_path, "--config", str(cfg))
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    for task in ("cola", "rte", "mrpc", "sst2", "qnli", "stsb"):
        assert (run / f"glue-{task}" / "metrics.jsonl").is_file()
    assert _paper_rows((run / "summary.md").read_text())["fedex"][0] == 84.39


def _paper_rows(text: str) -> dict[str, tuple[float, float, float]]:
    out = {}
    for ln in text.split("this run − paper |")[1].splitlines()[2:]:
        if not ln.startswith("| "):
            break
        m, paper, ours, diff = [c.strip() for c in ln.strip("|").split("|")]
        out[m] = (float(paper), float(ours), float(diff))
    return out


@pytest.mark.parametrize("recipe", ["paper-gsm8k-mistral-7b", "paper-math-gemma2-9b"])
def test_llm_recipe_end_to_end_with_the_paper_beside(tmp_path, hub_dir, tiny_llama_dir, recipe):
    from fedexlora.run.recipes import RECIPES

    res = _run(tmp_path, "--recipe", recipe, "--model", tiny_llama_dir, "--data-dir",
               str(hub_dir), "--max-train", "12", "--max-test", "4", "--max-length", "48",
               "--max-new-tokens", "4", "--local-steps", "1", "--batch-size", "4",
               "--min-partition-size", "2")  # fmt: skip
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert f"--model {tiny_llama_dir} overrides recipe {recipe}'s" in out
    assert "--max-new-tokens 4 overrides" in out
    # the final table has the paper's figure and the difference beside each method
    fedex_line = next(ln for ln in res.output.splitlines() if ln.startswith("│ fedex "))
    assert f"{RECIPES[recipe].paper['fedex']:.2f}" in fedex_line
    cfg = (tmp_path / "run" / "config.toml").read_text()
    assert f'recipe = "{recipe}"' in cfg and "lora_r = 32" in cfg and 'dtype = "bf16"' in cfg
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["centralized", "fedit", "ffa", "fedex"]
    summary = " ".join((tmp_path / "run/summary.md").read_text().split())
    assert f"This run departs from the recipe: model = {tiny_llama_dir} (recipe: " in summary
    assert "max_new_tokens = 4 (recipe: 512)" in summary and "lora_r = 32 (" not in summary
    table = _paper_rows((tmp_path / "run/summary.md").read_text())
    for r in rows:
        paper, ours, diff = table[r["method"]]
        assert paper == RECIPES[recipe].paper[r["method"]]
        assert ours == pytest.approx(100 * r["metrics"]["exact_match"], abs=0.005)
        assert diff == pytest.approx(ours - paper, abs=0.011)


def test_glue_recipe_runs_every_task_and_averages(tmp_path, hub_dir, tiny_bert_dir):
    res = _run(tmp_path, "--recipe", "paper-glue-roberta-base", "--model", tiny_bert_dir,
               "--data-dir", str(hub_dir), "--rounds", "1", "--local-steps", "1",
               "--batch-size", "8", "--max-length", "16", "--min-partition-size", "2",
               "--method", "fedit,fedex")  # fmt: skip
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    finals: dict[str, list[float]] = {"fedit": [], "fedex": []}
    for task in ("cola", "rte", "mrpc", "sst2", "qnli", "stsb"):
        rows = [json.loads(x) for x in (run / f"glue-{task}" / "metrics.jsonl").read_text()
                .splitlines()]  # fmt: skip
        for r in rows:
            finals[r["method"]].append(100 * next(iter(r["metrics"].values())))
    table = _paper_rows((run / "summary.md").read_text())
    assert set(table) == {"fedit", "fedex"}
    for m, vals in finals.items():
        assert len(vals) == 6
        assert table[m][1] == pytest.approx(sum(vals) / 6, abs=0.005)
        assert table[m][0] == {"fedit": 83.42, "fedex": 84.39}[m]
    text = (run / "summary.md").read_text()
    assert "| glue/stsb | " in text and "| task | fedit | fedex |" in text


def test_one_task_of_a_multi_task_recipe(tmp_path, hub_dir, tiny_bert_dir):
    res = _run(tmp_path, "--recipe", "paper-glue-roberta-large", "--task", "glue/sst2",
               "--model", tiny_bert_dir, "--data-dir", str(hub_dir), "--rounds", "1",
               "--local-steps", "1", "--batch-size", "8", "--max-length", "16",
               "--min-partition-size", "2", "--method", "fedex")  # fmt: skip
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").is_file() and not (run / "glue-cola").exists()
    text = " ".join((run / "summary.md").read_text().split())
    assert "This run covers glue/sst2 only; the paper's figure is the average over" in text
    assert _paper_rows((run / "summary.md").read_text())["fedex"][0] == 86.39
    out = " ".join(res.output.split())
    assert "note: the paper's figure for paper-glue-roberta-large is the average over 6" in out
    assert "86.39" not in next(ln for ln in res.output.splitlines() if ln.startswith("│ fedex"))


def test_multi_task_recipe_runs_every_task_under_flower(tmp_path, hub_dir, tiny_bert_dir,
                                                        monkeypatch):  # fmt: skip
    """--engine flower used to run only a multi-task recipe's first task, silently.

    Each task must reach the Flower engine, in its own directory; the Flower engine itself
    is tested elsewhere (test_flower.py), so here each call it gets is recorded and run
    in-process, which writes the same run directory.
    """
    import dataclasses

    import fedexlora.flower.simulation as flower_sim
    from fedexlora.run import recipes
    from fedexlora.run.inprocess import run_experiment

    two = dataclasses.replace(recipes.RECIPES["paper-glue-roberta-base"],
                              tasks=("glue/sst2", "glue/rte"))  # fmt: skip
    monkeypatch.setitem(recipes.RECIPES, two.name, two)
    calls = []

    def flower(cfg, out_dir, *, progress=True, console=None, resume=False, **_):
        calls.append((cfg.engine, cfg.task, out_dir.name, resume))
        return run_experiment(cfg.replace(engine="local"), out_dir, resume=resume,
                              progress=False)  # fmt: skip

    monkeypatch.setattr(flower_sim, "run_flower_experiment", flower)
    res = _run(tmp_path, "--recipe", two.name, "--engine", "flower", "--model", tiny_bert_dir,
               "--data-dir", str(hub_dir), "--rounds", "1", "--local-steps", "1",
               "--clients", "2", "--batch-size", "8", "--max-length", "16",
               "--min-partition-size", "2", "--method", "fedex")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert calls == [("flower", "glue/sst2", "glue-sst2", False),
                     ("flower", "glue/rte", "glue-rte", False)]  # fmt: skip
    run = tmp_path / "run"
    for task in ("glue-sst2", "glue-rte"):
        rows = [json.loads(x) for x in (run / task / "metrics.jsonl").read_text().splitlines()]
        assert [(r["method"], r["round"]) for r in rows] == [("fedex", 1)], task
        assert (run / task / "summary.md").is_file() and (run / task / "partitions.txt").is_file()
    text = (run / "summary.md").read_text()
    assert "| glue/sst2 | " in text and "| glue/rte | " in text
