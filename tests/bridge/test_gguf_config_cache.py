"""A GGUF file's configuration is parsed once per process and file version.

transformers parses a GGUF file's metadata to build its configuration (about 6
CPU-seconds for SmolLM2-135M's 98 MB file), and a model load asked for it twice, an
export or a check once more. Here transformers' parser is replaced by a counting spy
(a stand-in file, no real parse): what is counted is how often fedex-lora asks it.
"""

from __future__ import annotations

import os

import pytest
import transformers

from fedexlora.bridge import models as M


@pytest.fixture()
def parses(monkeypatch):
    """The calls of ``AutoConfig.from_pretrained`` (each returns a fresh LlamaConfig)."""
    calls = []

    def spy(path, **kwargs):
        calls.append((str(path), kwargs.get("gguf_file")))
        return transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    monkeypatch.setattr(M, "_GGUF_CONFIGS", {})
    return calls


def _gguf(tmp_path, name="model.gguf", data=b"GGUF\x03"):
    (tmp_path / name).write_bytes(data)
    return M.ModelSpec("mine", str(tmp_path), gguf_file=name)


def test_a_gguf_config_is_parsed_once_and_each_call_gets_its_own_copy(tmp_path, parses):
    spec = _gguf(tmp_path)
    first = M._load_config(spec)
    first.hidden_size = 7  # a caller's change stays its own
    again = M._load_config(spec)
    assert len(parses) == 1
    assert again is not first and again.hidden_size == 64
    again.hidden_size = 9  # so is a change to a kept one's copy
    third = M._load_config(spec)
    assert third.hidden_size == 64 and len(parses) == 1


def test_a_changed_gguf_file_is_parsed_again(tmp_path, parses):
    spec = _gguf(tmp_path)
    M._load_config(spec)
    st = os.stat(tmp_path / "model.gguf")
    os.utime(tmp_path / "model.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    M._load_config(spec)  # a new modification time
    assert len(parses) == 2
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03 and more")  # a new size
    M._load_config(spec)
    M._load_config(spec)
    assert len(parses) == 3
    other = _gguf(tmp_path, "other.gguf")  # another file: its own entry, the first kept
    M._load_config(other)
    M._load_config(spec)
    assert len(parses) == 4 and parses[-1][1] == "other.gguf"


def test_a_directory_or_hub_name_is_not_kept(tmp_path, parses):
    plain = M.ModelSpec("dir", str(tmp_path))  # config.json: cheap, read every time
    hub = M.ModelSpec("hub", "org/model", gguf_file="model.gguf")  # no local file
    for spec in (plain, plain, hub, hub):
        M._load_config(spec)
    assert len(parses) == 4 and not M._GGUF_CONFIGS


def test_load_base_skips_the_parse_when_a_whole_dequantized_copy_exists(
    tmp_path, parses, monkeypatch
):
    """The copy exists only once the file loaded: the check of its name is not needed."""
    (tmp_path / "src").mkdir()
    spec = _gguf(tmp_path / "src")
    monkeypatch.setenv("FEDEXLORA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(M, "resolve_model", lambda name: spec)
    loaded = []
    monkeypatch.setattr(M, "_load_base", lambda s, *a: loaded.append(s.path) or ("m", "t"))
    monkeypatch.setattr(M, "_gguf_cache", lambda s: None)  # no copy written here
    M.load_base("mine")  # no copy: parsed (a bad name is refused here)
    assert len(parses) == 1 and loaded == [spec.path]
    M._GGUF_CONFIGS.clear()
    entry = M._gguf_entry(spec)
    entry.mkdir(parents=True)
    assert M._gguf_copy(spec) is None  # an incomplete copy (no marker) counts for nothing
    M.load_base("mine")
    assert len(parses) == 2
    (entry / M._GGUF_DONE).write_text(entry.name)
    assert M._gguf_copy(spec) == entry
    M._GGUF_CONFIGS.clear()
    M.load_base("mine")
    assert len(parses) == 2 and len(loaded) == 3
    M.load_base("mine", causal=False)  # a classifier does not read the copy: checked
    assert len(parses) == 3
