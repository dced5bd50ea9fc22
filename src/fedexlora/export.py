"""Deprecated: moved to :mod:`fedexlora.run.export`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.export moved to fedexlora.run.export; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.run.export")
