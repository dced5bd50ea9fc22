"""fedex-lora: federated LoRA fine-tuning with exact aggregation (FedEx-LoRA).

The pure math (:func:`aggregate`, :class:`Residual`) imports torch only. The model-level
API (:class:`Server`, :func:`apply_payload`, :func:`make_upload`, :func:`apply_outcome`,
:func:`get_state`, :func:`layer_info`, ...) loads peft and transformers on first use. See
``docs/API.md``.
"""

from .aggregation import METHODS, AggregationResult, Residual, aggregate, deviation
from .state import AdapterState, RoundAggregate, aggregate_states

__version__ = "0.1.0"

_LAZY = {
    "Server": "server",
    "Payload": "server",
    "ClientUpload": "server",
    "RoundOutcome": "server",
    "apply_payload": "steps",
    "make_upload": "steps",
    "apply_outcome": "steps",
    "get_state": "adapters",
    "set_state": "adapters",
    "layer_info": "adapters",
    "fold_residuals": "adapters",
    "effective_weight": "adapters",
}

__all__ = [
    "METHODS",
    "AdapterState",
    "AggregationResult",
    "ClientUpload",
    "Payload",
    "Residual",
    "RoundAggregate",
    "RoundOutcome",
    "Server",
    "__version__",
    "aggregate",
    "aggregate_states",
    "apply_outcome",
    "apply_payload",
    "deviation",
    "effective_weight",
    "fold_residuals",
    "get_state",
    "layer_info",
    "make_upload",
    "set_state",
]


def __getattr__(name: str):
    """The model-level API, imported on first use (it loads peft and transformers)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fedexlora' has no attribute {name!r}")
