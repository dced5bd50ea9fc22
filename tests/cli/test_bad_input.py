"""Bad input, tried as a new user would: one clear error naming it, exit 2, nothing written.

Each mistake is found before the run writes its directory (and, for ``--export``, before
it trains): no traceback, no ``config.toml`` left behind.
"""

import builtins
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedexlora.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _says(res, needle: str) -> bool:
    """Whether the output says ``needle``, wherever rich broke its lines."""
    return "".join(needle.split()) in "".join(res.output.split())


def _tiny(model, task, out, *extra):
    return _run("run", "--model", model, "--task", task, "--min-partition-size", "5",
                "--rounds", "1", "--local-steps", "1", "--max-test", "8", "--max-length", "16",
                "--out", out, "--no-progress", *extra)  # fmt: skip


def _clear(res, *needles):
    """A one-line error (exit 2) that says each of ``needles``, and no traceback."""
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    for needle in needles:
        assert _says(res, needle), res.output


@pytest.fixture()
def a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a directory\n")
    return f


# -- output paths ----------------------------------------------------------------------


def _unwritable(kind, a_file):
    if kind == "/proc":
        if not Path("/proc").is_dir():
            pytest.skip("no /proc here")
        return "/proc/fedexlora-x", "'/proc' accepts no new directory"
    return a_file / "sub", f"{str(a_file)!r} is a file, not a directory"


@pytest.mark.parametrize("kind", ["/proc", "under a file"])
def test_export_to_an_unwritable_path_is_refused_before_training(
    kind, a_file, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    dest, why = _unwritable(kind, a_file)
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", dest)
    _clear(res, f"--export {str(dest)!r} cannot be made: {why}")
    assert "final results" not in res.output  # refused before any round was trained
    assert not out.exists()


def test_export_onto_an_existing_file_is_refused_before_training(
    a_file, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", a_file)
    _clear(res, f"--export {str(a_file)!r} is a file, not a directory")
    assert "final results" not in res.output
    assert not out.exists()
    assert a_file.read_text() == "not a directory\n"


@pytest.mark.parametrize("kind", ["a file", "/proc", "under a file"])
def test_out_that_cannot_be_a_directory_is_one_line(
    kind, a_file, tiny_bert_dir, tiny_csv, model_never_loads
):
    if kind == "a file":
        out, why = a_file, "is a file, not a directory"
    else:
        out, why = _unwritable(kind, a_file)
        why = f"cannot be made: {why}"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", a_file.parent / "exp")
    _clear(res, f"--out {str(out)!r} {why}")
    assert not (a_file.parent / "exp").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_bert_dir, tiny_csv):
    """A one-round run directory, to export from."""
    out = tmp_path_factory.mktemp("finished") / "run"
    res = _tiny(tiny_bert_dir, tiny_csv, out)
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("kind", ["/proc", "under a file", "a file"])
def test_export_command_to_a_bad_destination_is_one_line(kind, a_file, finished_run):
    if kind == "a file":
        dest, why = a_file, "is a file, not a directory"
    else:
        dest, why = _unwritable(kind, a_file)
        why = f"cannot be made: {why}"
    res = _run("export", finished_run, dest)
    _clear(res, f"export destination {str(dest)!r} {why}")


def test_a_failed_export_after_training_says_the_run_is_safe(
    tmp_path, monkeypatch, tiny_bert_dir, tiny_csv
):
    import fedexlora.run.export as export

    def disk_full(run_dir, dest, *a, **k):
        raise OSError(28, "No space left on device", str(dest))

    monkeypatch.setattr(export, "export_model", disk_full)
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", tmp_path / "exp")
    _clear(res, f"the run in {str(out)!r} is complete, but its export failed",
           "No space left on device", f"fedexlora export {out} DEST")  # fmt: skip
    assert (out / "summary.md").is_file()


# -- inputs checked before anything is written -----------------------------------------


@pytest.fixture()
def bad_csv(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("a,b\n1,2\n3,4\n")
    return f


@pytest.mark.parametrize(
    "case",
    ["unknown task", "unknown MATH subject", "missing csv", "csv without the columns", "cuda"],
)
def test_a_bad_input_leaves_no_run_directory(
    case, tmp_path, bad_csv, tiny_bert_dir, tiny_csv, model_never_loads
):
    import torch

    task, extra = tiny_csv, []
    if case == "unknown task":
        task, why = "imagenet", "unknown task 'imagenet'; choose from"
    elif case == "unknown MATH subject":
        task, why = "math/poetry", "unknown MATH subject 'poetry' in task 'math/poetry'"
    elif case == "missing csv":
        task = tmp_path / "nope.csv"
        why = f"data file not found: {str(task)!r}"
    elif case == "csv without the columns":
        task, why = bad_csv, f"data file {str(bad_csv)!r} has columns ['a', 'b']; expected"
    else:
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        extra, why = ["--device", "cuda"], "`device` is 'cuda' but no CUDA GPU is available"
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, task, out, *extra)
    _clear(res, why)
    assert not out.exists()


def _flwr_missing(monkeypatch, how):
    """flwr not installed (``sys.modules`` entry ``None``), or installed but not importable."""
    if how == "not installed":
        monkeypatch.setitem(sys.modules, "flwr", None)
        return
    real = builtins.__import__

    def no_flwr(name, *args, **kwargs):
        if name == "flwr" or name.startswith("flwr."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flwr)


@pytest.mark.parametrize("how", ["not installed", "not importable"])
@pytest.mark.parametrize("flag", [["--secure-aggregation"], ["--engine", "flower"]])
def test_flower_without_flwr_names_the_extra(
    flag, how, monkeypatch, tmp_path, tiny_bert_dir, tiny_csv
):
    _flwr_missing(monkeypatch, how)
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, *flag)
    _clear(res, "flwr", "pip install 'fedex-lora[flower]'")
    assert not out.exists()


@pytest.mark.parametrize("case", ["out is a file", "report in /proc", "report is a directory",
                                  "unknown task"])  # fmt: skip
def test_compare_checks_its_paths_and_task_before_the_grid(
    case, a_file, tmp_path, tiny_bert_dir, tiny_csv
):
    out = tmp_path / "grid"
    args = ["--local-steps", "1,2", "--model", tiny_bert_dir, "--method", "fedex",
            "--settings", "iid-2", "--ranks", "1", "--seeds", "0", "--rounds", "1",
            "--max-length", "16", "--min-partition-size", "5", "--max-test", "8"]  # fmt: skip
    if case == "out is a file":
        out, why = a_file, f"--out {str(a_file)!r} is a file, not a directory"
    elif case == "report in /proc":
        dest, why = _unwritable("/proc", a_file)
        args += ["--report", f"{dest}/study.md"]
        why = f"its directory cannot be made: {why}"
    elif case == "report is a directory":
        args += ["--report", tmp_path]
        why = f"--report {str(tmp_path)!r} is a directory; give a file"
    if case == "unknown task":
        args += ["--task", "imagenet"]
        why = "unknown task 'imagenet'"
    else:
        args += ["--task", tiny_csv]
    _clear(_run("compare", "--out", out, *args), why)
    assert out == a_file or not out.exists()  # no cell ran


# -- config files ----------------------------------------------------------------------


def test_validate_and_run_exit_alike_on_a_config_error(tmp_path, model_never_loads):
    cfg = tmp_path / "c.toml"
    cfg.write_text("rounds = 0\n")
    for res in (_run("validate", cfg), _run("run", "--config", cfg, "--out", tmp_path / "o")):
        _clear(res, "`rounds` must be >= 1, got 0")
    assert not (tmp_path / "o").exists()


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    _clear(_run("validate", tmp_path), f"config file {str(tmp_path)!r} is a directory")


def _run_options():
    """Every option name of ``fedexlora run`` that sets one config key: name -> key."""
    import typer.main

    from fedexlora.config import FLAGS

    command = typer.main.get_command(app).commands["run"]
    names = {}
    for param in command.params:
        if param.name in FLAGS:  # an option of a config key is named after the key
            for opt in param.opts:
                names[opt.lstrip("-")] = param.name
    return names


def test_a_flag_name_in_a_config_file_points_at_its_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("rank = 4\n")
    _clear(_run("validate", cfg), "unknown key `rank`; did you mean `lora_r`? (`--rank` is")
    options = _run_options()
    assert options["rank"] == options["r"] == "lora_r"  # what the TOML answer must say
    from fedexlora.config import validate_mapping

    for name, key in options.items():
        _, errs = validate_mapping({name: None})
        unknown = [e for e in errs if e.startswith("unknown key")]
        assert not unknown or f"did you mean `{key}`?" in unknown[0], (name, unknown)


# -- help ------------------------------------------------------------------------------


def test_method_help_lists_every_registered_method():
    from fedexlora.core.methods import REGISTRY

    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0
    line = next(ln for ln in res.output.splitlines() if "--method " in ln)
    listed = line.split("Comma list of", 1)[1].split(";", 1)[0]
    assert [m.strip() for m in listed.split(",")] == list(REGISTRY)


@pytest.mark.parametrize(
    "extra", [["--max-length", "100000"], ["--num-clients", "40"]], ids=["max-length", "clients"]
)
def test_an_error_found_while_loading_the_model_or_partitions_leaves_nothing(
    extra, tmp_path, tiny_bert_dir, tiny_csv
):
    # checked by the run itself (library callers and the Flower ServerApp go through it too),
    # before it makes the run directory
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, *extra)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert not out.exists()


def test_export_into_a_directory_of_other_files_is_refused_and_leaves_them(
    tmp_path, finished_run, tiny_bert_dir, tiny_csv
):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("my notes\n")
    res = _run("export", finished_run, dest)
    _clear(res, f"export destination {str(dest)!r} is not empty (notes.txt)",
           "choose a new or empty directory")  # fmt: skip
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]
    assert (dest / "notes.txt").read_text() == "my notes\n"
    out = tmp_path / "o"  # the run's --export: refused before training
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", dest)
    _clear(res, f"--export {str(dest)!r} is not empty (notes.txt)")
    assert not out.exists()


def test_an_export_replaces_an_earlier_export_and_nothing_else(tmp_path, finished_run):
    """merged, then adapter, into one directory: only the adapter's files are left."""
    import json

    dest = tmp_path / "exp"
    assert _run("export", finished_run, dest, "--format", "merged").exit_code == 0
    merged = json.loads((dest / "fedexlora_export.json").read_text())["files"]
    assert any(f.startswith("model") and f.endswith(".safetensors") for f in merged)
    res = _run("export", finished_run, dest, "--format", "adapter")
    assert res.exit_code == 0, res.output
    info = json.loads((dest / "fedexlora_export.json").read_text())
    assert info["format"] == "adapter"
    held = sorted(p.name for p in dest.iterdir())
    assert held == sorted(info["files"] + ["fedexlora_export.json"])
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in held), held
    (dest / "notes.txt").write_text("mine\n")  # now the directory holds something else
    _clear(_run("export", finished_run, dest), "is not empty")
    assert (dest / "adapter_config.json").is_file()


def test_a_failed_export_leaves_the_earlier_export_whole(tmp_path, finished_run, monkeypatch):
    import json

    import fedexlora.run.export as export

    dest = tmp_path / "exp"
    assert _run("export", finished_run, dest, "--format", "merged").exit_code == 0
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_adapter", full)
    _clear(_run("export", finished_run, dest, "--format", "adapter"), "No space left on device")
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert json.loads((dest / "fedexlora_export.json").read_text())["format"] == "merged"
    assert not list(tmp_path.glob(".fedexlora-export-*"))  # no staging left behind


def test_an_earlier_export_with_a_folder_of_its_own_added_is_refused(tmp_path, finished_run):
    dest = tmp_path / "exp"
    assert _run("export", finished_run, dest).exit_code == 0
    (dest / "mine").mkdir()
    _clear(_run("export", finished_run, dest), "is not empty")
    assert (dest / "mine").is_dir()


def test_run_export_into_its_own_out_is_refused_before_training(
    tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    out = tmp_path / "r"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--export", out)
    _clear(res, f"--export {str(out)!r} is --out or holds it")
    res = _tiny(tiny_bert_dir, tiny_csv, out / "run", "--export", out)
    _clear(res, "is --out or holds it")
    assert not out.exists()


def test_files_given_to_the_destination_during_an_export_are_kept(
    tmp_path, finished_run, monkeypatch
):
    """DEST is new when the export starts; while it is written, the user makes DEST and
    puts a file of theirs there by the name the export would write: the export is
    refused at its swap-in (the destination checked again), and the file kept."""
    import fedexlora.run.export as export

    dest = tmp_path / "exp"
    write = export._write_adapter

    def meanwhile(*args, **kwargs):
        note = write(*args, **kwargs)
        dest.mkdir()
        (dest / "adapter_config.json").write_text("mine\n")
        return note

    monkeypatch.setattr(export, "_write_adapter", meanwhile)
    res = _run("export", finished_run, dest, "--format", "adapter")
    _clear(res, f"export destination {str(dest)!r} is not empty (adapter_config.json)")
    assert [p.name for p in dest.iterdir()] == ["adapter_config.json"]
    assert (dest / "adapter_config.json").read_text() == "mine\n"
    assert not list(tmp_path.glob(".fedexlora-export-*"))  # no staging left behind


def _copy_model(src, dst, *, keep):
    import shutil

    dst.mkdir()
    for f in Path(src).iterdir():
        if keep(f.name):
            shutil.copy(f, dst / f.name)
    return dst


_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


@pytest.mark.parametrize("case", ["no tokenizer", "no weights", "truncated weights"])
def test_a_model_directory_missing_a_part_is_one_line_naming_it(
    case, tmp_path, tiny_bert_dir, tiny_csv
):
    """A local model without its tokenizer used to train on [UNK] alone (a 5-token
    vocabulary transformers makes up) and report success; one without weights, or with
    truncated ones, ended in a traceback."""
    model = tmp_path / "model"
    if case == "no tokenizer":
        _copy_model(tiny_bert_dir, model, keep=lambda n: n == "config.json" or n in _WEIGHTS)
        why = f"cannot load model {str(model)!r}: {str(model)!r} holds no tokenizer"
    elif case == "no weights":
        _copy_model(tiny_bert_dir, model, keep=lambda n: n not in _WEIGHTS)
        why = f"cannot load model {str(model)!r}: its weights"
    else:
        _copy_model(tiny_bert_dir, model, keep=lambda n: True)
        w = model / "model.safetensors"
        w.write_bytes(w.read_bytes()[:100])
        why = f"cannot load model {str(model)!r}: its weights"
    out = tmp_path / "o"
    _clear(_tiny(model, tiny_csv, out), why)
    assert not out.exists()


@pytest.mark.parametrize(
    "extra,why",
    [
        (["--method", "fedex,fedit,fedex"], "`--method` names ['fedex'] more than once"),
        (["--seed", "-1"], "seed"),
        (["--seed", str(2**32)], "seed"),
        (["--data-dir", "/no/such/dir"], "`--data-dir` '/no/such/dir' is not a directory"),
    ],
    ids=["a method twice", "negative seed", "seed past 2**32-1", "no data dir"],
)
def test_a_repeated_method_or_a_seed_out_of_range_is_refused(
    extra, why, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    """A method named twice trained twice and summed its bytes in the report; a negative
    seed failed in numpy with a message that named nothing."""
    out = tmp_path / "o"
    _clear(_tiny(tiny_bert_dir, tiny_csv, out, *extra), why)
    assert not out.exists()


@pytest.mark.parametrize("mine", ["config.toml", "summary.md"])
def test_out_holding_files_of_the_users_own_is_refused_and_leaves_them(
    mine, tmp_path, tiny_bert_dir, tiny_csv, model_never_loads
):
    """A directory that is not a run (no metrics.jsonl) but holds a file a run writes:
    the config given to --config, or notes (``--out ''`` is the current directory). The
    run used to replace them."""
    out = tmp_path / "myexp"
    out.mkdir()
    (out / mine).write_text("my own\n")
    _clear(_tiny(tiny_bert_dir, tiny_csv, out), f"holds {mine}, which is not a run's")
    assert (out / mine).read_text() == "my own\n"
    assert sorted(p.name for p in out.iterdir()) == [mine]


def test_a_target_module_that_matches_nothing_is_named(tmp_path, tiny_bert_dir, tiny_csv):
    """peft adapts the names that match and drops the others without a word: a typo
    halved the adapted layers and the bytes, silently."""
    out = tmp_path / "o"
    res = _tiny(tiny_bert_dir, tiny_csv, out, "--target-modules", "query,valeu")
    _clear(res, "LoRA `target_modules` ['valeu'] match no module of model", "'value'")
    assert not out.exists()


def test_an_adapter_export_with_a_dtype_is_refused_not_ignored(tmp_path, finished_run):
    """An adapter keeps the run's dtypes: --dtype bf16 used to be ignored without a word
    (an fp32 adapter written where bf16 was asked)."""
    dest = tmp_path / "exp"
    _clear(_run("export", finished_run, dest, "--format", "adapter", "--dtype", "bf16"),
           "--dtype bf16 applies to a merged model")  # fmt: skip
    assert not dest.exists()


def test_a_non_finite_compare_target_is_refused(tmp_path):
    _clear(_run("compare", "--out", tmp_path / "c", "--target", "nan"),
           "--target must be a finite number, got nan")  # fmt: skip
    assert not (tmp_path / "c").exists()


def test_an_encoder_on_a_generation_task_is_refused(tmp_path, tiny_bert_dir):
    """A BERT loaded as a causal LM attends both ways and was trained and scored (exact
    match 0) without a word."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(f'{{"prompt": "{i} + 1 =", "response": "{i + 1}"}}\n'
                            for i in range(40)))  # fmt: skip
    out = tmp_path / "o"
    _clear(_tiny(tiny_bert_dir, data, out),
           f"model {str(tiny_bert_dir)!r} is an encoder (bert: it attends both ways)")  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("damage", ["tensors half-written", "meta.json torn", "no checkpoint"])
def test_exporting_a_damaged_checkpoint_names_it(tmp_path, finished_run, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ckpt = run / "checkpoints" / "fedex" / "round-0001"
    if damage == "tensors half-written":
        f = ckpt / "tensors.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        why = f"checkpoint {str(ckpt)!r} is unreadable or corrupt"
    elif damage == "meta.json torn":
        (ckpt / "meta.json").write_text('{"files": {"tens')
        why = f"checkpoint {str(ckpt)!r} is unreadable or corrupt"
    else:
        shutil.rmtree(ckpt)
        why = f"run {str(run)!r} has no checkpoint for method 'fedex'"
    res = _run("export", run, tmp_path / "exported")
    _clear(res, why)
    assert not (tmp_path / "exported").exists()
