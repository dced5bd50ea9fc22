"""Deprecated: moved to :mod:`fedexlora.tasks.metrics`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.metrics moved to fedexlora.tasks.metrics; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.tasks.metrics")
