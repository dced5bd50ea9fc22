"""Deprecated: moved to :mod:`fedexlora.bridge.latent`; this path warns and will be removed."""

import importlib
import sys
import warnings

warnings.warn(
    "fedexlora.latent moved to fedexlora.bridge.latent; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module("fedexlora.bridge.latent")
