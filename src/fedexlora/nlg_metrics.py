"""Deprecated: moved to :mod:`fedexlora.tasks.nlg_metrics`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.nlg_metrics moved to fedexlora.tasks.nlg_metrics; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.tasks.nlg_metrics")
