"""One securely aggregated round, as both engines run it.

The server side (:class:`SecureRound`) builds the round's vector layout and quantization
from the server's upload template, runs SecAgg+ (:mod:`fedexlora.secagg.protocol`) over
whatever transport the engine gives it, and hands the server the means read from the
survivors' sum (:meth:`fedexlora.server.Server.aggregate_secure`). The client side
(:func:`client_reply`) turns one client's upload into its masked vector. What travels:

- stage 0 (``setup``) also carries ``fedex.clip``, ``fedex.target``, ``fedex.limbs``,
  ``fedex.products`` and, for FedEx's sketches, ``fedex.sketch.clients`` (0 for none),
  ``fedex.sketch.seed``, ``fedex.sketch.over`` and ``fedex.sketch.extra``, from which a
  client builds the same layout (:class:`~fedexlora.core.sketch.SketchPlan`) and
  quantization;
- stage 2 (``collect``) carries, besides the forwarded shares, the client's payload (the
  engine adds it); the reply is the masked vector, ``uint32`` bytes, and nothing else.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedexlora.core.messages import ClientUpload, example_count
from fedexlora.core.methods import get_method
from fedexlora.core.secure import SecureLayout, SecureSums, client_vector, read_sums
from fedexlora.core.sketch import EXTRA, OVER, SketchPlan
from fedexlora.core.state import AdapterState
from fedexlora.secagg.encoding import Quantization
from fedexlora.secagg.protocol import ClientSession, SecAggError, ServerSession

__all__ = [
    "MAX_EXAMPLES",
    "SecAggError",
    "SecureRound",
    "client_reply",
    "client_session_reply",
    "upload_bytes",
]

MAX_EXAMPLES = 2**20
"""The public bound on a client's example count: its weight is ``n_i / MAX_EXAMPLES``."""

BITS = 52
"""Bits of each number's quantization over ``[-clip, clip]`` (fp64's mantissa)."""

WEIGHT_BITS = int(math.log2(MAX_EXAMPLES))
"""The bits a weight ``n_i / MAX_EXAMPLES`` can take off a number (#55).

Each client's vector is ``w_i x_i`` quantized at a fixed resolution, and the means are
the sums over ``Σ w_i``: the error of a mean is the error per number times
``MAX_EXAMPLES / Σ n_i``, up to ``2**20`` times the uniform weighting's (every client of
one example). Under ``weighting = "examples"`` the quantization carries these 20 bits
more (three limbs instead of two), so that the mean is as precise as under uniform
weighting whatever the counts below the public bound: 20 clients of 8 examples were
2.6e-5 of the update from it with two limbs.
"""


def upload_bytes(layout: SecureLayout, quant: Quantization) -> int:
    """Bytes of one client's masked vector (``uint32`` limbs, plus the clip count)."""
    return 4 * (layout.size * quant.limbs + 1)


@dataclass
class SecureRound:
    """The server's side of one secure round.

    Args:
        template: The round's upload template (:meth:`Server.upload_template`).
        method: The method (its spec says whether products travel).
        clients: The clients sampled and sent a payload.
        seed: Seeds the SecAgg+ neighbour graph.
        clip: The clipping range of the quantization.
        uniform: Every client weighs the same (``weighting = "uniform"``); otherwise
            by its examples, and the quantization has :data:`WEIGHT_BITS` more bits.
        sketch: FedEx's products travel as sketches where smaller
            (:mod:`fedexlora.core.sketch`, public test matrices drawn from ``seed``);
            ``False``: every product dense.
        over: The range sketch's oversampling, ``s = (k - 1) r + over``.
        extra: The co-range sketch's excess, ``s2 = s + extra``.

    Attributes:
        seconds: The server's own seconds in this round's protocol so far (building the
            layout, routing keys and shares, unmasking, decoding the sums), the time an
            ``exchange`` spends waiting for the clients' replies left out. An engine
            hands it to :meth:`fedexlora.server.Server.aggregate_secure`
            (``protocol_seconds``), so that the round's ``server_seconds`` holds it.
    """

    template: AdapterState
    method: str
    clients: list[int]
    seed: int = 0
    clip: float = 256.0
    uniform: bool = False
    sketch: bool = True
    over: int = OVER
    extra: int = EXTRA
    layout: SecureLayout = field(init=False)
    quant: Quantization = field(init=False)
    session: ServerSession = field(init=False)
    seconds: float = field(init=False, default=0.0)
    _depth: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        with self._working():
            products = get_method(self.method).secure_products
            plan = None
            if products and self.sketch:
                k = max(len(self.clients), 1)
                plan = SketchPlan(k, self.seed, over=self.over, extra=self.extra)
            self.layout = SecureLayout.for_template(self.template, products=products, sketch=plan)
            bits = BITS if self.uniform else BITS + WEIGHT_BITS  # from the public bounds
            self.quant = Quantization.for_clients(
                max(len(self.clients), 1), clip=self.clip, bits=bits
            )
            self.session = ServerSession(
                list(self.clients), self.layout.size * self.quant.limbs + 1, seed=self.seed
            )

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """Counts the block's seconds in :attr:`seconds` (once, however deeply nested)."""
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - t0

    def _waiting(
        self, exchange: Callable[[str, dict[int, dict]], Mapping[int, Mapping]]
    ) -> Callable[[str, dict[int, dict]], Mapping[int, Mapping]]:
        """``exchange``, its seconds (the clients' and the transport's) not counted."""

        def ask(stage: str, messages: dict[int, dict]) -> Mapping[int, Mapping]:
            t0 = time.perf_counter()
            try:
                return exchange(stage, messages)
            finally:
                self.seconds -= time.perf_counter() - t0

        return ask

    @property
    def upload_bytes(self) -> int:
        """Bytes of one client's masked vector."""
        return upload_bytes(self.layout, self.quant)

    def setup(self) -> dict[int, dict]:
        """Stage 0's messages, with the layout and quantization the clients need."""
        with self._working():
            return self.session.setup(
                {
                    "fedex.clip": self.quant.clip,
                    "fedex.target": self.quant.target_range,
                    "fedex.limbs": self.quant.limbs,
                    "fedex.products": int(self.layout.products),
                    "fedex.uniform": int(self.uniform),
                    **_plan_fields(self.layout.plan),
                }
            )

    def keys(self, exchange: Callable[[str, dict[int, dict]], Mapping[int, Mapping]]) -> None:
        """Stages 0 and 1 over ``exchange(stage, messages) -> replies``."""
        ask = self._waiting(exchange)
        with self._working():
            self.session.take_keys(ask("setup", self.setup()))
            self.session.take_shares(ask("share-keys", self.session.share_keys()))

    def collect(self) -> dict[int, dict]:
        """Stage 2's message for each client (sent with its payload), timed as server work."""
        with self._working():
            return self.session.collect()

    def finish(
        self,
        masked: Mapping[int, bytes],
        exchange: Callable[[str, dict[int, dict]], Mapping[int, Mapping]],
    ) -> SecureSums:
        """Stage 2's replies, then stage 3: the means of the survivors' uploads."""
        ask = self._waiting(exchange)
        with self._working():
            self.session.take_masked(masked)
            total = self.session.take_unmask(ask("unmask", self.session.unmask()))
            count = len(self.session.survivors)
            values = self.quant.decode(total[:-1], count)
            sums = read_sums(
                self.layout, torch.from_numpy(values), self.template, clipped=int(total[-1])
            )
            sums.examples = None if self.uniform else round(sums.weight * MAX_EXAMPLES)
            return sums

    def dropped_reasons(self) -> dict[int, str]:
        """Why each sampled client is not in the sum."""
        s = self.session
        out = {}
        for c in self.clients:
            if c in s.survivors:
                continue
            if c in s.malformed:
                out[c] = f"its masked vector was malformed ({s.malformed[c]}); left out"
            elif c not in s.keyed:
                out[c] = "dropped out before sending its public keys"
            elif c not in s.shared:
                out[c] = "dropped out before sharing its keys"
            else:
                out[c] = "dropped out after sharing its keys (its masks were removed)"
        return out


def _plan_fields(plan: SketchPlan | None) -> dict[str, int]:
    """The setup message's fields of a sketch plan (``fedex.sketch.clients`` 0: none)."""
    if plan is None:
        return {"fedex.sketch.clients": 0}
    return {
        "fedex.sketch.clients": plan.clients,
        "fedex.sketch.seed": plan.seed,
        "fedex.sketch.over": plan.over,
        "fedex.sketch.extra": plan.extra,
    }


def _plan_of(setup: Mapping) -> SketchPlan | None:
    """The sketch plan a setup message names, or ``None``."""
    clients = int(setup.get("fedex.sketch.clients", 0))
    if clients == 0:
        return None
    return SketchPlan(
        clients,
        int(setup["fedex.sketch.seed"]),
        over=int(setup["fedex.sketch.over"]),
        extra=int(setup["fedex.sketch.extra"]),
    )


def rounding_generator(seed: int, rnd: int, client: int) -> np.random.Generator:
    """The generator of one client's stochastic rounding in one round.

    Drawn from the run's seed, the round and the client (never numpy's global state), so
    that two runs with one seed send the same integers, and no two clients or rounds
    share their rounding.
    """
    return np.random.default_rng([seed % 2**63, rnd, client, 0x5EC])


def client_session_reply(session: ClientSession, stage: str, msg: Mapping) -> dict:
    """A client's reply to stage ``setup``, ``share-keys`` or ``unmask``."""
    if stage == "setup":
        return session.setup(msg)
    if stage == "share-keys":
        return session.share_keys(msg)
    if stage == "unmask":
        return session.unmask(msg)
    raise ValueError(f"unknown secure aggregation stage {stage!r}")


def client_reply(
    session: ClientSession,
    setup: Mapping,
    msg: Mapping,
    upload: ClientUpload,
    *,
    seed: int | None,
    rnd: int,
) -> bytes:
    """One client's stage-2 reply: its upload as a masked vector.

    Args:
        session: The client's SecAgg+ session (after stages 0 and 1).
        setup: The stage-0 message it got (the layout's and quantization's keys).
        msg: The stage-2 message (the shares forwarded to it).
        upload: What it would have uploaded in the clear.
        seed: The run's seed; with ``rnd`` and the client it seeds the stochastic
            rounding (:func:`rounding_generator`), so that a run repeats exactly.
            ``None`` (under DP, unless ``dp_reproducible``): the rounding is drawn from
            OS entropy (:class:`fedexlora.core.entropy.SecureRandom`), so that no one
            who knows the seed can replay it.
        rnd: The round.

    Raises:
        ValueError: If its example count exceeds :data:`MAX_EXAMPLES` or is invalid, or
            its upload is not finite (it then drops out of the round). The message, which
            the server sees, names none of the client's figures.
    """
    # what reaches the server names no figure of the client's (its count, its values)
    n, _ = example_count(upload.num_examples)
    if n is None:
        raise ValueError(f"client {upload.client_id}: its example count is not a positive integer")
    if n > MAX_EXAMPLES:
        raise ValueError(
            f"client {upload.client_id}: its example count exceeds the {MAX_EXAMPLES} that "
            "secure aggregation's weights allow"
        )
    products = bool(int(setup["fedex.products"]))
    layout = SecureLayout.for_template(upload.state, products=products, sketch=_plan_of(setup))
    quant = Quantization(
        float(setup["fedex.clip"]), int(setup["fedex.target"]), int(setup["fedex.limbs"]), 0
    )
    weight = 1.0 if int(setup.get("fedex.uniform", 0)) else n / MAX_EXAMPLES
    vec = client_vector(layout, upload.state, weight, upload.train_loss)
    if not torch.isfinite(vec).all():  # the clear path's validation, done by the client
        raise ValueError(f"client {upload.client_id}: its upload contains NaN or Inf")
    if seed is None:
        from fedexlora.core.entropy import SecureRandom

        rng = SecureRandom()
    else:
        rng = rounding_generator(seed, rnd, upload.client_id)
    ints, clipped = quant.encode(vec.numpy(), rng)
    return session.masked(msg, np.concatenate([ints, np.array([clipped], dtype=np.int64)]))
