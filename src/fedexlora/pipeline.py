"""Deprecated: moved to :mod:`fedexlora.run.pipeline`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.pipeline moved to fedexlora.run.pipeline; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.run.pipeline")
