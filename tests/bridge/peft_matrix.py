"""The architectures x LoRA options matrix: each line exact against a hand fp64 ideal, or
refused before training.

A case builds a tiny randomly initialised model from a transformers config class (no
download), wraps it with peft under one LoRA option set, and federates three clients for
two rounds through the public API (``Server``, ``apply_payload``, ``make_upload``,
``apply_outcome``), each client training its own way (a few Adam steps on its own random
data). The ideal is kept by hand, in fp64, from the clients' effective models alone (each
LoRA layer merged by peft's own ``merge`` on a copy, so peft defines what a layer's weight
is): ``ideal_t = ideal_{t-1} + sum_i p_i (after_i - before_i)``. Every client must start
each round at the ideal, and the global model must end each round at it: every weight
(frozen ones included, which must not move at all) and the logits.

A case's verdict is ``PASS``, ``REFUSED: <message>`` (a ``ValueError`` raised before any
training), ``PEFT: <message>`` (peft itself rejects the option on that architecture) or
``FAIL: <what>`` (an error after training started, or a model off the ideal).

Run ``python tests/bridge/peft_matrix.py`` for the markdown table of docs/API.md.
"""

from __future__ import annotations

import copy
import sys

import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from fedexlora import Server, apply_outcome, apply_payload, get_state, layer_info, make_upload
from fedexlora.bridge.fold import side_weight, use_side_branch

try:
    from fedexlora.bridge.layer_kinds import to_stored
except ImportError:  # the code before bridge.layer_kinds (the matrix's "before" counts)

    def to_stored(layer, M):
        return M.T if getattr(layer, "fan_in_fan_out", False) else M


VOCAB = 64
WEIGHTS = (3, 5, 8)  # the clients' num_examples: p_i = 3/16, 5/16, 8/16
WEIGHT_TOL = 1e-4  # ||W - ideal|| / ||ideal - previous||, per parameter (fp32 fold: ~1e-5)
LOGIT_TOL = 1e-3  # the same for the logits

_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)


def _cfg(cls, **kw):
    return getattr(tf, cls)(**kw)


# name -> (model class, config class, config kwargs, input kind, embedding module, a module
# for modules_to_save, the default targets where peft has none)
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER, "lm", "embed_tokens", "norm", None),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        _DECODER,
        "lm",
        "embed_tokens",
        "norm",
        None,
    ),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER, "lm", "embed_tokens", "norm", None),
    "gemma": (
        "GemmaForCausalLM",
        "GemmaConfig",
        dict(_DECODER, head_dim=16),
        "lm",
        "embed_tokens",
        "norm",
        None,
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(_DECODER, rope_scaling=None),
        "lm",
        "embed_tokens",
        "norm",
        ["qkv_proj"],
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64),
        "lm",
        "wte",
        "ln_f",
        None,
    ),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(_DECODER, num_key_value_heads=None),
        "lm",
        "embed_in",
        "final_layer_norm",
        None,
    ),
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
        "lm",
        "embed_tokens",
        "final_layer_norm",
        None,
    ),
    "bloom": (
        "BloomForCausalLM",
        "BloomConfig",
        dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2),
        "lm",
        "word_embeddings",
        "ln_f",
        None,
    ),
    "bert": (
        "BertForSequenceClassification",
        "BertConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            max_position_embeddings=64,
        ),
        "cls",
        "word_embeddings",
        "classifier",
        None,
    ),
    "roberta": (
        "RobertaForSequenceClassification",
        "RobertaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            max_position_embeddings=64,
        ),
        "cls",
        "word_embeddings",
        "classifier",
        None,
    ),
    "distilbert": (
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=48),
        "cls",
        "word_embeddings",
        "classifier",
        ["q_lin", "v_lin"],
    ),
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=16,
            d_ff=48,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
        ),
        "seq2seq",
        "shared",
        "final_layer_norm",
        None,
    ),
    "bart": (
        "BartForConditionalGeneration",
        "BartConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            max_position_embeddings=64,
        ),
        "seq2seq",
        "shared",
        "layernorm_embedding",
        None,
    ),
    "vit": (
        "ViTForImageClassification",
        "ViTConfig",
        dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=48,
            image_size=8,
            patch_size=4,
            num_channels=3,
        ),
        "image",
        "projection",
        "classifier",
        ["q_proj", "v_proj"],
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            _DECODER,
            num_hidden_layers=1,
            num_local_experts=2,
            num_experts_per_tok=2,
            experts_implementation="eager",  # fp64 logits (grouped_mm has no fp64)
        ),
        "lm",
        "embed_tokens",
        "norm",
        ["q_proj", "v_proj"],
    ),
}


def _options(arch: str) -> dict[str, dict]:
    """The LoRA option sets tried on ``arch`` (kwargs of ``LoraConfig`` beyond ``r``)."""
    *_, emb, save, default = ARCHS[arch]
    base = {} if default is None else {"target_modules": default}
    opts = {
        "default": dict(base),
        "all-linear": {"target_modules": "all-linear"},
        "rslora": dict(base, use_rslora=True),
        "rank/alpha pattern": dict(
            base, target_modules="all-linear", rank_pattern={"0": 2}, alpha_pattern={"0": 3}
        ),
        "modules_to_save": dict(base, modules_to_save=[save]),
        "bias=all": dict(base, bias="all"),
        "bias=lora_only": dict(base, bias="lora_only"),
        "layers_to_transform": dict(base, layers_to_transform=[0]),
        "init=gaussian": dict(base, init_lora_weights="gaussian"),
        "init=pissa": dict(base, init_lora_weights="pissa"),
        "init=olora": dict(base, init_lora_weights="olora"),
        "use_dora": dict(base, use_dora=True),
        "use_dora, side branch": dict(base, use_dora=True, _side=True),  # DoRA still folds
        "embeddings": {"target_modules": [emb]},
        "lora_bias": dict(base, lora_bias=True),
        "side branch": dict(base, _side=True),  # use_side_branch: fp32 folds held beside
        "embeddings, side branch": {"target_modules": [emb], "_side": True},
    }
    if ARCHS[arch][3] == "lm":
        opts["lm_head"] = {"target_modules": ["lm_head"]}
    if arch == "llama":
        opts["layer_replication"] = dict(base, layer_replication=[[0, 2], [1, 2]])
    if arch == "mixtral":
        opts["target_parameters"] = {
            "target_modules": [],
            "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
        }
    return opts


CASES = [(a, o) for a in ARCHS for o in _options(a)]


def base(arch: str) -> torch.nn.Module:
    """The plain pretrained model of ``arch`` (seed 0: every party loads the same)."""
    model_cls, cfg_cls, kw, kind, *_ = ARCHS[arch]
    torch.manual_seed(0)
    cfg = _cfg(cfg_cls, **kw)
    if kind == "cls":
        cfg.num_labels = 3
    for k in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "dropout",
        "attention_dropout",
    ):
        if hasattr(cfg, k) and isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    return getattr(tf, model_cls)(cfg).eval()


def build(arch: str, option: str) -> torch.nn.Module:
    """The peft model of a case, seed 0 (every party builds the same one)."""
    model = base(arch)
    opts = dict(_options(arch)[option])
    side = opts.pop("_side", False)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **opts)
    torch.manual_seed(0)
    model = get_peft_model(model, lora).eval()
    model.fedex_matrix_side = side  # use_side_branch, called in run_case's setup
    return model


def inputs(arch: str, seed: int) -> dict[str, torch.Tensor]:
    """A batch for ``arch``'s model (its input kind), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    kind = ARCHS[arch][3]
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    ids = torch.randint(1, VOCAB, (2, 6), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, VOCAB, (2, 5), generator=g)}
    return {"input_ids": ids}


def _train(model, arch: str, seed: int, steps: int = 3) -> None:
    """A client's own training: Adam on its own random targets for the logits."""
    x = inputs(arch, seed)
    with torch.no_grad():
        target = torch.randn(model(**x).logits.shape, generator=torch.Generator().manual_seed(seed))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=2e-2)
    for _ in range(steps):
        loss = (model(**x).logits - target).pow(2).mean()
        if not loss.requires_grad:  # the adapted modules are not on the forward path
            return
        loss.backward()
        opt.step()
        opt.zero_grad()


def _untie_and_merge(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every LoRA layer merged by peft (its own definition of the
    layer's weight), each merged base first given its own storage (a tied weight merged in
    place would change the tensor it shares)."""
    m = copy.deepcopy(model)
    for layer in [x for x in m.modules() if isinstance(x, LoraLayer)]:
        base = layer.get_base_layer()
        for pname, p in list(base.named_parameters(recurse=False)):
            setattr(base, pname, torch.nn.Parameter(p.detach().clone(), p.requires_grad))
        if any(layer.lora_bias.values()) and getattr(base, "bias", 0) is None:
            out = base.weight.shape[0]  # a LoRA bias is merged into the base's (zero) bias
            base.bias = torch.nn.Parameter(base.weight.new_zeros(out), requires_grad=False)
    for layer in [x for x in m.modules() if isinstance(x, LoraLayer)]:
        side = side_weight(layer)  # fedex-lora's side branch: in the weight, as stored
        layer.merge()
        if side is not None:
            w = layer.get_base_layer().weight
            w.data += to_stored(layer, side).to(w.dtype)
            layer._forward_hooks.clear()  # the copy's side branch is in its weight now
    return m


def effective(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as its forward pass applies it (fp64), by name.

    LoRA layers merged into their bases; the LoRA factors themselves left out. Tied
    parameters appear under each name that holds them.
    """
    m = _untie_and_merge(model)
    return {
        n: p.detach().double().clone()
        for n, p in m.named_parameters(remove_duplicate=False)
        if ".lora_" not in n
    }


def _rel(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    move = float(torch.linalg.norm(want - before))
    err = float(torch.linalg.norm(got - want))
    if move == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / move


def _worst(got: dict, want: dict, before: dict) -> tuple[float, str]:
    if set(got) != set(want):
        return float("inf"), f"parameters differ: {sorted(set(got) ^ set(want))[:2]}"
    worst, where = 0.0, ""
    for n in want:
        r = _rel(got[n], want[n], before[n])
        if r > worst:
            worst, where = r, n
    return worst, where


def _logits(model, arch: str, params: dict | None = None) -> torch.Tensor:
    """The model's logits in fp64, with ``params`` (by :func:`effective`'s names) loaded."""
    m = _untie_and_merge(model).double()
    if params is not None:
        with torch.no_grad():
            for n, p in m.named_parameters(remove_duplicate=False):
                if n in params:
                    p.copy_(params[n])
    with torch.no_grad():
        return m(**inputs(arch, 99)).logits


def run_case(
    arch: str, option: str, rounds: int = 2, keep: dict | None = None, builder=None
) -> str:
    """Federates the case (3 clients, ``rounds`` rounds) and returns its verdict.

    ``keep``, if given, receives the global model under ``"model"``. ``builder``, if
    given, builds every party's model instead of :func:`build` (a case beyond
    ``LoraConfig``'s options: a second adapter, a cast after wrapping).
    """
    make = builder or (lambda: build(arch, option))
    try:
        global_model = make()
    except Exception as e:  # noqa: BLE001  peft's own refusal
        return f"PEFT: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    clients = [make() for _ in WEIGHTS]
    if keep is not None:
        keep["model"] = global_model
    try:
        for m in [global_model, *clients]:
            if getattr(m, "fedex_matrix_side", False):
                use_side_branch(m)
        server = Server(get_state(global_model), layer_info(global_model), num_clients=3)
        payloads = {i: server.payload_for(i) for i in server.sample(1)}
        for i, c in enumerate(clients):
            apply_payload(c, payloads[i])
    except ValueError as e:
        return f"REFUSED: {str(e).splitlines()[0]}"
    try:
        ideal = previous = effective(global_model)
        logits0 = _logits(global_model, arch)
    except Exception as e:  # noqa: BLE001  peft cannot merge or run its own model
        return f"PEFT: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    try:
        for rnd in range(1, rounds + 1):
            if rnd > 1:
                payloads = {i: server.payload_for(i) for i in server.sample(rnd)}
                for i, c in enumerate(clients):
                    apply_payload(c, payloads[i])
            update = {n: torch.zeros_like(t) for n, t in ideal.items()}
            uploads = []
            for i, c in enumerate(clients):
                start = effective(c)
                worst, where = _worst(start, ideal, previous)  # of the last round's update
                if worst > WEIGHT_TOL:
                    return (
                        f"FAIL: client {i} starts round {rnd} off the ideal ({where}: {worst:.1e})"
                    )
                _train(c, arch, seed=10 * rnd + i)
                after = effective(c)
                p = WEIGHTS[i] / sum(WEIGHTS)
                for n in update:
                    update[n] += p * (after[n] - start[n])
                uploads.append(make_upload(c, WEIGHTS[i], client_id=i))
            previous = ideal
            ideal = {n: previous[n] + update[n] for n in previous}
            outcome = server.aggregate(uploads)
            reported = apply_outcome(global_model, server, outcome, uploads)
            worst, where = _worst(effective(global_model), ideal, previous)
            if worst > WEIGHT_TOL:
                return f"FAIL: round {rnd}: {where} off the ideal by {worst:.1e} of its update"
            # the model is exact: the run's own report (what a run prints) must say so too
            said = {k: v for k, v in reported.items() if not v <= WEIGHT_TOL}
            if said:
                return f"FAIL: round {rnd}: exact, but the run's report says {said}"
    except Exception as e:  # noqa: BLE001  any error after training started is a failure
        return f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    with torch.no_grad():  # the live model's own forward: side branches, hooks and all
        got = global_model(**inputs(arch, 99)).logits.double()
    want = _logits(global_model, arch, ideal)
    r = _rel(got, want, logits0)
    if r > LOGIT_TOL:
        return f"FAIL: logits off the ideal by {r:.1e} of their change"
    return "PASS"


def table(results: dict[tuple[str, str], str]) -> str:
    """The markdown table of ``results`` (arch x option): PASS, refused, peft, FAIL."""
    options = list(dict.fromkeys(o for _, o in results))
    archs = list(dict.fromkeys(a for a, _ in results))
    mark = {"PASS": "exact", "REFUSED": "refused", "PEFT": "peft rejects", "FAIL": "**FAIL**"}
    lines = ["| option | " + " | ".join(archs) + " |", "|---" * (len(archs) + 1) + "|"]
    for o in options:
        cells = [mark[results[(a, o)].split(":")[0]] if (a, o) in results else "" for a in archs]
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counts(results: dict) -> dict[str, int]:
    """How many cases passed, were refused, were rejected by peft, failed."""
    out = {"PASS": 0, "REFUSED": 0, "PEFT": 0, "FAIL": 0}
    for v in results.values():
        out[v.split(":")[0]] += 1
    return out


if __name__ == "__main__":
    only = sys.argv[1:]
    res = {}
    for a, o in CASES:
        if only and a not in only:
            continue
        res[(a, o)] = run_case(a, o)
        print(f"{a:10s} {o:22s} {res[(a, o)]}", flush=True)
    print(counts(res))
    print(table(res))
