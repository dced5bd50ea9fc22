"""fedex-lora: federated LoRA fine-tuning with exact aggregation (FedEx-LoRA)."""

from .aggregation import METHODS, AggregationResult, Residual, aggregate, deviation
from .state import AdapterState, RoundAggregate, aggregate_states

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "AdapterState",
    "AggregationResult",
    "Residual",
    "RoundAggregate",
    "__version__",
    "aggregate",
    "aggregate_states",
    "deviation",
]
