"""Quiets what the libraries print that a fedex-lora user need not see.

Expected messages only: the load report of a classification head that is created on
purpose, progress bars of loading, deprecation notices of the libraries' own internals.
Called by the command line and by the Flower ClientApp (whose Ray actors and SuperNode
processes do not run the command line's code). Idempotent. fedex-lora's own warnings
(a rejected upload, blank texts in a data file) then print as one ``warning:`` line.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_libraries"]

_DONE = False


def quiet_libraries() -> None:
    """Turns off the expected noise of transformers, bitsandbytes and torch (once)."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # bitsandbytes on AVX512-BF16 CPUs looks for an optional inference kernel on the hub
    # and warns when it is absent; fedex-lora turns that code path off (bridge/models.py)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.formatwarning = _short(warnings.formatwarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*")
    warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # includes the head's "MISSING" load report
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


_HERE = os.path.dirname(os.path.abspath(__file__))


def _short(default):
    """``warnings.formatwarning`` that prints fedex-lora's own notices as one line.

    ``warning: <message>``, without the source file and line that Python adds: they
    speak to the user, not of the code. Other libraries' warnings keep ``default``.
    """

    def formatwarning(message, category, filename, lineno, line=None):
        if issubclass(category, UserWarning) and os.path.abspath(filename).startswith(_HERE):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    return formatwarning
