"""Flower records <-> tensors, and Flower run config <-> :class:`fedexlora.config.RunConfig`.

Everything the Flower apps exchange goes through here: tensors travel in ``ArrayRecord``s
(bf16/fp16 cast to fp32, since numpy has no bf16), and the run configuration travels as a
flat Flower ``run_config`` whose keys are the :class:`RunConfig` fields with dashes
(``num-clients``), plus a few Flower-only settings (:class:`FlowerSettings`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fedexlora.config import ConfigError, RunConfig, validate_mapping
from fedexlora.run.recipes import unknown_recipe

__all__ = [
    "FLOWER_KEYS",
    "FlowerSettings",
    "from_array_record",
    "resolve_run_config",
    "to_array_record",
    "to_run_config",
]

# Run-config keys that are not RunConfig fields.
FLOWER_KEYS = (
    "run-dir",
    "min-train-nodes",
    "min-available-nodes",
    "round-timeout",
    "wait-timeout",
    "resume",
    "client-state-dir",
)
# RunConfig fields that never travel in a Flower run config.
_LOCAL_ONLY = ("engine", "export", "export_format", "export_dtype", "allow_inexact")
_TYPES = {f.name: str(f.type) for f in fields(RunConfig)}
_LISTS = tuple(k for k, t in _TYPES.items() if t.startswith("list"))
_INT_FIELDS = {k for k, t in _TYPES.items() if t.startswith("int")}


@dataclass(frozen=True)
class FlowerSettings:
    """The Flower-only part of a run config.

    Attributes:
        run_dir: Where the ServerApp writes the run directory (``""``: a timestamped
            directory under ``runs/`` of the ServerApp's working directory).
        min_train_nodes: The fewest uploads a round needs to be aggregated; with fewer,
            the round leaves the global model unchanged.
        min_available_nodes: Nodes the server waits for before the first round
            (``0``: every partition, i.e. ``num_clients``).
        round_timeout: Seconds to wait for the replies of one round.
        wait_timeout: Seconds to wait for ``min_available_nodes`` nodes to connect.
        resume: A run directory to continue from its last checkpoint (``""``: a new run
            in ``run_dir``). Its ``config.toml`` must match this run config.
        client_state_dir: Where every client also keeps its state on disk, so that a
            resumed run finds it (``""``: only in the Flower Context, which dies with
            the run; a SuperNode's node config ``state-dir`` takes precedence).
    """

    run_dir: str = ""
    min_train_nodes: int = 1
    min_available_nodes: int = 0
    round_timeout: float = 3600.0
    wait_timeout: float = 600.0
    resume: str = ""
    client_state_dir: str = ""

    def errors(self) -> list[str]:
        """Every problem with the values (empty when valid)."""
        errs = []
        if self.min_train_nodes < 1:
            errs.append(f"`min-train-nodes` must be >= 1, got {self.min_train_nodes}")
        if self.min_available_nodes < 0:
            errs.append(f"`min-available-nodes` must be >= 0, got {self.min_available_nodes}")
        if not self.round_timeout > 0:
            errs.append(f"`round-timeout` must be > 0, got {self.round_timeout}")
        if not self.wait_timeout > 0:
            errs.append(f"`wait-timeout` must be > 0, got {self.wait_timeout}")
        return errs


def to_array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord of CPU tensors; bf16/fp16 are sent as fp32 (numpy has no bf16)."""
    record = ArrayRecord()
    for key, t in tensors.items():
        t = t.detach().to("cpu")
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        record[key] = Array(t.contiguous().numpy())
    return record


def from_array_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of an ArrayRecord, by key (writable copies)."""
    return {key: torch.from_numpy(arr.numpy().copy()) for key, arr in record.items()}


def to_run_config(cfg: RunConfig, **settings: Any) -> dict[str, bool | int | float | str]:
    """A flat Flower run config for ``cfg`` (dashed keys, lists as comma strings).

    Keyword arguments add Flower settings, e.g. ``run_dir="/tmp/run"`` becomes
    ``run-dir``. ``engine`` and ``export`` are left out: they concern the caller only.
    """
    out: dict[str, bool | int | float | str] = {}
    for key, value in cfg.to_dict().items():
        if key in _LOCAL_ONLY:
            continue
        if key in _LISTS:
            value = ",".join(str(v) for v in value)
        out["method" if key == "methods" else key.replace("_", "-")] = value
    for key, value in settings.items():
        dashed = key.replace("_", "-")
        if dashed not in FLOWER_KEYS:
            raise ValueError(f"unknown Flower setting {key!r}; known: {list(FLOWER_KEYS)}")
        out[dashed] = value
    return out


def resolve_run_config(run_config: Mapping[str, Any]) -> tuple[RunConfig, FlowerSettings]:
    """The RunConfig and Flower settings of a flat Flower run config.

    Empty strings mean "unset" (Flower configs cannot hold ``None``); list fields are
    comma strings. The engine is ``flower`` whatever the config says.

    Raises:
        ConfigError: Listing every error, unknown keys included.
    """
    data: dict[str, Any] = {}
    flower: dict[str, Any] = {}
    errs: list[str] = []
    for key, value in run_config.items():
        if key in FLOWER_KEYS:
            flower[key.replace("-", "_")] = value
            continue
        norm = key.replace("-", "_")
        if norm in _LOCAL_ONLY:
            continue  # the engine is flower, whatever the config says
        if isinstance(value, str) and value.strip() == "":
            continue  # unset
        if norm in _LISTS and norm != "methods" and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            if _TYPES[norm].startswith("list[int]"):
                value = [int(v) if v.lstrip("-").isdigit() else v for v in value]
        if isinstance(value, float) and math.isfinite(value) and norm in _INT_FIELDS:
            if value.is_integer():  # TOML `3.0` for an integer field
                value = int(value)
        data[key] = value
    data["engine"] = "flower"  # validated as the Flower engine runs it
    cfg, cfg_errs = validate_mapping(data)
    errs.extend(cfg_errs)
    if cfg is not None and cfg.recipe is not None and unknown_recipe(cfg.recipe):
        errs.append(unknown_recipe(cfg.recipe))
    settings = None
    try:
        settings = FlowerSettings(**{k: _coerce(k, v) for k, v in flower.items()})
        errs.extend(settings.errors())
    except (TypeError, ValueError) as exc:
        errs.append(f"Flower settings: {exc}")
    if errs or cfg is None or settings is None:
        raise ConfigError(errs)
    return cfg, settings


def _coerce(name: str, value: Any) -> Any:
    want = {f.name: f.type for f in fields(FlowerSettings)}[name]
    if want == "str":
        if not isinstance(value, str):
            raise ValueError(f"`{name.replace('_', '-')}` must be a string, got {value!r}")
        return value
    if want == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"`{name.replace('_', '-')}` must be an integer, got {value!r}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"`{name.replace('_', '-')}` must be an integer, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name.replace('_', '-')}` must be a number, got {value!r}")
    return float(value)
