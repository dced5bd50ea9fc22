"""Deprecated: moved; this old path warns, then hands back the new module."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.compare_report moved to fedexlora.experiments.compare_report; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.experiments.compare_report")
