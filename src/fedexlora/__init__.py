"""fedex-lora: federated LoRA fine-tuning with exact aggregation (FedEx-LoRA).

The pure math (:func:`aggregate`, :class:`Residual`) imports torch only. The model-level
API (:class:`Server`, :func:`apply_payload`, :func:`make_upload`, :func:`apply_outcome`,
:func:`get_state`, :func:`layer_info`, ...) loads peft and transformers on first use. See
``docs/API.md``.
"""

from fedexlora.core.aggregation import METHODS, AggregationResult, Residual, aggregate, deviation
from fedexlora.core.state import AdapterState, RoundAggregate, aggregate_states

__version__ = "0.1.0"

_LAZY = {
    "Server": "server.server",
    "Payload": "core.messages",
    "ClientUpload": "core.messages",
    "RoundOutcome": "core.messages",
    "apply_payload": "bridge.steps",
    "make_upload": "bridge.steps",
    "apply_outcome": "bridge.steps",
    "get_state": "bridge.adapters",
    "set_state": "bridge.adapters",
    "layer_info": "bridge.adapters",
    "fold_residuals": "bridge.fold",
    "effective_weight": "bridge.fold",
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

        return getattr(importlib.import_module(f"fedexlora.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fedexlora' has no attribute {name!r}")
