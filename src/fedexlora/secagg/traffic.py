"""The bytes of SecAgg+'s own messages, as a client sends them (issue 55, item 6).

``bytes_up`` counts each client's upload (under secure aggregation, its masked vector).
The protocol's other client messages are counted apart, in ``bytes_up_protocol``: stage
0's two public keys, stage 1's encrypted Shamir shares (one per neighbour), and stage 3's
shares that remove the masks. Both engines count them from the replies their server
side actually receives (:func:`protocol_nbytes`), so the figure is the same on either.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["protocol_nbytes"]


def _value_nbytes(value) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bool):
        return 1
    if isinstance(value, (int, float)):
        return 8
    if isinstance(value, (list, tuple)):
        return sum(_value_nbytes(v) for v in value)
    raise TypeError(f"a SecAgg+ reply holds a {type(value).__name__}, which is not counted")


def protocol_nbytes(reply: Mapping) -> int:
    """Bytes of one client's SecAgg+ protocol reply: its values at their size as sent.

    A byte string (a key, a ciphertext, a share) by its length, a list by the sum of its
    items, a number as 8 bytes, a flag as 1, a string as its UTF-8 length. The field
    names (the transport's framing, the same in every round) are not counted.
    """
    return sum(_value_nbytes(v) for v in reply.values())
