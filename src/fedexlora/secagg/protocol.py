r"""SecAgg+ (Bell et al., CCS 2020) as Flower implements it, for any transport.

The client side is Flower's own: its SecAgg+ mod's key setup, key sharing and unmasking
(``flwr.client.mod.secure_aggregation.secaggplus_mod``), its key agreement and symmetric
encryption; the masks, at both ends, are expanded from the whole shared secret by a
stream cipher (:func:`_mask`), not by Flower's 32-bit-seeded generator. The server side follows
Flower's ``SecAggPlusWorkflow`` stage by stage, with Flower's Shamir secret sharing. No
cryptography is written here: this module only routes Flower's messages.

Why not Flower's workflow and mod as they are: they run only under Flower's legacy
``Strategy`` (``LegacyContext``) and average ``FitRes.parameters``, with the example count
in the clear. fedex-lora's strategy is a message-API one, its in-process engine has no
Flower messages at all, and the example counts are summed securely. So the protocol's
messages are plain dicts (ConfigRecord values), and each engine moves them: the
in-process engine by calling :class:`ClientSession` directly, the Flower engine in
``ConfigRecord``\\ s. The four stages, each one exchange of messages:

0. ``setup``: the sampled clients get the protocol's parameters and send two public keys.
1. ``share-keys``: each client gets its neighbours' public keys and sends Shamir shares of
   its mask seed and private key, encrypted for each neighbour.
2. ``collect``: each client gets the shares addressed to it (and, from the engine, its
   payload), trains, and sends its quantized vector under a private mask and pairwise
   masks that cancel in the sum.
3. ``unmask``: each survivor sends the shares that remove the survivors' private masks
   and the pairwise masks of the clients that dropped out after sharing keys.

A client that drops out after stage 1 does not stop the round: its pairwise masks are
rebuilt from its neighbours' shares, and the sum is over the survivors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Callable, Mapping

import numpy as np

from fedexlora.core.secure import MIN_SURVIVORS
from fedexlora.secagg.consistency import (
    DIGESTS,
    check_digests,
    check_threshold,
    seal,
    setup_digest,
)
from fedexlora.secagg.encoding import MOD_RANGE

__all__ = ["STAGES", "ClientSession", "SecAggError", "ServerSession"]

STAGES = ("setup", "share-keys", "collect", "unmask")


class SecAggError(RuntimeError):
    """The round cannot be completed securely (too few clients, or too few shares)."""


def _flwr():
    """Flower's SecAgg+ pieces, imported on first use (flwr is the ``flower`` extra)."""
    try:
        import importlib

        mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
        from flwr.common.secure_aggregation.crypto import shamir, symmetric_encryption
        from flwr.common.secure_aggregation.secaggplus_constants import Key
        from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
        from flwr.supercore.primitives import asymmetric
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "secure aggregation uses Flower's SecAgg+: pip install 'fedex-lora[flower]'"
        ) from exc
    return (
        mod,
        shamir,
        symmetric_encryption,
        Key,
        share_keys_plaintext_separate,
        asymmetric,
    )


@contextlib.contextmanager
def _quiet():
    """Keeps Flower's per-stage DEBUG lines ("Node 3: starting stage 1...") out of the log.

    Its warnings and errors still come through.
    """
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(max(level, logging.INFO))
    try:
        yield
    finally:
        logger.setLevel(level)


_MASK_CONTEXT = b"fedex-lora secagg mask v1"


def _mask(seed: bytes, size: int) -> np.ndarray:
    """A mask of ``size`` numbers uniform in ``[0, 2**32)``, from the whole ``seed``.

    ChaCha20's keystream (the ``cryptography`` package Flower already needs) under the
    key ``SHA-256(context || seed)``: every bit of the secret (a 32-byte private seed,
    or a pairwise key agreed by ECDH) changes the stream. Flower's own
    ``pseudo_rand_gen`` folds the seed to 32 bits and runs MT19937, which leaves an
    attacker at most 2**32 masks to try (the pairwise seeds measured here kept 28 bits;
    flwrlabs/flower#7522). Each key masks one vector only (fresh keys every round), so
    the fixed nonce is never reused with a key.
    """
    import hashlib

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = hashlib.sha256(_MASK_CONTEXT + bytes(seed)).digest()
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(4 * int(size))), dtype="<u4")
    return words.astype(np.int64)


class ServerSession:
    """The server's side of one round of SecAgg+ over the sampled clients.

    Args:
        clients: The sampled client ids (at least :data:`MIN_SURVIVORS`).
        size: Numbers in each client's integer vector.
        num_shares: Shares of each client's secrets (each client and its neighbours);
            a float is a fraction of the sampled clients (Flower's rule). ``None``: every
            client up to 11, else ``2 ceil(log2 k) + 1`` (SecAgg+'s logarithmic graph).
        threshold: Shares needed to rebuild a secret; a float is a fraction of
            ``num_shares``, raised to more than half of them (and at least 2): with
            half or fewer, a server that asks some clients for a client's mask-seed
            share and the others for its key share would rebuild both
            (:mod:`fedexlora.secagg.consistency`; the clients refuse such a setup).
        seed: Seeds the neighbour graph (Flower shuffles with Python's ``random``).

    Raises:
        SecAggError: With fewer than :data:`MIN_SURVIVORS` clients, or a threshold not
            more than half the shares.
    """

    def __init__(
        self,
        clients: list[int],
        size: int,
        *,
        num_shares: int | float | None = None,
        threshold: int | float = 0.5,
        seed: int = 0,
    ):
        if len(clients) < MIN_SURVIVORS:
            raise SecAggError(
                f"secure aggregation needs at least {MIN_SURVIVORS} clients in a round, got "
                f"{len(clients)}: one client's sum is its own upload, and of two each "
                "learns the other's"
            )
        k = len(clients)
        if num_shares is None:
            num_shares = k if k <= 11 else 2 * math.ceil(math.log2(k)) + 1
        if isinstance(num_shares, float):  # Flower's SecAggPlusWorkflow.setup_stage
            shares = round(num_shares * k)
            if shares < k and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = k
        else:
            shares = min(int(num_shares), k)
            if shares < k and shares % 2 == 0:  # Flower's rule: an odd number of shares
                shares += 1
        if isinstance(threshold, float):
            thr = min(max(math.ceil(threshold * shares), shares // 2 + 1, 2), shares)
        else:
            thr = int(threshold)
        if not 2 <= thr <= shares:
            raise SecAggError(f"threshold {thr} must be within 2..{shares} shares")
        if 2 * thr <= shares:
            raise SecAggError(
                f"threshold {thr} of {shares} shares is not more than half: a server could "
                "split the unmask requests and read a client's vector"
            )
        self.clients = sorted(clients)
        self.size = int(size)
        self.num_shares, self.threshold = shares, thr
        order = list(self.clients)
        random.Random(seed).shuffle(order)
        half = shares >> 1
        self.neighbours = {
            c: {order[(i + off) % k] for off in range(-half, half + 1)} for i, c in enumerate(order)
        }
        self.public_keys: dict[int, list[bytes]] = {}
        self.keyed: set[int] = set()  # sent their public keys (stage 0)
        self.shared: set[int] = set()  # sent their key shares (stage 1): masks with them
        self.survivors: set[int] = set()  # sent a masked vector (stage 2)
        self.malformed: dict[int, str] = {}  # sent one of the wrong size: left out
        self._forward: dict[int, tuple[list[int], list[bytes], list[bytes]]] = {}
        self._masked: np.ndarray | None = None

    # -- stage 0 ---------------------------------------------------------------------
    def setup(self, extra: Mapping | None = None) -> dict[int, dict]:
        """Stage 0's message to each client (Flower's setup keys, plus ``extra``)."""
        Key = _flwr()[3]
        conf = {
            Key.SAMPLE_NUMBER: len(self.clients),
            Key.SHARE_NUMBER: self.num_shares,
            Key.THRESHOLD: self.threshold,
            Key.CLIPPING_RANGE: 0.0,  # quantization is ours (fedexlora.secagg.encoding)
            Key.TARGET_RANGE: 0,
            Key.MOD_RANGE: MOD_RANGE,
            Key.MAX_WEIGHT: 1.0,
            **dict(extra or {}),
        }
        return {c: dict(conf) for c in self.clients}

    def take_keys(self, replies: Mapping[int, Mapping]) -> None:
        """Stage 0's replies: each client's two public keys."""
        Key = _flwr()[3]
        for c, rep in replies.items():
            if c in self.neighbours:
                self.public_keys[c] = [bytes(rep[Key.PUBLIC_KEY_1]), bytes(rep[Key.PUBLIC_KEY_2])]
        self.keyed = set(self.public_keys)
        self._check(self.keyed, "sent their public keys")

    # -- stage 1 ---------------------------------------------------------------------
    def share_keys(self) -> dict[int, dict]:
        """Stage 1's message to each keyed client: its keyed neighbours' public keys."""
        return {
            c: {str(n): self.public_keys[n] for n in sorted(self.neighbours[c] & self.keyed)}
            for c in sorted(self.keyed)
        }

    def take_shares(self, replies: Mapping[int, Mapping]) -> None:
        """Stage 1's replies: encrypted shares, to forward to their destinations."""
        Key = _flwr()[3]
        fwd: dict[int, tuple[list[int], list[bytes], list[bytes]]] = {}
        for c, rep in replies.items():
            if c not in self.keyed:
                continue
            self.shared.add(c)
            dsts, cts_c = rep[Key.DESTINATION_LIST], rep[Key.CIPHERTEXT_LIST]
            digests = rep.get(DIGESTS, [b""] * len(dsts))  # each sealed for its destination
            for dst, ct, dg in zip(dsts, cts_c, digests, strict=True):
                srcs, cts, dgs = fwd.setdefault(int(dst), ([], [], []))
                srcs.append(c)
                cts.append(bytes(ct))
                dgs.append(bytes(dg))
        self._forward = fwd
        self._check(self.shared, "shared their keys")

    # -- stage 2 ---------------------------------------------------------------------
    def collect(self) -> dict[int, dict]:
        """Stage 2's message to each client that shared keys: the shares addressed to it.

        With them, their senders' sealed setup hashes.
        """
        Key = _flwr()[3]
        out = {}
        for c in sorted(self.shared):
            srcs, cts, dgs = self._forward.get(c, ([], [], []))
            keep = [i for i, s in enumerate(srcs) if s in self.shared]
            out[c] = {
                Key.SOURCE_LIST: [srcs[i] for i in keep],
                Key.CIPHERTEXT_LIST: [cts[i] for i in keep],
                DIGESTS: [dgs[i] for i in keep],
            }
        return out

    def take_masked(self, replies: Mapping[int, bytes]) -> None:
        """Stage 2's replies: each survivor's masked vector (``uint32`` bytes).

        A vector of the wrong size is left out (:attr:`malformed`), and its client's
        masks are removed as a dropout's.

        Raises:
            SecAggError: If fewer clients than the threshold sent one.
        """
        total = np.zeros(self.size, dtype=np.int64)
        for c, data in replies.items():
            if c not in self.shared:
                continue
            data = bytes(data)
            if len(data) != 4 * self.size:  # left out, and unmasked as a dropout
                self.malformed[c] = f"sent {len(data)} bytes, expected {4 * self.size}"
                continue
            total += np.frombuffer(data, dtype=np.uint32)
            self.survivors.add(c)
        self._masked = total % MOD_RANGE
        self._check(self.survivors, "sent their masked vectors")

    # -- stage 3 ---------------------------------------------------------------------
    @property
    def dropped(self) -> set[int]:
        """Clients that shared keys but sent no masked vector."""
        return self.shared - self.survivors

    def unmask(self) -> dict[int, dict]:
        """Stage 3's message to each survivor: which neighbours survived and which not."""
        Key = _flwr()[3]
        return {
            c: {
                Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[c] & self.survivors),
                Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[c] & self.dropped),
            }
            for c in sorted(self.survivors)
        }

    def take_unmask(self, replies: Mapping[int, Mapping]) -> np.ndarray:
        """Stage 3's replies: rebuilds the secrets and returns the survivors' integer sum.

        Raises:
            SecAggError: If some secret has fewer shares than the threshold.
        """
        _, shamir, sym, Key, _, asym = _flwr()
        shares: dict[int, list[bytes]] = {c: [] for c in self.survivors | self.dropped}
        for c, rep in replies.items():
            if c not in self.survivors:
                continue
            for owner, share in zip(rep[Key.NODE_ID_LIST], rep[Key.SHARE_LIST], strict=True):
                if int(owner) in shares:
                    shares[int(owner)].append(bytes(share))
        if self._masked is None:
            raise SecAggError("no masked vectors were collected")
        total = self._masked.copy()
        for c, got in sorted(shares.items()):
            if len(got) < self.threshold:
                raise SecAggError(
                    f"only {len(got)} of the {self.threshold} shares needed to unmask client "
                    f"{c} arrived"
                )
            secret = shamir.combine_shares(got)
            if c in self.survivors:  # its private mask
                total -= _mask(secret, self.size)
                continue
            # a client that dropped: the survivors' pairwise masks with it
            private = asym.bytes_to_private_key(secret)
            for n in sorted(self.neighbours[c] & self.survivors):
                key = sym.generate_shared_key(
                    private, asym.bytes_to_public_key(self.public_keys[n][0])
                )
                pair = _mask(key, self.size)
                total = total + pair if c > n else total - pair
            total %= MOD_RANGE
        return total % MOD_RANGE

    def _check(self, alive: set[int], what: str) -> None:
        """Flower's rule: every client keeps at least ``threshold`` live neighbours."""
        short = [c for c in sorted(alive) if len(self.neighbours[c] & alive) < self.threshold]
        if len(alive) < MIN_SURVIVORS:
            raise SecAggError(
                f"only {len(alive)} of {len(self.clients)} clients {what}; a round needs "
                f"{MIN_SURVIVORS} (of two, each would learn the other's upload from the sum): "
                "the model is left unchanged this round"
            )
        if short:
            raise SecAggError(
                f"only {len(alive)} of {len(self.clients)} clients {what}; SecAgg+ needs "
                f"{self.threshold} live neighbours per client (clients {short})"
            )


class ClientSession:
    """One client's side of SecAgg+ for one round (Flower's mod functions and state).

    ``to_dict()`` / ``from_dict()`` keep it in a Flower node's ``Context.state`` between
    the stages' messages.

    Against a server that lies (:mod:`fedexlora.secagg.consistency`), it refuses a setup
    whose threshold is not more than half the shares, and sends its masked vector only if
    every neighbour whose shares it holds was sent the same setup (and, where each client
    shares with every other, the same neighbours and keys).
    """

    def __init__(self, client: int, state=None, digest: bytes = b""):
        mod = _flwr()[0]
        self.client = int(client)
        self.state = state if state is not None else mod.SecAggPlusState()
        self.state.nid = self.client
        self.digest = bytes(digest)  # the round's setup hash (stage 0, then stage 1)

    def to_dict(self) -> dict:
        """The state as ConfigRecord values."""
        return {"client": self.client, "fedex-digest": self.digest, **self.state.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> ClientSession:
        """Inverse of :meth:`to_dict`."""
        mod = _flwr()[0]
        d = dict(d)
        client = int(d.pop("client"))
        digest = bytes(d.pop("fedex-digest", b""))
        return cls(client, mod.SecAggPlusState(**d), digest)

    def _advance(self, want: str, to: str) -> None:
        """Flower's mod's stage check: each stage follows the one before, once."""
        if self.state.current_stage != want:
            raise ValueError(
                f"client {self.client}: secure aggregation stage {to!r} after "
                f"{self.state.current_stage!r}, expected after {want!r}"
            )
        self.state.current_stage = to

    def setup(self, msg: Mapping) -> dict:
        """Stage 0: two fresh key pairs (Flower's ``_setup``); returns the public keys.

        Raises:
            ValueError: If the threshold is not more than half the shares.
        """
        mod, Key = _flwr()[0], _flwr()[3]
        check_threshold(
            self.client,
            int(msg[Key.THRESHOLD]),
            int(msg[Key.SHARE_NUMBER]),
            int(msg[Key.SAMPLE_NUMBER]),
        )
        self.digest = setup_digest(msg)
        self.state.current_stage = "setup"
        with _quiet():
            return mod._setup(self.state, dict(msg))

    def share_keys(self, msg: Mapping) -> dict:
        """Stage 1: Shamir shares of the mask seed and key (Flower's ``_share_keys``)."""
        mod, Key = _flwr()[0], _flwr()[3]
        self._advance("setup", "share-keys")
        keys = {str(k): [bytes(b) for b in v] for k, v in msg.items()}
        st = self.state
        if len(keys) > st.share_num:
            raise ValueError(
                f"client {self.client}: {len(keys)} neighbours for {st.share_num} shares"
            )
        if st.share_num == st.sample_num:  # each with every other: one neighbour set
            self.digest = setup_digest({"setup": self.digest}, {int(k): v for k, v in keys.items()})
        with _quiet():
            reply = mod._share_keys(st, keys)
        reply[DIGESTS] = [
            seal(st.ss2_dict[int(d)], self.digest, self.client, int(d))
            for d in reply[Key.DESTINATION_LIST]
        ]
        return reply

    def masked(self, msg: Mapping, ints: np.ndarray) -> bytes:
        """Stage 2: ``ints`` under the private and pairwise masks, as ``uint32`` bytes.

        Flower's ``_collect_masked_vectors`` after its quantization (ours is
        :class:`fedexlora.secagg.encoding.Quantization`): decrypt and keep the shares,
        add the private mask and the pairwise masks, reduce modulo ``2**32``.

        Raises:
            ValueError: If a neighbour whose public keys it was sent forwarded no key
                shares, or one was sent another setup (:mod:`fedexlora.secagg.consistency`):
                it sends nothing.
        """
        _, _, sym, Key, separate, asym = _flwr()
        self._advance("share-keys", "collect")
        st = self.state
        srcs = [int(s) for s in msg[Key.SOURCE_LIST]]
        cts = [bytes(c) for c in msg[Key.CIPHERTEXT_LIST]]
        if len(cts) + 1 < st.threshold:
            raise ValueError("Not enough available neighbour clients.")
        missing = sorted(set(st.public_keys_dict) - {st.nid} - set(srcs))
        if missing:  # masked with fewer, its pairwise keys could be rebuilt as dropouts'
            raise ValueError(
                f"client {st.nid}: no key shares came from neighbours {missing}, whose public "
                "keys it was sent; refusing to send its vector (masked with fewer "
                "neighbours, a server that then calls those neighbours dropped could "
                "remove its masks)"
            )
        check_digests(st.nid, self.digest, st.ss2_dict, srcs, list(msg.get(DIGESTS, [])))
        for src, ct in zip(srcs, cts, strict=True):
            plain = sym.decrypt(st.ss2_dict[src], ct)
            actual, dst, seed_share, sk1_share = separate(plain)
            if actual != src or dst != st.nid:
                raise ValueError(f"client {st.nid}: a share from {actual} for {dst} came as {src}")
            st.rd_seed_share_dict[src] = seed_share
            st.sk1_share_dict[src] = sk1_share
        vec = np.asarray(ints, dtype=np.int64).reshape(-1) + _mask(st.rd_seed, np.size(ints))
        own = asym.bytes_to_private_key(st.sk1)
        for n in srcs:
            key = sym.generate_shared_key(own, asym.bytes_to_public_key(st.public_keys_dict[n][0]))
            pair = _mask(key, vec.size)
            vec = vec + pair if st.nid > n else vec - pair
        return (vec % MOD_RANGE).astype(np.uint32).tobytes()

    def unmask(self, msg: Mapping) -> dict:
        """Stage 3: the shares the server asks for (Flower's ``_unmask``)."""
        mod, Key = _flwr()[0], _flwr()[3]
        self._advance("collect", "unmask")
        active, dead = set(msg[Key.ACTIVE_NODE_ID_LIST]), set(msg[Key.DEAD_NODE_ID_LIST])
        if active & dead:  # both shares of one client would reveal its upload
            raise ValueError(f"client {self.client}: clients {sorted(active & dead)} both "
                             "active and dropped")  # fmt: skip
        with _quiet():
            return mod._unmask(self.state, dict(msg))


def run_round(
    server: ServerSession,
    exchange: Callable[[str, dict[int, dict]], dict[int, Mapping]],
    collect: Callable[[dict[int, dict]], dict[int, bytes]],
) -> np.ndarray:
    """Drives the four stages of one round; returns the survivors' integer sum.

    ``exchange(stage, messages) -> replies`` carries stages 0, 1 and 3, and
    ``collect(messages) -> masked vectors`` stage 2.
    """
    server.take_keys(exchange("setup", server.setup()))
    server.take_shares(exchange("share-keys", server.share_keys()))
    server.take_masked(collect(server.collect()))
    return server.take_unmask(exchange("unmask", server.unmask()))
