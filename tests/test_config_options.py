"""Each setting's own check, declared once beside its field, refuses what it must.

The table is written by hand, not read from the declarations: a bound dropped or moved
in ``config.py`` fails here.
"""

import pytest

from fedexlora.config import RunConfig

BAD = [
    ("num_clients", 0, "`num_clients` must be >= 1, got 0"),
    ("lora_r", 0, "`lora_r` must be >= 1, got 0"),
    ("lora_alpha", 0.0, "`lora_alpha` must be > 0, got 0.0"),
    ("lora_dropout", 1.0, "`lora_dropout` must be in [0, 1), got 1.0"),
    ("alpha", 0.0, "`alpha` must be > 0, got 0.0"),
    ("min_partition_size", 0, "`min_partition_size` must be >= 1, got 0"),
    ("rounds", 0, "`rounds` must be >= 1, got 0"),
    ("local_epochs", 0.0, "`local_epochs` must be > 0, got 0.0"),
    ("local_steps", 0, "`local_steps` must be >= 1, got 0"),
    ("batch_size", 0, "`batch_size` must be >= 1, got 0"),
    ("eval_batch_size", 0, "`eval_batch_size` must be >= 1, got 0"),
    ("lr", 0.0, "`lr` must be > 0, got 0.0"),
    ("weight_decay", -0.1, "`weight_decay` must be >= 0, got -0.1"),
    ("warmup_ratio", 1.0, "`warmup_ratio` must be in [0, 1), got 1.0"),
    ("max_grad_norm", 0.0, "`max_grad_norm` must be > 0, got 0.0"),
    ("max_length", 7, "`max_length` must be >= 8, got 7"),
    ("fraction", 0.0, "`fraction` must be in (0, 1], got 0.0"),
    ("fraction", 1.5, "`fraction` must be in (0, 1], got 1.5"),
    ("test_fraction", 1.0, "`test_fraction` must be in (0, 1), got 1.0"),
    ("max_train", 0, "`max_train` must be >= 1, got 0"),
    ("max_test", 0, "`max_test` must be >= 1, got 0"),
    ("max_new_tokens", 0, "`max_new_tokens` must be >= 1, got 0"),
    ("num_beams", 0, "`num_beams` must be >= 1, got 0"),
    ("residual_rank", 0, "`residual_rank` must be >= 1, got 0"),
    ("max_update_norm", 0.0, "`max_update_norm` must be > 0, got 0.0"),
    ("side_rank", 0, "`side_rank` must be >= 1, got 0; fix: --side-rank 64"),
    ("dp_epsilon", 0.0, "`dp_epsilon` must be > 0, got 0.0; fix: --dp-epsilon 8"),
    ("dp_delta", 1.0, "`dp_delta` must be in (0, 1), got 1.0"),
    ("dp_max_grad_norm", 0.0, "`dp_max_grad_norm` must be > 0, got 0.0"),
    ("fedsb_rank", 0, "`fedsb_rank` must be >= 1, got 0"),
    ("fedsb_init_samples", 0, "`fedsb_init_samples` must be >= 1, got 0"),
    ("keep_checkpoints", 0, "`keep_checkpoints` must be >= 1, got 0"),
    (
        "partition",
        "random",
        "`partition` must be one of ('iid', 'dirichlet', 'group'), got 'random'",
    ),
    ("nproc_per_client", 0, "`nproc_per_client` must be >= 1, got 0"),
    ("distributed", "zero", "`distributed` must be one of ('ddp', 'fsdp'), got 'zero'"),
    ("launcher", "mpirun", "`launcher` must be one of ('torchrun', 'accelerate'), got 'mpirun'"),
    ("weighting", "size", "`weighting` must be one of ('examples', 'uniform'), got 'size'"),
    ("engine", "ray", "`engine` must be one of ('local', 'flower'), got 'ray'"),
    ("trainer", "keras", "`trainer` must be one of ('builtin', 'trl'), got 'keras'"),
    ("device", "tpu", "`device` must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    ("dtype", "fp8", "`dtype` must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'"),
    ("quantization", "nf3", "`quantization` must be one of ('nf4', 'fp4', 'int8'), got 'nf3'"),
    ("export_format", "gguf", "`export_format` must be one of ('adapter', 'merged'), got 'gguf'"),
    ("export_dtype", "int4", "`export_dtype` must be one of ('fp32', 'bf16', 'fp16'), got 'int4'"),
    ("fedsb_init", "svd", "`fedsb_init` must be one of ('auto', 'gradient', 'random'), got 'svd'"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_value_out_of_its_range_is_refused_naming_the_key(key, value, message):
    errors = RunConfig().replace(**{key: value}).errors()
    assert any(e.startswith(message) for e in errors), errors


# the edge of each range, and values no check may refuse
GOOD = [
    ("lora_dropout", 0.0), ("warmup_ratio", 0.0), ("weight_decay", 0.0), ("max_length", 8),
    ("fraction", 1.0), ("seed", 0), ("seed", 2**32 - 1), ("local_steps", 1), ("residual_rank", 1),
    ("dp_epsilon", 1e6), ("weighting", "uniform"), ("quantization", None),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value"), GOOD, ids=[f"{k}={v}" for k, v in GOOD])
def test_a_value_at_the_edge_of_its_range_is_accepted(key, value):
    errors = RunConfig().replace(**{key: value}).errors()
    assert not [e for e in errors if e.startswith(f"`{key}` must")], errors
