"""Deprecated: moved to :mod:`fedexlora.run.trackers`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.trackers moved to fedexlora.run.trackers; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.run.trackers")
