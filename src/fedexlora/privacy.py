"""Deprecated: moved to :mod:`fedexlora.training.privacy`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.privacy moved to fedexlora.training.privacy; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.training.privacy")
