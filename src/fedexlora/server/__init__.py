"""The server: sampling, payloads, validation, one round, its state for checkpoints.

:class:`Server` (in :mod:`fedexlora.server.server`) joins one module per concern:
:mod:`~fedexlora.server.payloads`, :mod:`~fedexlora.server.hetero`,
:mod:`~fedexlora.server.aggregation`, :mod:`~fedexlora.server.lossy`,
:mod:`~fedexlora.server.state_dict` (with :mod:`~fedexlora.server.snapshot`, which
parses and checks a state, and :mod:`~fedexlora.server.record`, what was folded since
``W0``). The messages it exchanges, exported here too, live in
:mod:`fedexlora.core.messages`. Imports :mod:`fedexlora.core`, torch and the standard
library only (no peft, transformers or flwr).
"""

from fedexlora.core.messages import ClientUpload, Payload, RoundOutcome, example_count
from fedexlora.server.server import Server

__all__ = ["ClientUpload", "Payload", "RoundOutcome", "Server", "example_count"]
