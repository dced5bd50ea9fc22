"""Deprecated: moved to :mod:`fedexlora.tasks.partition`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.partition moved to fedexlora.tasks.partition; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.tasks.partition")
