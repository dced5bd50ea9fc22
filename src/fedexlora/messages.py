"""Deprecated: moved to :mod:`fedexlora.server.messages`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.messages moved to fedexlora.server.messages; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.server.messages")
