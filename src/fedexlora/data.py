"""Deprecated: moved to :mod:`fedexlora.tasks.data`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.data moved to fedexlora.tasks.data; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.tasks.data")
