"""The data: each node's partition of an instruction dataset, as TRL conversations."""

import json
import os
from types import SimpleNamespace

from flwr.common.config import unflatten_dict
from flwr_datasets.partitioner import IidPartitioner

from fedexlora.tasks.data import load_task
from fedexlora.training.sft import conversations


def replace_keys(input_dict, match="-", target="_"):
    """Dashes to underscores in every key (FlowerTune's helper), as nested namespaces."""
    if not isinstance(input_dict, dict):
        return input_dict
    return SimpleNamespace(
        **{k.replace(match, target): replace_keys(v, match, target) for k, v in input_dict.items()}
    )


def app_config(run_config) -> SimpleNamespace:
    """The run config as ``cfg.model.lora.peft_lora_r``-style attributes.

    ``FLOWERTUNE_CONFIG`` (JSON of flat keys) overrides it: ``run_simulation`` passes no run
    config, so a quick try or a test sets that instead.
    """
    flat = {**dict(run_config), **json.loads(os.environ.get("FLOWERTUNE_CONFIG", "{}"))}
    nested = unflatten_dict(flat)
    if "dataset" not in nested and "dataset" in nested.get("static", {}):
        nested["dataset"] = nested["static"]["dataset"]
    return replace_keys(nested)


def load_task_splits(cfg: SimpleNamespace):
    """The task: its train split (partitioned below) and its held-out test split."""
    return load_task(cfg.dataset.name, seed=0, test_fraction=0.2)


def load_data(partition_id: int, num_partitions: int, cfg: SimpleNamespace):
    """This node's IID partition (flwr-datasets' ``IidPartitioner``), as conversations."""
    partitioner = IidPartitioner(num_partitions=num_partitions)
    partitioner.dataset = load_task_splits(cfg).train
    part = partitioner.load_partition(partition_id)
    return conversations(part)
