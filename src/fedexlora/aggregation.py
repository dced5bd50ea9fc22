"""Deprecated: moved to :mod:`fedexlora.core.aggregation`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.aggregation moved to fedexlora.core.aggregation; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.core.aggregation")
