"""The server: sampling, payloads, validation, one round, its state for checkpoints.

Imports :mod:`fedexlora.core`, torch and the standard library only (no peft, transformers
or flwr).
"""

from fedexlora.server.server import ClientUpload, Payload, RoundOutcome, Server, example_count

__all__ = ["ClientUpload", "Payload", "RoundOutcome", "Server", "example_count"]
