"""Deprecated: moved to :mod:`fedexlora.core.hetero`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.hetero moved to fedexlora.core.hetero; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.core.hetero")
