"""Deprecated: moved to :mod:`fedexlora.core.side`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.side moved to fedexlora.core.side; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.core.side")
