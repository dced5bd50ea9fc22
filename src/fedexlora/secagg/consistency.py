"""What a client checks so that an active server cannot single one of them out.

SecAgg+'s parameters come from the server, so a server that lies can choose them for a
victim. Two such attacks, and the client's checks against them (issue #55):

- **A split unmask.** Each client's mask seed and pairwise key are shared among its
  ``n`` neighbours with threshold ``t``; in stage 3 an honest client sends, for each
  neighbour, either its share of the seed (the neighbour is alive) or of the key (it
  dropped), never both. A server that asks ``t`` clients for the victim's seed share and
  ``t`` others for its key share rebuilds both, and so the victim's vector, whenever
  ``2 t <= n``. A client refuses a setup whose threshold is not more than half its
  shares (:func:`check_threshold`): no two disjoint sets of ``t`` holders exist then.
- **A per-client setup.** A server that sends the other clients a clipping range of
  ``2**40`` knows what their quantized vectors hold (the midpoint), and reads the
  victim's from the sum. Each client hashes its setup message, and its neighbour set
  where every client is every other's neighbour (:func:`setup_digest`), sends the hash to
  each neighbour encrypted under their pairwise channel key with its key shares
  (:func:`seal`), and before it sends its masked vector checks that every neighbour
  whose shares it holds was given the same (:func:`check_digests`): a refusal otherwise.

What this does not cover is said in docs/PRIVACY.md ("Which servers it protects
against"): the server routes the public keys, so one that replaces them (no PKI) sits
in the middle of every pairwise channel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["DIGESTS", "check_digests", "check_threshold", "seal", "setup_digest"]

DIGESTS = "fedex.digests"
"""The key of the sealed setup hashes, in stage 1's reply and stage 2's message."""

_CONTEXT = b"fedex-lora secagg setup v1"


def check_threshold(client: int, threshold: int, shares: int, sample: int) -> None:
    """Refuses a setup in which a split unmask request could rebuild both secrets.

    Raises:
        ValueError: If ``2 * threshold <= shares``, ``threshold < 2``, or ``shares``
            is not within ``threshold..sample``.
    """
    if threshold < 2 or not threshold <= shares <= sample:
        raise ValueError(
            f"client {client}: a secure aggregation setup with threshold {threshold} of "
            f"{shares} shares among {sample} clients is invalid; refused"
        )
    if 2 * threshold <= shares:
        raise ValueError(
            f"client {client}: a secure aggregation threshold of {threshold} of {shares} "
            "shares is not more than half: a server could ask some neighbours for a "
            "client's mask-seed share and the others for its key share, and read its "
            "vector; refused"
        )


def _canon(value) -> bytes:
    """A value of a setup message as bytes, the same on every client."""
    if isinstance(value, bool):
        return b"i" + str(int(value)).encode()
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, float):
        return b"f" + value.hex().encode()
    if isinstance(value, bytes):
        return b"b" + value.hex().encode()
    if isinstance(value, str):
        return b"s" + value.encode().hex().encode()
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(_canon(v) for v in value) + b"]"
    raise TypeError(f"a secure aggregation setup holds a {type(value).__name__}")


def setup_digest(setup: Mapping, neighbours: Mapping[int, Sequence[bytes]] | None = None) -> bytes:
    """SHA-256 of the setup message (every field), and of ``neighbours`` if given.

    ``neighbours`` (each neighbour's id and its two public keys) is hashed where every
    client should see the same set: when each client shares with every other.
    """
    h = hashlib.sha256(_CONTEXT)
    for key in sorted(setup):
        h.update(str(key).encode() + b"=" + _canon(setup[key]) + b";")
    if neighbours is not None:
        for nid in sorted(neighbours):
            h.update(b"n" + str(int(nid)).encode() + _canon(list(neighbours[nid])) + b";")
    return h.digest()


def seal(key: bytes, digest: bytes, src: int, dst: int) -> bytes:
    """``digest`` for neighbour ``dst``, encrypted and authenticated (Fernet).

    Under the channel key ``src`` and ``dst`` agreed (Flower's ``ss2``).
    """
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt

    return encrypt(key, _CONTEXT + f"|{src}|{dst}|".encode() + digest)


def check_digests(
    client: int,
    own: bytes,
    keys: Mapping[int, bytes],
    sources: Sequence[int],
    sealed: Sequence[bytes],
) -> None:
    """Checks that each source's sealed digest opens to this client's own.

    Args:
        client: This client.
        own: Its setup digest.
        keys: Its channel key with each neighbour.
        sources: The neighbours whose shares it was forwarded.
        sealed: Their sealed digests, in the same order.

    Raises:
        ValueError: If one is missing, does not open, or differs: the server sent
            the neighbours different setups (or neighbour sets).
    """
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt

    if len(sealed) != len(sources):
        raise ValueError(
            f"client {client}: {len(sealed)} setup hashes came with the shares of "
            f"{len(sources)} neighbours; refusing to send its vector"
        )
    for src, ct in zip(sources, sealed, strict=True):
        try:
            plain = decrypt(keys[src], bytes(ct))
        except Exception as exc:  # a forged or misrouted hash: never trusted
            raise ValueError(
                f"client {client}: the setup hash from client {src} does not open; "
                "refusing to send its vector"
            ) from exc
        if plain != _CONTEXT + f"|{src}|{client}|".encode() + own:
            raise ValueError(
                f"client {client}: client {src} was sent a different secure aggregation "
                "setup or neighbour set than this client (the server may be singling a "
                "client out); refusing to send its vector"
            )
