"""Flower engine: a Strategy, a ClientApp and a ServerApp over the shared server logic.

Flower is transport only. The aggregation, the payloads and the server state are the
in-process engine's (:mod:`fedexlora.server`); the clients train with the same local
step (:func:`fedexlora.run.client_step.local_update`).

- :class:`FedExLoRA` (``fedexlora.flower.strategy``): the ``FedAvg`` subclass.
- ``fedexlora.flower.client_app:app`` and ``fedexlora.flower.server_app:app``: the apps
  ``flwr run .`` deploys (declared in ``pyproject.toml``).
- :func:`run_flower_experiment`: ``fedexlora run --engine flower``, through Flower's
  simulation runtime.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FedExLoRA", "NodeDirectory", "run_flower_experiment"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing a submodule (as `flwr` does) stays light.
    if name == "FedExLoRA":
        from fedexlora.flower.strategy import FedExLoRA

        return FedExLoRA
    if name == "NodeDirectory":
        from fedexlora.flower.nodes import NodeDirectory

        return NodeDirectory
    if name == "run_flower_experiment":
        from fedexlora.flower.simulation import run_flower_experiment

        return run_flower_experiment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
