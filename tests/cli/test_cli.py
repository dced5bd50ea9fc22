import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=12)

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "args,match",
    [
        (["--model", "/no/such/model"], "`--model` '/no/such/model': no such local directory"),
        (["--task", "imagenet"], "unknown task 'imagenet'"),
        (["--method", "fedex,fedavg"], "`--method`: unknown ['fedavg']"),
        (["--alpha", "0"], "`--alpha` must be > 0, got 0.0"),
        (["--fraction", "1.5"], "`--fraction` must be in (0, 1], got 1.5"),
        (["--method", "ffa", "--residual-rank", "2"], "`--residual-rank` applies to fedex only"),
        (["--device", "tpu"], "`--device` must be one of"),
        (["--dtype", "bf16", "--side-rank", "0"], "`--side-rank` must be >= 1, got 0; fix"),
        (["--side-rank", "4", "--no-fp32-side-branch"], "`--side-rank` caps the side branch"),
        (["--side-rank", "4", "--method", "fedit"], "methods ['fedit'] keep none"),
        (["--quantization", "nf3"], "`--quantization` must be one of ('nf4', 'fp4', 'int8')"),
        (["--double-quant"], "`--double-quant` applies to 4-bit quantization only"),
        (["--export-format", "merged", "--export-dtype", "bf16"], "so it cannot be exact; fix"),
        (
            ["--export-format", "adapter", "--export-dtype", "bf16"],
            "`--export-dtype` 'bf16' applies to a merged model, and this run exports an",
        ),
        (["--dora", "--method", "fedex,fedit"], "`--dora`: method 'fedit' does not aggregate"),
        (["--dora", "--method", "fedex", "--dtype", "bf16"], "`--dora` is exact only on an fp32"),
    ],
)
def test_user_mistakes_get_one_line_errors(args, match, tmp_path, model_never_loads):
    # model_never_loads: a mistake let through (a flag of 0 dropped, say) fails here at once,
    # not after training the default job
    res = _run("run", "--out", str(tmp_path / "o"), "--no-progress", *args)
    assert res.exit_code == 2, res.output
    assert match in res.output
    assert "Traceback" not in res.output


def _run_tiny(model, task, tmp_path, *extra):
    return _run("run", "--model", model, "--task", task, "--min-partition-size", "5",
                "--out", str(tmp_path / "o"), "--no-progress", *extra)  # fmt: skip


def test_max_length_beyond_the_positions_is_one_line(tmp_path, tiny_bert_dir, tiny_csv):
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--max-length", "200", "--rounds", "1")
    assert res.exit_code == 2, res.output
    assert "--max-length 200 exceeds the 128 positions model" in " ".join(res.output.split())
    assert "(max_position_embeddings); use --max-length 128 or less" in " ".join(res.output.split())
    assert "Traceback" not in res.output
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path / "ok", "--max-length", "128",
                    "--rounds", "1", "--local-steps", "1", "--max-test", "8")  # fmt: skip
    assert res.exit_code == 0, res.output  # the limit itself is fine


def test_cuda_without_gpu(tmp_path, tiny_bert_dir, tiny_csv):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--device", "cuda")
    assert res.exit_code == 2
    assert "`device` is 'cuda' but no CUDA GPU is available" in res.output
    assert "Traceback" not in res.output


def test_too_few_examples_per_client(tiny_bert_dir, tiny_csv, tmp_path):
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--num-clients", "40")
    assert res.exit_code == 2
    said = " ".join(res.output.split())
    assert "but --num-clients 40 clients with at least --min-partition-size" in said
    assert "a smaller --min-partition-size" in said  # the flags typed, not the arguments
    assert "num_clients" not in said and "min_partition_size" not in said
    assert "Traceback" not in res.output


def test_validate_lists_every_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'rounds = 0\nmodl = "minilm"\nlr = "fast"\nmethods = ["ffa"]\nresidual_rank = 2\n'
    )
    res = _run("validate", str(cfg))
    assert res.exit_code == 2  # as `run --config` exits on the same file
    assert "unknown key `modl`; did you mean `model`?" in res.output
    assert "`lr` must be a number, got 'fast'" in res.output
    good = tmp_path / "g.toml"
    good.write_text('rounds = 2\nmethods = ["ffa"]\n')
    assert _run("validate", str(good)).exit_code == 0
    cfg.write_text('rounds = 0\nmethods = ["ffa"]\nresidual_rank = 2\n')
    res = _run("validate", str(cfg))
    assert "`rounds` must be >= 1, got 0" in res.output
    assert "`residual_rank` applies to fedex only" in res.output


def test_config_file_and_flags_override(tiny_bert_dir, tiny_csv, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nrounds = 5\nlocal_steps = 2\n'
        "num_clients = 2\nmin_partition_size = 5\nmax_length = 16\nlora_r = 2\n"
        'target_modules = ["query", "value"]\n'
    )
    out = tmp_path / "run"
    res = _run(
        "run",
        "--config",
        str(cfg),
        "--rounds",
        "1",
        "--method",
        "fedex,fedit",
        "--out",
        str(out),
        "--no-progress",
    )
    assert res.exit_code == 0, res.output
    assert "final results" in res.output
    resolved = (out / "config.toml").read_text()
    assert "rounds = 1" in resolved and "lora_r = 2" in resolved
    assert 'methods = [\n    "fedex",\n    "fedit",\n]' in resolved or '"fedit"' in resolved
    assert "fp32_side_branch = true" in resolved  # fedex, exact: beside the fp32 weights
    res = _run("export", str(out), str(tmp_path / "exp"), "--method", "fedit")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "exp" / "adapter_config.json").is_file()  # with a side branch
    res = _run("export", str(out), str(tmp_path / "exp3"), "--format", "merged")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "exp3" / "config.json").is_file()
    res = _run("export", str(out), str(tmp_path / "exp2"), "--method", "flora")
    assert res.exit_code == 2 and "method 'flora' is not in this run" in res.output


def test_validate_names_what_run_would_refuse_in_the_inputs_a_config_names(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    """Settings that are each valid, but name a missing file, a device this machine
    lacks, a metric the task has not: validate lists them all, as run would refuse them."""
    import torch

    cfg = tmp_path / "c.toml"
    lines = [f'model = "{tiny_bert_dir}"', f'task = "{tmp_path / "missing.csv"}"',
             'stop_metric = "bleu"', "stop_patience = 2"]  # fmt: skip
    if not torch.cuda.is_available():
        lines.append('device = "cuda"')
    cfg.write_text("\n".join(lines) + "\n")
    res = _run("validate", str(cfg))
    assert res.exit_code == 2, res.output
    flat = "".join(res.output.split())
    assert "".join(f"data file not found: '{tmp_path / 'missing.csv'}'".split()) in flat
    if not torch.cuda.is_available():
        assert "`device`is'cuda'butnoCUDAGPUisavailable" in flat
    assert _run("run", "--config", cfg, "--out", tmp_path / "o").exit_code == 2
    cfg.write_text("\n".join([f'model = "{tiny_bert_dir}"', f'task = "{tiny_csv}"',
                              'stop_metric = "bleu"', "stop_patience = 2"]) + "\n")  # fmt: skip
    res = _run("validate", str(cfg))
    # named as the file spells it: its key, not the flag that run's own check names
    assert res.exit_code == 2 and "`stop_metric` 'bleu' is not a metric of task" in res.output
    cfg.write_text(f'model = "{tiny_bert_dir}"\ntask = "{tiny_csv}"\nmax_length = 100000\n')
    res = _run("validate", str(cfg))
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and "`max_length` 100000 exceeds the" in flat, res.output
    assert "use `max_length` " in flat and "--max-length" not in flat


@pytest.mark.parametrize(
    "args,match",
    [
        (["--settings", ","], "--settings is empty"),
        (["--settings", "dir-3"], "--settings: cannot parse 'dir-3'; use iid-K, dirA-K or group-K"),
        (["--settings", "ring-3"], "--settings: cannot parse 'ring-3'"),
        (["--ranks", "1,x"], "--ranks must be a comma list of integers, got '1,x'"),
        (["--seeds", ""], "--seeds is empty"),
        (["--ranks", "4,0"], "--ranks must all be >= 1, got '4,0'"),
        (["--settings", "iid-0"], "--settings: 'iid-0' has 0 clients; K must be >= 1"),
        (["--settings", "dir0-3"], "--settings: 'dir0-3' has Dirichlet alpha 0.0; A must be > 0"),
        (["--method", "fedex,bogus"], "`--method`: unknown ['bogus']"),
        (["--weighting", "size"], "`--weighting` must be one of ('examples', 'uniform')"),
    ],
)
def test_compare_bad_input_is_one_clear_error(args, match, tmp_path):
    res = runner.invoke(app, ["compare", "--out", str(tmp_path / "c"), *args],
                        env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 2, res.output
    assert match in res.output and "Traceback" not in res.output
    assert not (tmp_path / "c").exists()  # nothing ran, not even the valid cells


def test_compare_grid_writes_comparison(tiny_bert_dir, tiny_csv, tmp_path):
    out = tmp_path / "cmp"
    args = ["compare", "--out", str(out), "--model", tiny_bert_dir, "--task", tiny_csv,
            "--method", "fedex,fedit,centralized", "--ranks", "2", "--seeds", "0,1",
            "--settings", "iid-2,dir0.5-3", "--rounds", "1", "--local-steps", "2",
            "--max-length", "16", "--max-test", "30", "--min-partition-size", "5",
            "--weighting", "uniform"]  # fmt: skip
    res = _run(*args)
    assert res.exit_code == 0, res.output
    cells = sorted(out.rglob("config.toml"))  # every cell runs with the grid's weighting
    assert cells and all('weighting = "uniform"' in c.read_text() for c in cells)
    md = (out / "comparison.md").read_text()
    assert "## iid-2 (2 clients, iid), r=2" in md and "## dir0.5-3 (3 clients, dirichlet" in md
    assert "| fedex | " in md and " ± " in md
    assert "fedex − fedit, final accuracy paired by seed:" in md and "95% CI" in md
    assert "paired t-test p=" in md and ", n=2 (" in md
    assert "2 local steps per client in all" in md and "reused" not in md
    assert (out / "comparison.png").is_file()
    cell = out / "iid-2_r2_seed1" / "metrics.jsonl"
    assert cell.is_file()
    # each method's adapter and side branch (fedex's default on fp32), read from its rows
    import json
    import statistics

    from fedexlora.core.units import format_bytes

    def held(m):
        last = [[r for r in map(json.loads, (out / f"iid-2_r2_seed{s}" / "metrics.jsonl")
                 .read_text().splitlines()) if r["method"] == m][-1] for s in (0, 1)]  # fmt: skip
        return " + side branch ".join(
            format_bytes(statistics.fmean(r[k] for r in last))
            for k in ("adapter_bytes", "side_bytes")
        )

    line = next(x for x in md.splitlines() if x.startswith("Held by each client"))
    assert f"fedex LoRA factors {held('fedex')}; fedit LoRA factors {held('fedit')}." in line
    assert "centralized" not in line and "side branch 0 B" in line  # fedit keeps none
    # a finished grid is reused, not recomputed
    before = cell.read_text()
    res = _run(*args)
    assert res.exit_code == 0 and "(done)" in res.output and cell.read_text() == before
    assert "(4 of 4 runs reused from an earlier invocation)" in (out / "comparison.md").read_text()


def test_every_config_field_is_a_run_flag_that_sets_it():
    from dataclasses import fields

    from fedexlora.config import FLAGS, RunConfig

    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "300", "TERM": "dumb"})
    for f in fields(RunConfig):
        assert FLAGS[f.name] in res.output, f.name
    # the generated option sets its key: a value off its default, for every kind of field
    given = ["--rank", "4", "--client-ranks", "2,4,4", "--method", "fedex,fedit", "--rslora",
             "--lr", "0.5", "--target-modules", "query,value", "--clients", "3"]  # fmt: skip
    from fedexlora.cli.options import from_flags

    cmd = _click_command("run")
    ctx = cmd.make_context("run", list(given))
    mapping, errs = from_flags(ctx.params)
    assert not errs
    assert mapping == {"lora_r": 4, "client_ranks": [2, 4, 4], "methods": ["fedex", "fedit"],
                       "rslora": True, "lr": 0.5, "target_modules": ["query", "value"],
                       "num_clients": 3}  # fmt: skip


def test_compare_best_of_a_loss_is_its_minimum():
    from fedexlora.config import RunConfig
    from fedexlora.experiments.cells import Cell, Setting
    from fedexlora.experiments.compare import comparison_table

    def row(method, rnd, loss):
        return {"method": method, "round": rnd, "metrics": {"loss": loss}, "seconds": 1.0,
                "bytes_up": 0, "bytes_down": 0, "deviation": {"mean": 0.0},
                "effective_deviation": {"max": 0.0}}  # fmt: skip

    s = Setting("iid-2", 2, "iid")
    rows = {
        Cell(s, 1, None, seed): [row("fedex", 1, 2.0), row("fedex", 2, 1.5), row("fedex", 3, 1.7),
                       row("fedit", 1, 2.0), row("fedit", 2, 1.6), row("fedit", 3, fedit)]
        for seed, fedit in ((0, 1.8), (1, 1.6))
    }  # fmt: skip
    cfg = RunConfig(methods=["fedex", "fedit"], rounds=3)
    md = comparison_table(rows, {c: cfg for c in rows}, 5.0)
    assert "| fedex | 1.7000 ± 0.0000 | [1.7000, 1.7000] | 1.5000 ± 0.0000 | 3 |" in md
    assert "best loss" in md
    # a lower loss is ahead: seed 0 (1.7 vs 1.8) ahead, seed 1 (1.7 vs 1.6) behind
    assert "(1 ahead, 0 tied, 1 behind)" in md


def test_quantization_without_bitsandbytes_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a)
    )
    res = _run("run", "--out", str(tmp_path / "o"), "--quantization", "nf4", "--no-progress")
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "needs bitsandbytes, which is not installed; fix: pip install" in out
    assert "'fedex-lora[quantization]'" in out
    assert "Traceback" not in res.output


def test_model_bitsandbytes_cannot_quantize_is_one_clear_error(
    tiny_bert_dir, tiny_csv, tmp_path, monkeypatch
):
    from transformers import AutoModelForSequenceClassification

    def refuse(*args, quantization_config=None, **kwargs):
        if quantization_config is not None:  # what transformers says for such a model
            raise ValueError("this model cannot be quantized with bitsandbytes")
        raise AssertionError("an unquantized load was not expected")

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", refuse)
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--quantization", "int8")
    assert res.exit_code == 2, res.output
    assert "--quantization int8: bitsandbytes cannot quantize model" in res.output
    assert "run it without --quantization" in res.output
    assert "Traceback" not in res.output


def test_resume_refuses_result_changing_flags_and_applies_safe_ones(
    tiny_bert_dir, tiny_csv, tmp_path
):
    """No flag is ignored on --resume: a result-changing one is refused, naming it."""
    from fedexlora.run.report import read_metrics

    base = ("--max-length", "16", "--rank", "2", "--local-steps", "2", "--batch-size", "8")
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--rounds", "1", *base)
    assert res.exit_code == 0, res.output
    run_dir = str(tmp_path / "o")
    for args, flag in [
        (["--lr", "0.5"], "--lr 0.5"),
        (["--method", "fedit"], "--method ['fedit']"),
        (["--rank", "4"], "--rank 4"),
        (["--seed", "3"], "--seed 3"),
        (["--engine", "flower"], "--engine 'flower'"),
        # settings the run left unset (None: not in its config.toml)
        (["--weighting", "uniform"], "--weighting 'uniform'"),
        (["--max-train", "10"], "--max-train 10"),
    ]:
        res = _run("run", "--resume", run_dir, "--no-progress", *args)
        assert res.exit_code == 2, (args, res.output)
        assert f"{flag} would change the results" in res.output
        assert "Traceback" not in res.output
    res = _run("run", "--resume", run_dir, "--config", "x.toml")
    assert res.exit_code == 2 and "--config cannot be combined with --resume" in res.output
    # a flag equal to the stored value changes nothing and is accepted; safe ones apply
    res = _run(
        "run", "--resume", run_dir, "--no-progress", "--rank", "2", "--rounds", "2",
        "--device", "cpu", "--keep-checkpoints", "1", "--export", str(tmp_path / "exp"),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert [r["round"] for r in read_metrics(tmp_path / "o" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "exp" / "fedexlora_export.json").is_file()
    assert sorted(p.name for p in (tmp_path / "o" / "checkpoints" / "fedex").iterdir()) == [
        "round-0002"
    ]


# --- a readable CLI: panels, defaults, --version, a missing local model -----------------


def _help(*args, columns=200):
    res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(columns), "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return res.output


def _click_command(*path):
    import typer

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _all_commands(cmd=None, path=()):
    import click

    cmd = cmd or _click_command()
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _all_commands(sub, (*path, name))


RUN_PANELS = ["Settings", "Model and LoRA", "Data", "Method", "Federation", "Training",
              "Evaluation", "Device, precision and memory", "Privacy", "Output and resume",
              "Export"]  # fmt: skip


def test_run_help_is_grouped_in_panels():
    for columns in (200, 80):
        out = _help("run", columns=columns)
        titles = [ln.split("─ ", 1)[1].split(" ─")[0] for ln in out.splitlines() if "╭─ " in ln]
        assert titles == ["Options", *RUN_PANELS], titles
    for param in _click_command("run").params:
        if param.name != "help":
            assert param.rich_help_panel in RUN_PANELS, param.name
    out = _help("run")
    model_panel = out.split("╭─ Model and LoRA ")[1].split("╰")[0]
    assert "--model" in model_panel and "--rank" in model_panel and "--task" not in model_panel
    privacy = out.split("╭─ Privacy ")[1].split("╰")[0]
    assert {"--dp-epsilon", "--dp-delta", "--dp-max-grad-norm"} <= set(privacy.split())


def test_help_has_no_dangling_period_and_no_swallowed_text():
    """A default in brackets, such as [dirichlet], is rich markup: it vanished, leaving ' .'."""
    import re

    from rich.markup import render

    for path, cmd in _all_commands():
        for param in cmd.params:
            text = getattr(param, "help", None) or ""
            assert render(text).plain == text, (path, param.name, text)
            assert "[" not in text, (path, param.name, text)  # eaten, or a second default
        assert render(cmd.help or "").plain == (cmd.help or ""), path
        for columns in (200, 80):
            out = _help(*path, columns=columns)
            bad = [ln for ln in out.splitlines() if re.search(r" \.\s*│?\s*$", ln)]
            assert not bad, (path, columns, bad)
    out = _help("run")
    assert "deepmind-math's modules) (default: dirichlet)." in out
    assert "Run directory (default: runs/<time>)." in out


def _defaults_in_help(cmd):
    import re

    found = {}
    for param in cmd.params:
        text = " ".join((getattr(param, "help", None) or "").split())
        found[param.name] = re.findall(r"\(default: ([^()]*)\)", text)
        assert text.count("default") == len(found[param.name]), (param.name, text)
        assert len(found[param.name]) <= 1, (param.name, text)
    return {k: v[0] for k, v in found.items() if v}


def _same(written, value):
    if isinstance(value, bool):
        return written == ("on" if value else "off")
    if isinstance(value, (int, float)):
        return float(written) == value
    if isinstance(value, list):
        return written == ",".join(value)
    return written == str(value)


def test_run_defaults_are_written_once_and_match_the_config():
    from dataclasses import fields

    from fedexlora.config import RunConfig

    out = " ".join(_help("run").split())
    assert "[default" not in out  # typer's own default, beside ours, would show it twice
    assert out.count("(default: dirichlet)") == 1 and out.count("(default: minilm)") == 1
    written = _defaults_in_help(_click_command("run"))
    config = {f.name: getattr(RunConfig(), f.name) for f in fields(RunConfig)}
    for key, value in config.items():
        if value is None:
            continue  # unset by default: the help says what that means, if anything
        assert key in written, f"{key} does not say its default {value!r}"
        assert _same(written[key], value), (key, written[key], value)


def test_compare_defaults_are_written_once_and_match_the_grid():
    from fedexlora.cli.compare import _COMPARE_DEFAULTS
    from fedexlora.config import RunConfig

    out = " ".join(_help("compare").split())
    assert "[default" not in out
    written = _defaults_in_help(_click_command("compare"))
    for name, value in _COMPARE_DEFAULTS.items():
        if value is not None:
            assert _same(written[name], value), (name, written.get(name), value)
    for name in ("dp_delta", "dp_max_grad_norm", "fedsb_rank", "fedsb_init"):
        assert _same(written[name], getattr(RunConfig(), name)), name
    assert written["out"] == "runs/compare"


def test_top_level_help_groups_the_commands():
    out = _help(columns=120)
    run_panel = out.split("╭─ Run ")[1].split("╰")[0]
    experiments = out.split("╭─ Experiments ")[1].split("╰")[0]
    import re

    def names(panel):
        return [m.group(1) for ln in panel.splitlines() if (m := re.match(r"│ (\S+) ", ln))]

    assert names(run_panel) == ["run", "validate", "export"]
    assert names(experiments) == ["methods", "recipes", "compare", "bench"]
    assert "--version" in out


def test_version():
    from fedexlora import __version__

    for args in (["--version"], ["--version", "run"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        assert res.output == f"fedex-lora {__version__}\n"


def test_python_dash_m_and_the_script_answer_version():
    import subprocess
    import sys

    from fedexlora import __version__

    res = subprocess.run([sys.executable, "-m", "fedexlora", "--version"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"fedex-lora {__version__}\n"


@pytest.mark.parametrize("model", ["/nonexistent", "./missing", "~/no-such-model-dir", "a/b/c"])
def test_a_missing_local_model_says_so_before_training(model, tmp_path):
    res = _run("run", "--model", model, "--out", str(tmp_path / "o"), "--no-progress")
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    # named as typed: the flag here, the TOML key below
    assert f"`--model` '{model}': no such local directory (give minilm, smollm2-135m, a hub " in out
    assert "Repo id" not in out and "Traceback" not in out
    assert not (tmp_path / "o").exists()  # nothing ran
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'model = "{model}"\n')
    res = _run("validate", str(cfg))
    assert res.exit_code == 2 and "no such local directory" in res.output
    res = _run("run", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress")
    assert res.exit_code == 2 and f"`model` '{model}': no such local directory" in res.output


def test_model_names_that_may_be_models_pass_without_the_network(tmp_path):
    from fedexlora.bridge.models import ALIASES, resolve_model
    from fedexlora.config_checks import _MODEL_ALIASES, model_name_error

    assert _MODEL_ALIASES == ALIASES
    (tmp_path / "m").mkdir()
    (tmp_path / "f").write_text("")
    for name in ("prajjwal1/bert-tiny", "gpt2", "bert-base-uncased", "minilm", "smollm2-135m",
                 str(tmp_path / "m")):  # fmt: skip
        assert model_name_error(name) is None, name
    assert "'x/f': not a directory" in model_name_error(str(tmp_path / "f")).replace(
        str(tmp_path), "x"
    )
    with pytest.raises(ValueError, match="model '/nonexistent': no such local directory"):
        resolve_model("/nonexistent")
    assert resolve_model("prajjwal1/bert-tiny").path == "prajjwal1/bert-tiny"


def test_errors_name_the_flag_typed_and_client_ranks_give_the_rank_everywhere(tmp_path):
    """`--rank 0` is answered about `--rank`, not the key `lora_r`; a TOML file's key
    stays its key. `client_ranks` alone gives the global rank (their largest) from the
    command line and from a TOML file alike."""
    from fedexlora.config import load_config

    res = _run("run", "--rank", "0", "--out", str(tmp_path / "o"), "--no-progress")
    assert res.exit_code == 2 and "`--rank` must be >= 1, got 0" in res.output
    assert "lora_r" not in res.output
    cfg = tmp_path / "c.toml"
    cfg.write_text("lora_r = 0\n")
    res = _run("run", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress")
    assert res.exit_code == 2 and "`lora_r` must be >= 1, got 0" in res.output
    cfg.write_text("num_clients = 3\nclient_ranks = [2, 6, 4]\n")
    assert load_config(cfg).lora_r == 6  # not the default 8
    res = _run("validate", str(cfg))
    assert res.exit_code == 0, res.output


def test_dora_run_exports_agree(tiny_bert_dir, tiny_csv, tmp_path):
    """--dora through the CLI: the run is exact at fp32's rounding, and its merged export
    (each DoRA layer's weight, magnitude applied) and its adapter export (use_dora, the
    magnitude and the widened factors, on the pretrained base) give the same logits."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    res = _run_tiny(tiny_bert_dir, tiny_csv, tmp_path, "--dora", "--method", "fedex",
                    "--num-clients", "3", "--rounds", "1", "--export", str(merged),
                    "--export-format", "merged")  # fmt: skip
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[-1])
    assert not row["approximate"]
    assert row["effective_deviation"]["max"] < 10 * row["rounding_floor"] + 1e-6
    res = _run("export", str(tmp_path / "o"), str(adapter), "--format", "adapter")
    assert res.exit_code == 0, res.output
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"]
    load = AutoModelForSequenceClassification.from_pretrained
    x = torch.randint(1, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    base = load(tiny_bert_dir, num_labels=3, ignore_mismatched_sizes=True).eval()
    with torch.no_grad():
        start = base(input_ids=x).logits.double()
        got = PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=x).logits.double()
        want = load(str(merged)).eval()(input_ids=x).logits.double()
    assert float((got - want).norm() / (want - start).norm()) < 1e-5
