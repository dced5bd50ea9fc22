"""Deprecated: moved; this old path warns, then hands back the new module."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.aggregation moved to fedexlora.core.aggregation; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.core.aggregation")
