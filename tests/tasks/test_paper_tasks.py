"""The paper's other tasks (#18): E2E NLG, commonsense and MetaMathQA.

Each loader reads a fixture written in its source's own layout; each metric is checked on
examples worked by hand; each recipe runs end to end on a tiny model.
"""

import json
import math
import random

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=8)

runner = CliRunner()


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


MRS = [
    "name[The Eagle], eatType[coffee shop], food[French], area[riverside]",
    "name[Zizzi], eatType[pub], priceRange[cheap], customer rating[5 out of 5]",
    "name[Aromi], food[Italian], familyFriendly[yes], near[The Rice Boat]",
]
COMMONSENSE = {
    "boolq": ("Please answer the following question with true or false, question: is it "
              "wet?\n\nAnswer format: true/false", ["true", "false"]),
    "piqa": ("Please choose the correct solution to the question: open a jar\n\nSolution1: "
             "twist Solution2: stare\n\nAnswer format: solution1/solution2",
             ["solution1", "solution2"]),
    "social_i_qa": ("Please choose the correct answer to the question: why?\n\nAnswer1: a "
                    "Answer2: b Answer3: c\n\nAnswer format: answer1/answer2/answer3",
                    ["answer1", "answer2", "answer3"]),
    "hellaswag": ("Please choose the correct ending to complete the given sentence: He "
                  "sat\n\nEnding1: down Ending2: up Ending3: on Ending4: in\n\nAnswer "
                  "format: ending1/ending2/ending3/ending4",
                  ["ending1", "ending2", "ending3", "ending4"]),
    "winogrande": ("Please choose the correct answer to fill in the blank: _ won.\n\n"
                   "Option1: Ann Option2: Bo Answer format: option1/option2",
                   ["option1", "option2"]),
    "ARC-Easy": ("Please choose the correct answer to the question: 2+2?\n\nAnswer1: 4 "
                 "Answer2: 5\n\nAnswer format: answer1/answer2", ["answer1", "answer2"]),
    "ARC-Challenge": ("Please choose the correct answer to the question: hard?\n\nAnswer1: "
                      "yes Answer2: no\n\nAnswer format: answer1/answer2",
                      ["answer1", "answer2"]),
    "openbookqa": ("Please choose the correct answer to the question: sun?\n\nAnswer1: hot "
                   "Answer2: cold\n\nAnswer format: answer1/answer2", ["answer1", "answer2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def paper_dir(tmp_path_factory):
    """E2E (hub parquet conversion), LLM-Adapters' commonsense files, MetaMathQA and GSM8K."""
    root = tmp_path_factory.mktemp("paper-data")
    e2e = root / "tuetschek/e2e_nlg/default"
    refs = ["The Eagle is a French coffee shop by the riverside.",
            "Zizzi is a cheap pub rated 5 out of 5.",
            "Aromi is a family friendly Italian place near The Rice Boat."]  # fmt: skip
    train = [{"meaning_representation": MRS[i % 3], "human_reference": refs[i % 3]}
             for i in range(18)]  # fmt: skip
    _parquet(e2e / "train/0000.parquet", train)
    _parquet(e2e / "validation/0000.parquet", train[:3])
    # the official test layout: one row per (MR, reference), an MR repeated per reference
    test = [
        {"meaning_representation": MRS[0], "human_reference": refs[0]},
        {"meaning_representation": MRS[1], "human_reference": refs[1]},
        {
            "meaning_representation": MRS[0],
            "human_reference": "By the river, The Eagle serves French food.",
        },
        {"meaning_representation": MRS[2], "human_reference": refs[2]},
        {"meaning_representation": MRS[0], "human_reference": "The Eagle coffee shop."},
    ]
    _parquet(e2e / "test/0000.parquet", test)

    llm_adapters = root / "AGI-Edgerunners/LLM-Adapters"
    rng = random.Random(0)
    mixture = []
    for task, (instruction, choices) in COMMONSENSE.items():
        rows = []
        for i in range(3):
            answer = choices[i % len(choices)]
            rows.append(
                {
                    "instruction": instruction,
                    "input": "",
                    "output": f"the correct answer is {answer}",
                    "answer": answer,
                }
            )
        (llm_adapters / "dataset" / task).mkdir(parents=True)
        (llm_adapters / "dataset" / task / "test.json").write_text(json.dumps(rows, indent=4))
        mixture += rows
    rng.shuffle(mixture)
    (llm_adapters / "ft-training_set").mkdir(parents=True)
    (llm_adapters / "ft-training_set/commonsense_170k.json").write_text(json.dumps(mixture))

    metamath = [
        {
            "query": f"What is {i} plus 2?",
            "type": "GSM_Rephrased",
            "original_question": f"What is {i} plus 2?",
            "response": f"{i} + 2 = {i + 2}.\nThe answer is: {i + 2}",
        }
        for i in range(30)
    ]
    (root / "meta-math/MetaMathQA").mkdir(parents=True)
    (root / "meta-math/MetaMathQA/MetaMathQA-395K.json").write_text(json.dumps(metamath))
    for split, n in (("train", 6), ("test", 5)):
        rows = [
            {
                "question": f"Tom has {i} apples and buys 2. How many?",
                "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}",
            }
            for i in range(n)
        ]
        _parquet(root / "openai/gsm8k/main" / f"{split}-00000-of-00001.parquet", rows)
    for sub in ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                "number_theory", "prealgebra", "precalculus"):  # fmt: skip
        rows = [{"problem": "What is $1+1$?", "level": "Level 1", "type": sub,
                 "solution": "It is $\\boxed{2}$."}]  # fmt: skip
        for split in ("train", "test"):
            _parquet(root / "EleutherAI/hendrycks_math" / sub / f"{split}-00000-of-00001.parquet",
                     rows)  # fmt: skip
    return root


# --- metrics, by hand -------------------------------------------------------------------


def test_bleu_by_hand():
    from fedexlora.tasks.nlg_metrics import bleu

    # one hypothesis, one reference: p1..p4 = 4/5, 3/4, 2/3, 1/2, no brevity penalty
    assert bleu(["a b c d e"], [["a b c d f"]]) == pytest.approx(
        (4 / 5 * 3 / 4 * 2 / 3 / 2) ** 0.25
    )
    # two references equally far in length (3 and 5 for 4 words): the shorter counts, so no
    # brevity penalty; all n-grams match the first reference
    assert bleu(["a b c d"], [["a b c d e", "a b c"]]) == pytest.approx(1.0)
    # case-insensitive, punctuation split off as mteval-v13a does
    assert bleu(["The Eagle, by the river."], [["the eagle , by the river ."]]) == pytest.approx(1)
    # a short corpus: brevity penalty exp(1 - 5/4) on the same precisions
    hyp, ref = ["a b c d"], [["a b c d e"]]
    assert bleu(hyp, ref) == pytest.approx(math.exp(1 - 5 / 4))


def test_nist_by_hand():
    from fedexlora.tasks.nlg_metrics import nist

    # references "a b" and "a c": counts () 4, a 2, b 1, c 1, ab 1, ac 1. info(a) = log2 4/2
    # = 1, info(b) = info(c) = log2 4/1 = 2, info(ab) = info(ac) = log2 2/1 = 1.
    assert nist(["a b", "a c"], [["a b"], ["a c"]]) == pytest.approx((3 + 3) / 4 + (1 + 1) / 2)
    # "a" alone for the second: unigrams (1+2 + 1)/3, bigrams 1/1; length 3 of 4 gives the
    # penalty exp(-beta log(3/4)^2), beta = -log(0.5) / log(1.5)^2
    beta = -math.log(0.5) / math.log(1.5) ** 2
    want = (4 / 3 + 1) * math.exp(-beta * math.log(3 / 4) ** 2)
    assert nist(["a b", "a"], [["a b"], ["a c"]]) == pytest.approx(want)


def test_meteor_rouge_cider_by_hand():
    from fedexlora.tasks.nlg_metrics import cider, e2e_scores, meteor, rouge_l

    # METEOR: all 3 match in 1 chunk: 1 - 0.5 (1/3)^3; "cats" meets "cat" by its stem
    assert meteor(["a b c"], [["a b c"]]) == pytest.approx(1 - 0.5 / 27)
    assert meteor(["cats run"], [["cat run"]]) == pytest.approx(1 - 0.5 / 8)
    # ROUGE-L: LCS "a c d" = 3, P = 3/4, R = 3/5, F with beta 1.2
    p, r, b2 = 3 / 4, 3 / 5, 1.2**2
    assert rouge_l(["a b c d"], [["a c d e f"]]) == pytest.approx((1 + b2) * p * r / (r + b2 * p))
    # best precision and best recall are taken over the references separately
    assert rouge_l(["a b"], [["a b c d", "a"]]) == pytest.approx(1.0)
    # CIDEr-D on two one-word captions: only unigrams, idf log(2/1) on both sides, so each
    # n=1 cosine is 1 (or 0), n=2..4 give 0; x10 / 4
    assert cider(["a", "b"], [["a"], ["b"]]) == pytest.approx(2.5)
    assert cider(["a", "a"], [["a"], ["b"]]) == pytest.approx(1.25)
    got = e2e_scores(["", "b"], [["a"], ["b"]])  # an empty generation scores, no crash
    assert list(got) == ["bleu", "nist", "meteor", "rouge_l", "cider"]
    assert got["rouge_l"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="references must be a non-empty list"):
        e2e_scores(["a"], ["a"])


def test_commonsense_answers_by_hand():
    from fedexlora.tasks.metrics import choice_accuracy, extract_choice

    assert extract_choice("The correct answer is TRUE, not false", "boolq") == "true"
    assert extract_choice("the correct answer is solution2", "piqa") == "solution2"
    assert extract_choice("answer3 I think", "ARC-Challenge") == "answer3"
    assert extract_choice("ending4", "hellaswag") == "ending4"
    assert extract_choice("no idea", "winogrande") == ""
    got = choice_accuracy(
        ["true", "false", "option1", "the answer is option2", "answer1"],
        ["true", "true", "option1", "option1", "answer1"],
        ["boolq", "boolq", "winogrande", "winogrande", "openbookqa"],
    )
    # per task 1/2, 1/2, 1; the average is over tasks (the paper's "Avg."), not examples
    assert got == {"accuracy": pytest.approx(2 / 3), "accuracy_boolq": 0.5,
                   "accuracy_openbookqa": 1.0, "accuracy_winogrande": 0.5}  # fmt: skip


def test_metamath_answers_by_hand():
    from fedexlora.tasks.metrics import exact_match

    # GSM8K: the number after the last "The answer is", even if more text follows
    preds = ["6 + 2 = 8.\nThe answer is: 8\n\nQuestion: what is 3 + 4? 7", "so 1,234 in all"]
    assert exact_match(preds, ["8", "#### 1234"]) == 1.0
    # the made-up next example a model runs on into is cut off before an answer is read
    from fedexlora.training.local import cut_at_stop

    ran_on = (
        "2+6=8.\nThe answer is: 8\n\n### Instruction:\nWhat is 3+4?\n\n"
        "### Response:\nThe answer is: 7"
    )
    assert exact_match([cut_at_stop(ran_on, "alpaca")], ["8"]) == 1.0
    assert exact_match([ran_on], ["8"]) == 0.0  # what reading it uncut would give
    assert cut_at_stop("so 5\nQuestion: and 6?", "qa") == "so 5"
    assert cut_at_stop(" The Eagle is nice.\nname[x]", "e2e") == " The Eagle is nice."
    # MATH: the boxed answer, else what follows "The answer is"
    preds = ["x = 1/2.\nThe answer is: \\frac{1}{2}", "The answer is: 3.", "\\boxed{4} or 5"]
    assert exact_match(preds, ["\\frac12", "3", "5"], style="boxed") == pytest.approx(2 / 3)


# --- loaders ----------------------------------------------------------------------------


def test_e2e_loader_groups_the_references(paper_dir):
    from fedexlora.tasks.data import load_task

    task = load_task("e2e_nlg", data_dir=paper_dir)
    assert (len(task.train), task.answer_style, task.template) == (18, "nlg", "e2e")
    assert task.test["prompt"] == MRS  # one row per MR, in first-seen order
    assert [len(r) for r in task.test["references"]] == [3, 1, 1]
    assert task.test["references"][0][2] == "The Eagle coffee shop."
    assert task.metric_names[0] == "bleu"


def test_commonsense_loader_and_one_task(paper_dir):
    from fedexlora.tasks.data import load_task

    task = load_task("commonsense", data_dir=paper_dir)
    assert (len(task.train), len(task.test)) == (24, 24)
    assert sorted(set(task.test["group"])) == sorted(t.lower() for t in COMMONSENSE)
    row = next(r for r in task.test if r["group"] == "piqa")
    assert row["prompt"].startswith("Please choose the correct solution") and row["answer"] in (
        "solution1", "solution2")  # fmt: skip
    one = load_task("commonsense/ARC-Easy", data_dir=paper_dir)
    assert set(one.test["group"]) == {"arc-easy"} and len(one.test) == 3
    with pytest.raises(ValueError, match="unknown commonsense task 'siqa'"):
        load_task("commonsense/siqa", data_dir=paper_dir)


def test_metamath_loader_takes_the_first_20k(paper_dir, monkeypatch):
    import fedexlora.tasks.hubtasks as hubtasks
    from fedexlora.tasks.data import load_task

    monkeypatch.setattr(hubtasks, "METAMATH_TRAIN", 20)  # the first 20 of 30, in file order
    task = load_task("metamath-gsm8k", data_dir=paper_dir)
    assert len(task.train) == 20 and len(task.test) == 5
    assert sorted(task.train["answer"], key=int) == [str(i + 2) for i in range(20)]
    assert task.template == "alpaca" and task.answer_style == "number"
    assert load_task("metamath-math", data_dir=paper_dir).answer_style == "boxed"


def test_a_missing_source_file_is_one_clear_error(tmp_path):
    from fedexlora.tasks.data import load_task

    (tmp_path / "AGI-Edgerunners/LLM-Adapters").mkdir(parents=True)
    with pytest.raises(ValueError, match="has no 'ft-training_set/commonsense_170k.json'"):
        load_task("commonsense", data_dir=tmp_path)


# --- recipes end to end -----------------------------------------------------------------


def _run(tmp_path, *args):
    return runner.invoke(app, ["run", "--out", str(tmp_path / "run"), "--no-progress",
                               "--rounds", "1", "--local-steps", "1", "--batch-size", "4",
                               "--min-partition-size", "2", *args],
                         env={"COLUMNS": "250"})  # fmt: skip


def _rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]


def test_e2e_recipe_end_to_end(tmp_path, paper_dir, tiny_gpt2_dir):
    res = _run(
        tmp_path,
        "--recipe",
        "paper-e2e-gpt2",
        "--model",
        tiny_gpt2_dir,
        "--data-dir",
        str(paper_dir),
        "--max-length",
        "48",
        "--max-new-tokens",
        "6",
        "--num-beams",
        "3",
    )
    assert res.exit_code == 0, res.output
    rows = _rows(tmp_path)
    assert [r["method"] for r in rows] == ["centralized", "fedit", "ffa", "fedex"]
    for r in rows:
        assert list(r["metrics"])[:5] == ["bleu", "nist", "meteor", "rouge_l", "cider"]
    summary = (tmp_path / "run/summary.md").read_text()
    assert "| fedex | 68.15 | " in summary and "| method | bleu | nist | meteor |" in summary
    fedex = rows[-1]["metrics"]
    line = next(ln for ln in summary.splitlines() if ln.startswith("| fedex | ") and
                 ln.count("|") == 7)  # fmt: skip
    assert f"{fedex['nist']:.2f}" in line and f"{fedex['cider']:.2f}" in line
    assert f"{100 * fedex['bleu']:.2f}" in line


def test_commonsense_recipe_end_to_end(tmp_path, paper_dir, tiny_llama_dir):
    res = _run(tmp_path, "--recipe", "paper-commonsense-llama3.2-3b", "--model", tiny_llama_dir,
               "--data-dir", str(paper_dir), "--max-length", "96", "--max-new-tokens", "4",
               "--method", "fedit,fedex")  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = _rows(tmp_path)
    for r in rows:
        per = [v for k, v in r["metrics"].items() if k.startswith("accuracy_")]
        assert len(per) == 8
        assert r["metrics"]["accuracy"] == pytest.approx(sum(per) / 8)
    summary = (tmp_path / "run/summary.md").read_text()
    assert "| fedex | 85.99 | " in summary and "accuracy_hellaswag" in summary


def test_metamath_recipe_trains_on_metamath(tmp_path, paper_dir, tiny_llama_dir):
    res = _run(tmp_path, "--recipe", "paper-gsm8k-mistral-7b", "--model", tiny_llama_dir,
               "--data-dir", str(paper_dir), "--max-length", "48", "--max-new-tokens", "4",
               "--method", "fedex", "--max-train", "12")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert 'task = "metamath-gsm8k"' in (tmp_path / "run/config.toml").read_text()
    assert "exact_match" in _rows(tmp_path)[0]["metrics"]


def test_evaluate_scores_each_generation_against_its_own_references(
    paper_dir, tiny_gpt2_dir, monkeypatch
):
    """The plumbing: references and tasks stay with their example, and beams reach generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fedexlora.training.local as training
    from fedexlora.tasks.data import load_task
    from fedexlora.tasks.metrics import choice_accuracy
    from fedexlora.tasks.nlg_metrics import e2e_scores

    tok = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    seen = {}

    def fake(model, data, tokenizer, max_new_tokens, batch_size, device, num_beams=1, **kw):
        seen.update(kw, num_beams=num_beams)
        # the first reference for the first two examples (the first running on into a made-up
        # next example, which evaluation cuts off), nonsense for the third
        out = [refs[0] if i < 2 else "zzz" for i, refs in enumerate(data.answers)]
        return [out[0] + "\nname[Zizzi] || Zizzi zzz", *out[1:]]

    monkeypatch.setattr(training, "_generate", fake)
    e2e = load_task("e2e_nlg", data_dir=paper_dir)
    data = training.encode(e2e.test, tok, kind="causal_lm", max_length=64, template="e2e")
    got = training.evaluate(model, data, e2e, tokenizer=tok, num_beams=4, batch_size=2)
    refs = e2e.test["references"]
    want = e2e_scores([refs[0][0], refs[1][0], "zzz"], refs)
    assert {k: got[k] for k in want} == pytest.approx(want)
    assert seen == {"num_beams": 4, "no_repeat_ngram_size": 4, "length_penalty": 0.8}

    cs = load_task("commonsense", data_dir=paper_dir)

    def fake_choice(model, data, tokenizer, max_new_tokens, batch_size, device, **kw):
        return [f"the correct answer is {a}" if i % 2 == 0 else "" for i, a in
                enumerate(data.answers)]  # fmt: skip

    monkeypatch.setattr(training, "_generate", fake_choice)
    data = training.encode(cs.test, tok, kind="causal_lm", max_length=96, template="alpaca")
    got = training.evaluate(model, data, cs, tokenizer=tok, batch_size=5)
    texts = [a if i % 2 == 0 else "" for i, a in enumerate(cs.test["answer"])]
    assert got["accuracy"] == pytest.approx(
        choice_accuracy(texts, cs.test["answer"], cs.test["group"])["accuracy"]
    )
    per = {g: [i % 2 == 0 for i, x in enumerate(cs.test["group"]) if x == g]
           for g in set(cs.test["group"])}  # fmt: skip
    for g, hits in per.items():
        assert got[f"accuracy_{g}"] == pytest.approx(sum(hits) / len(hits))


def test_commonsense_downloads_once_then_reads_its_cache(paper_dir, tmp_path, monkeypatch):
    """Online, the files come from the LLM-Adapters repository (here a file:// stand-in)."""
    import shutil

    import fedexlora.tasks.hubtasks as hubtasks
    from fedexlora.tasks.data import load_task

    src = tmp_path / "github"
    shutil.copytree(paper_dir / "AGI-Edgerunners", src / "AGI-Edgerunners")
    monkeypatch.setattr(hubtasks, "_RAW_GITHUB", f"file://{src}/{{repo}}/{{path}}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDEXLORA_DATA_DIR", raising=False)
    first = load_task("commonsense")
    cached = tmp_path / "cache/fedexlora/AGI-Edgerunners/LLM-Adapters/dataset/boolq/test.json"
    assert cached.is_file() and len(first.test) == 24
    shutil.rmtree(src)  # gone "online": the cache serves the same task
    assert load_task("commonsense").test["prompt"] == first.test["prompt"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs 'ft-training_set/commonsense_170k.json' from"):
        load_task("commonsense")


def test_no_repeat_counts_the_generated_tokens_only():
    """A 4-gram of the prompt may be written out; a 4-gram already generated may not."""
    import torch

    from fedexlora.training.local import NoRepeatGeneratedNGrams

    proc = NoRepeatGeneratedNGrams(4, prompt_length=4)
    # prompt 1 2 3 4, generated 1 2 3: writing 4 repeats the prompt's 4-gram, allowed
    # (Hugging Face's no_repeat_ngram_size would ban it)
    assert torch.isfinite(proc(torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), torch.zeros(1, 10))).all()
    # generated 5 6 7 9 5 6 7: a 9 now would repeat a generated 4-gram, banned alone
    scores = proc(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 9, 5, 6, 7]]), torch.zeros(1, 10))
    assert scores[0, 9] == -float("inf") and torch.isfinite(scores[0, :9]).all()
    # prompt 5 6 7 9, generated 0 5 6 7: 9 allowed
    assert torch.isfinite(proc(torch.tensor([[5, 6, 7, 9, 0, 5, 6, 7]]), torch.zeros(1, 10))).all()


def test_commonsense_accuracy_gets_no_single_wilson_interval():
    from fedexlora.run.report import sampled_examples

    row = {"test_examples": 200, "metrics": {"accuracy": 0.5, "accuracy_boolq": 0.5}}
    assert sampled_examples(row) == 0
    assert sampled_examples({"test_examples": 200, "metrics": {"accuracy": 0.5}}) == 200


def test_e2e_says_what_to_install_before_training(paper_dir, monkeypatch):
    import sys

    from fedexlora.tasks.data import load_task

    monkeypatch.setitem(sys.modules, "nltk.translate.meteor_score", None)  # not installed
    with pytest.raises(ValueError, match=r"install them with `pip install 'fedex-lora\[nlg\]'`"):
        load_task("e2e_nlg", data_dir=paper_dir)
