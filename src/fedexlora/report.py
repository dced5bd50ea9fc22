"""Deprecated: moved to :mod:`fedexlora.run.report`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.report moved to fedexlora.run.report; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.run.report")
