"""Secure aggregation against an active server (#55 item 3): a server that splits its
unmask requests, or sends one client a different setup, reads no client's vector.

Each attack runs through the project's own protocol code (ServerSession's messages,
ClientSession's replies); only the server's side is dishonest.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

pytestmark = pytest.mark.slow(seconds=15)

from fedexlora.core.messages import ClientUpload  # noqa: E402
from fedexlora.core.secure import client_vector  # noqa: E402
from fedexlora.core.state import AdapterState  # noqa: E402
from fedexlora.secagg.protocol import ClientSession, SecAggError, ServerSession, _mask  # noqa: E402


def _flower():
    from flwr.common.secure_aggregation.crypto import shamir, symmetric_encryption
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.supercore.primitives import asymmetric

    return shamir, symmetric_encryption, Key, asymmetric


def split_unmask(k, threshold, victim=0, size=64, seed=0):
    """One round whose server sends ``threshold`` in stage 0 and then, in stage 3, asks
    ``threshold`` holders for the victim's mask-seed share and others for its key share.

    Returns ``(recovered, vectors)``: the victim's vector as the server rebuilds it
    (``None`` if the shares it got cannot rebuild both secrets), and every client's.
    """
    shamir, sym, Key, asym = _flower()
    rng = np.random.default_rng(seed)
    vectors = [rng.integers(0, 2**20, size=size) for _ in range(k)]
    server = ServerSession(list(range(k)), size, seed=3)
    server.threshold = threshold  # what the dishonest server sends
    clients = {c: ClientSession(c) for c in range(k)}
    server.take_keys({c: clients[c].setup(m) for c, m in server.setup().items()})
    server.take_shares({c: clients[c].share_keys(m) for c, m in server.share_keys().items()})
    masked = {c: clients[c].masked(m, vectors[c]) for c, m in server.collect().items()}
    server.take_masked(masked)
    holders = sorted(server.neighbours[victim])
    seed_from = holders[:threshold]  # the rest are asked for its key share: disjoint
    seed_shares, key_shares = [], []
    for c in holders:
        others = sorted(server.neighbours[c] - {victim})
        if c in seed_from:
            msg = {Key.ACTIVE_NODE_ID_LIST: [victim, *others], Key.DEAD_NODE_ID_LIST: []}
        else:
            msg = {Key.ACTIVE_NODE_ID_LIST: others, Key.DEAD_NODE_ID_LIST: [victim]}
        rep = clients[c].unmask(msg)
        for owner, share in zip(rep[Key.NODE_ID_LIST], rep[Key.SHARE_LIST], strict=True):
            if owner == victim:
                (seed_shares if c in seed_from else key_shares).append(bytes(share))
    try:
        seed_v = shamir.combine_shares(seed_shares)
        private = asym.bytes_to_private_key(shamir.combine_shares(key_shares))
    except Exception:  # too few shares: no secret (or a wrong one, caught below)
        return None, vectors
    vec = np.frombuffer(masked[victim], dtype=np.uint32).astype(np.int64) - _mask(seed_v, size)
    for n in sorted(server.neighbours[victim] - {victim}):
        pair = _mask(
            sym.generate_shared_key(private, asym.bytes_to_public_key(server.public_keys[n][0])),
            size,
        )
        vec = vec - pair if victim > n else vec + pair
    return vec % 2**32, vectors


def _mains_threshold(shares):
    """The threshold main (817027c) gave: ``round(0.5 * shares)`` (banker's), at least 2."""
    return max(round(0.5 * shares), 2)


@pytest.mark.parametrize("k", [4, 5, 9])
def test_a_split_unmask_request_reads_no_clients_vector(k):
    shares = ServerSession(list(range(k)), 1).num_shares
    # the threshold main gave: the clients now refuse it before sending a key
    with pytest.raises(ValueError, match="is not more than half"):
        split_unmask(k, _mains_threshold(shares))
    # the threshold the server now sends: no two disjoint sets of holders can rebuild both
    honest = ServerSession(list(range(k)), 1).threshold
    assert 2 * honest > shares
    recovered, vectors = split_unmask(k, honest)
    assert recovered is None or not np.array_equal(recovered, vectors[0])


def test_the_threshold_is_more_than_half_the_shares_for_every_round_size():
    for k in range(3, 65):
        s = ServerSession(list(range(k)), 1)
        assert 2 * s.threshold > s.num_shares, (k, s.threshold, s.num_shares)
    with pytest.raises(SecAggError, match="not more than half"):
        ServerSession(list(range(4)), 1, threshold=2)
    assert ServerSession(list(range(4)), 1, threshold=1.0).threshold == 4


def _uploads(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    template = AdapterState(
        factors={"l0": (torch.randn(4, 20, generator=g) * 0.1, torch.randn(24, 4, generator=g))},
        extra={"head": torch.zeros(3)},
    )
    ups = []
    for c in range(k):
        flat = {key: t + 0.05 * torch.randn(t.shape, generator=g)
                for key, t in template.to_flat().items()}  # fmt: skip
        ups.append(ClientUpload(c, AdapterState.from_flat(flat), 100 + 10 * c, 0.5))
    return template, ups


def _clip_attack(k, victim):
    """A round whose server sends every client but ``victim`` ``fedex.clip = 2**40``,
    after stages 0 and 1: ``(round, setups, sessions, exchange, uploads)``."""
    from fedexlora.secagg.rounds import SecureRound, client_session_reply

    template, ups = _uploads(k)
    rnd = SecureRound(template, "fedit", list(range(k)), seed=1)
    setups = rnd.setup()
    for c in range(k):
        if c != victim:
            setups[c]["fedex.clip"] = 2.0**40
    sessions = {c: ClientSession(c) for c in range(k)}

    def exchange(stage, msgs):
        msgs = setups if stage == "setup" else msgs
        return {c: client_session_reply(sessions[c], stage, m) for c, m in msgs.items()}

    rnd.keys(exchange)
    return rnd, setups, sessions, exchange, ups


def read_victim_with_a_different_clip(k=3, victim=0):
    """The server's reading of the victim's vector under that attack, and the vector.

    The others' limbs are the midpoint ``T / 2`` (their values are nothing against
    ``2**40``), so the sum less ``(k - 1) T / 2`` is the victim's limbs.
    """
    rnd, setups, sessions, exchange, ups = _clip_attack(k, victim)
    from fedexlora.secagg.rounds import client_reply

    collect = rnd.session.collect()
    masked = {c: client_reply(sessions[c], setups[c], collect[c], ups[c], seed=0, rnd=1)
              for c in range(k)}  # fmt: skip
    rnd.session.take_masked(masked)
    total = rnd.session.take_unmask(exchange("unmask", rnd.session.unmask()))
    mine = total[:-1] - (k - 1) * (rnd.quant.target_range // 2)
    weight = ups[victim].num_examples / 2**20
    truth = client_vector(rnd.layout, ups[victim].state, weight, ups[victim].train_loss)
    return rnd.quant.decode(mine, 1), truth.numpy()


def test_a_server_that_sends_one_client_a_different_setup_is_refused():
    """Each client hashes its setup and checks its neighbours' (sealed under their
    pairwise keys): with one setup different, no client sends its vector."""
    from fedexlora.secagg.rounds import SecureRound, client_reply, client_session_reply

    with pytest.raises(ValueError, match="different secure aggregation setup"):
        read_victim_with_a_different_clip()
    k, victim = 3, 0
    rnd, setups, sessions, _, ups = _clip_attack(k, victim)
    collect = rnd.session.collect()
    for c in range(k):  # every client sees a neighbour with another setup: none sends
        with pytest.raises(ValueError, match="different secure aggregation setup"):
            client_reply(sessions[c], setups[c], collect[c], ups[c], seed=0, rnd=1)
    # a server that drops the hashes is refused too
    template, _ = _uploads(k)
    fresh = {c: ClientSession(c) for c in range(k)}
    honest = SecureRound(template, "fedit", list(range(k)), seed=1)
    honest.keys(lambda stage, msgs: {c: client_session_reply(fresh[c], stage, m)
                                     for c, m in msgs.items()})  # fmt: skip
    msg = dict(honest.session.collect()[victim])
    msg.pop("fedex.digests")
    with pytest.raises(ValueError, match="setup hashes came with the shares"):
        client_reply(fresh[victim], honest.setup()[victim], msg, ups[victim], seed=0, rnd=1)


def withhold_and_call_dropped(k=5, victim=0, size=64, seed=0):
    """A server that forwards the victim the shares of only ``t - 1`` neighbours (the
    fewest a client accepted), so that it masks with those alone, then tells the other
    clients those neighbours dropped (rebuilding their keys) while asking for the
    victim's seed share. Returns ``(recovered, vectors)`` as :func:`split_unmask`."""
    shamir, sym, Key, asym = _flower()
    rng = np.random.default_rng(seed)
    vectors = [rng.integers(0, 2**20, size=size) for _ in range(k)]
    server = ServerSession(list(range(k)), size, seed=3)
    t = server.threshold
    clients = {c: ClientSession(c) for c in range(k)}
    server.take_keys({c: clients[c].setup(m) for c, m in server.setup().items()})
    server.take_shares({c: clients[c].share_keys(m) for c, m in server.share_keys().items()})
    collect = server.collect()
    withheld = sorted(server.neighbours[victim] - {victim})[t - 1 :]
    masked_with = sorted(server.neighbours[victim] - {victim})[: t - 1]
    keep = [i for i, s in enumerate(collect[victim][Key.SOURCE_LIST]) if s not in withheld]
    collect[victim] = {key: [v[i] for i in keep] for key, v in collect[victim].items()}
    masked = {c: clients[c].masked(m, vectors[c]) for c, m in collect.items()}
    shares = {}
    for c in sorted(server.neighbours[victim] - {victim}):  # victim alive, masked_with dropped
        active = sorted(server.neighbours[c] - set(masked_with))
        rep = clients[c].unmask(
            {Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: masked_with}
        )
        for owner, share in zip(rep[Key.NODE_ID_LIST], rep[Key.SHARE_LIST], strict=True):
            shares.setdefault(owner, []).append(bytes(share))
    seed_v = shamir.combine_shares(shares[victim])
    vec = np.frombuffer(masked[victim], dtype=np.uint32).astype(np.int64) - _mask(seed_v, size)
    for n in masked_with:
        private = asym.bytes_to_private_key(shamir.combine_shares(shares[n]))
        key = sym.generate_shared_key(
            private, asym.bytes_to_public_key(server.public_keys[victim][0])
        )
        pair = _mask(key, size)
        vec = vec - pair if victim > n else vec + pair
    return vec % 2**32, vectors


def test_a_client_masked_with_fewer_neighbours_than_it_was_sent_keys_for_refuses():
    """The victim refuses to send a vector masked with only some neighbours: the server
    could otherwise call those neighbours dropped and rebuild their keys."""
    with pytest.raises(ValueError, match=r"no key shares came from neighbours \[3, 4\]"):
        withhold_and_call_dropped()


def test_a_client_lost_between_its_keys_and_its_shares_fails_the_round():
    """The price of the check above: such a client is no longer left out, every
    neighbour refuses, and the round fails (docs/PRIVACY.md, "Dropouts")."""
    k, size = 4, 8
    server = ServerSession(list(range(k)), size, seed=3)
    clients = {c: ClientSession(c) for c in range(k)}
    server.take_keys({c: clients[c].setup(m) for c, m in server.setup().items()})
    share = server.share_keys()
    server.take_shares({c: clients[c].share_keys(m) for c, m in share.items() if c != 3})
    for c, msg in server.collect().items():
        with pytest.raises(ValueError, match=r"no key shares came from neighbours \[3\]"):
            clients[c].masked(msg, np.zeros(size, dtype=np.int64))
    with pytest.raises(SecAggError, match="sent their masked vectors"):
        server.take_masked({})
