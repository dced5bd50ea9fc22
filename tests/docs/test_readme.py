"""The README's commands and example stay true."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)]
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, (containing, len(found))
    return found[0]


def test_readme_python_example_runs_and_prints_what_it_says(capsys):
    block = _python_block("from fedexlora import aggregate")
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out.split()
    assert out[0] == "True" and out[1] == "8" and out[2] == "49152"


@pytest.mark.slow(seconds=12)
def test_readme_loading_snippet_scores_the_runs_accuracy_with_its_label_names(
    tiny_cfg, tmp_path, capsys
):
    """The README's export-loading block, run as written on a small run's adapter export.

    Plain transformers + peft, the base named by the adapter itself, no ``num_labels`` by
    hand: the loaded model scores the run's own final accuracy on the run's test split,
    and predicts the task's label names.
    """
    from fedexlora.run.build import prepare
    from fedexlora.run.export import export_model
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.report import read_metrics
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.local import predict

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2)
    rows = run_experiment(cfg, tmp_path / "run", progress=False)
    assert export_model(tmp_path / "run", tmp_path / "model").format == "adapter"
    block = _python_block("PeftModel.from_pretrained")
    assert block.count('"runs/default-model"') == 1
    ns: dict = {}
    capsys.readouterr()  # the run's own output: not the block's
    exec(compile(block.replace('"runs/default-model"', repr(str(tmp_path / "model"))),
                 "README.md", "exec"), ns)  # fmt: skip
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    task = load_task_for(cfg)
    assert printed in task.label_names  # a name of the task, not LABEL_k
    model, tokenizer = ns["model"], ns["tokenizer"]
    assert model.config.id2label == dict(enumerate(task.label_names))
    prep = prepare(cfg, tokenizer, task)
    logits = predict(model, prep.test)
    accuracy = (logits.argmax(-1) == torch.tensor(prep.test.labels)).double().mean().item()
    final = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert final["round"] == 2 and rows[-1]["round"] == 2
    assert accuracy == pytest.approx(final["metrics"]["accuracy"], abs=1e-12)


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert len(commands) == 2
    assert "fedexlora run" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = commands[1].split("&&")[-1].strip()
    assert test_cmd == "bash scripts/test.sh"
    assert test_cmd in ci


# ---------------------------------------------------------------------------------------
# The README's options, extras, method names and docs stay true to the code.


def _section(title: str) -> str:
    """The README's text under ``## title``, up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _commands():
    """Every fedexlora command (groups included), by its path: ``{"run": <click cmd>, ...}``."""
    import click
    import typer.main

    from fedexlora.cli import app

    root = typer.main.get_command(app)
    out = {"": root}
    todo = [("", root)]
    while todo:
        path, cmd = todo.pop()
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                out[f"{path} {name}".strip()] = sub
                todo.append((f"{path} {name}".strip(), sub))
    return out


def _option_params(cmd) -> dict:
    """Each option string of a click command (``--x``, ``--no-x``, ``-r``) -> its param."""
    return {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def _table_rows() -> list[tuple[str, str]]:
    """(flag, default) of each row of the README's table of first options."""
    rows = re.findall(
        r"^\| `(--[a-z0-9-]+)` \| ([^|]+?) \|", _section("The options you reach for first"), re.M
    )
    assert len(rows) >= 10, rows
    return rows


def _same_default(cell: str, default) -> bool:
    """Whether the README's default cell says ``default`` (a RunConfig field's default)."""
    cell = cell.strip().strip("`")
    if default is None:
        return cell in ("unset", "none", "off", "all")
    if isinstance(default, bool):
        return cell == ("on" if default else "off")
    if isinstance(default, list):
        return cell == ",".join(map(str, default))
    if isinstance(default, (int, float)):
        try:
            return float(cell) == float(default)
        except ValueError:
            return False
    return cell == str(default)


def test_readme_option_table_flags_exist_with_their_real_defaults():
    from dataclasses import MISSING, fields

    from fedexlora.config import FLAGS, RunConfig

    params = _option_params(_commands()["run"])
    defaults = {
        f.name: f.default if f.default is not MISSING else f.default_factory()
        for f in fields(RunConfig)
    }
    for flag, cell in _table_rows():
        assert flag in params, f"README's table: {flag} is not an option of `fedexlora run`"
        name = params[flag].name
        assert name in FLAGS, f"README's table: {flag} sets no config key, so it has no default"
        default = defaults[name]
        assert _same_default(cell, default), (
            f"README's table: {flag} defaults to {default!r}, not {cell!r}"
        )
        # the help text says the same default, where it gives one
        said = re.search(r"\(default: ([^)]*)\)\.?$", params[flag].help or "")
        if said and default is not None and not isinstance(default, bool):
            assert _same_default(said.group(1), default), (flag, said.group(1))


def test_every_flag_the_readme_names_is_an_option_of_a_command_or_of_the_tool_it_belongs_to():
    opts = {"--help"}  # click adds it to every command
    for cmd in _commands().values():
        opts |= set(_option_params(cmd))
    root = README.parent
    elsewhere = {  # flags of other tools the README quotes, and where they are defined
        "--packing": root / "examples" / "trl_sft" / "train.py",
        "--steps": root / "examples" / "trl_sft" / "train.py",
    }
    others = {
        "--logdir",
        "--backend-store-uri",
        "--ignore-requires-python",
        "--no-deps",
    }  # tensorboard, mlflow, pip
    for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README.read_text())):
        if flag in elsewhere:
            assert f'"{flag}"' in elsewhere[flag].read_text(), flag
        else:
            assert flag in opts or flag in others, (
                f"README names {flag}, which no fedexlora command has"
            )


def test_readme_toml_keys_are_the_flags_as_it_says():
    from fedexlora.config import FLAGS, validate_mapping

    run = _commands()["run"]
    text = _section("The options you reach for first")
    renamed = {key: flag for key, flag in FLAGS.items() if flag != "--" + key.replace("_", "-")}
    assert renamed == {"lora_r": "--rank", "methods": "--method"}
    for key, flag in renamed.items():
        assert f"`{flag}` is `{key}`" in text
    keyless = {p.name for p in run.params if p.name not in FLAGS}
    listing = r"((?:`--[a-z-]+`(?:,\s+|\s+and\s+))+`--[a-z-]+`)\s+have no key"
    said = re.search(listing, text).group(1)
    by_name = {p.name: p for p in run.params}
    assert set(re.findall(r"`(--[a-z-]+)`", said)) == {by_name[n].opts[0] for n in keyless}
    for key, flag in FLAGS.items():  # the long flag: the key's, dashes for underscores
        assert by_name[key].opts[0] == flag, by_name[key].opts
    assert "--clients" in by_name["num_clients"].opts
    cfg, errs = validate_mapping({"local-steps": 8, "method": "fedex,fedit", "lora_r": 4})
    assert not errs and cfg.local_steps == 8 and cfg.methods == ["fedex", "fedit"]


def test_readme_resume_flags_are_exactly_those_that_leave_results_alone():
    from fedexlora.config import FLAGS, RESUME_SAFE

    flag_of = FLAGS
    said = re.search(
        r"leave the results alone apply there:(.*?); any flag", README.read_text(), re.S
    )
    named = set(re.findall(r"`(--[a-z-]+)`", said.group(1)))
    assert named == {flag_of[k] for k in RESUME_SAFE} | {"--no-progress"}
    reliability = (README.parent / "docs" / "RELIABILITY.md").read_text()
    said = re.search(r"Flags on `--resume`:(.*?) apply", reliability, re.S)
    assert set(re.findall(r"`(--[a-z-]+)`", said.group(1))) == named


def test_readme_extras_are_the_packages_extras():
    from fedexlora.config import tomllib  # tomli before Python 3.11

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named = re.findall(
        r"fedex-lora\[([a-z0-9_-]+)\]|\"\.\[([a-z0-9_-]+)\]\"|`\[([a-z0-9_-]+)\]` extra",
        README.read_text(),
    )
    named = {n for group in named for n in group if n}
    assert {"flower", "quantization", "privacy", "tracking", "nlg", "trl", "test"} <= named
    assert named <= set(extras), named - set(extras)


def test_readme_method_names_are_registered_and_it_counts_none():
    from fedexlora.core.methods import REGISTRY

    text = README.read_text()
    for names in re.findall(r"--method ([a-z0-9,]+)", text):
        for name in names.split(","):
            assert name in REGISTRY, f"README runs --method {name}, which is not registered"
    # a count or a full list of the methods drifts: the README points to `fedexlora methods`
    assert not re.search(r"\ball \d+\b|\b\d+ (federated )?(LoRA )?methods\b", text)
    assert "`fedexlora methods`" in text and "`docs/METHODS.md`" in text


def test_readme_documentation_lists_every_doc():
    docs = README.parent / "docs"
    listed = _section("Documentation")
    for path in sorted(docs.rglob("*.md")):
        rel = path.relative_to(README.parent).as_posix()
        assert f"`{rel}`" in listed, f"README's Documentation does not list {rel}"
