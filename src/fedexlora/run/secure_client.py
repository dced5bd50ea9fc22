"""The client side of a secure round (SecAgg+), one for both engines.

:class:`SecureClient` is what one client does in SecAgg+'s stages: it answers the key
setup, the key sharing and the unmasking (:func:`fedexlora.secagg.rounds.client_session_reply`),
keeps the round's setup, and sends its upload as a masked vector
(:func:`fedexlora.secagg.rounds.client_reply`) whose stochastic rounding is seeded by
:func:`rounding_seed`. The in-process engine holds one per sampled client in memory
(:class:`fedexlora.run.secure_round.SecureRun`); the Flower ClientApp keeps it in its
``Context`` between the stages' messages (:meth:`SecureClient.to_dict`,
:meth:`SecureClient.from_dict`). :func:`clipped_warning` is the one warning both
engines' servers give when the sums clipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SecureClient", "clipped_warning", "rounding_seed"]

_SETUP = "setup."  # to_dict's prefix of the round's setup (the stage-0 fields it keeps)


def rounding_seed(cfg) -> int | None:
    """The seed of a client's stochastic rounding: the run's, or ``None`` (OS entropy).

    Under DP-SGD (unless ``dp_reproducible``) the rounding is drawn from OS entropy, so
    that no one who knows the run's seed can replay it.
    """
    return None if cfg.dp and not cfg.dp_reproducible else cfg.seed


def clipped_warning(method: str, rnd: int, clipped: int, clip: float) -> str:
    """The warning of a secure round whose sums clipped ``clipped`` numbers."""
    return (
        f"{method} round {rnd}: secure aggregation clipped {clipped} numbers beyond "
        f"±{clip:g}: the model is not exact this round"
    )


class SecureClient:
    """One client's side of SecAgg+ in one round: its session and the round's setup.

    Args:
        client: The client's id (its partition).
        session: Its :class:`fedexlora.secagg.protocol.ClientSession` (a new one at
            ``setup``).
        setup: The stage-0 fields it keeps (the layout's and quantization's keys).
    """

    def __init__(self, client: int, session=None, setup: Mapping | None = None):
        self.client = client
        self.session = session
        self.setup = dict(setup or {})

    def answer(self, stage: str, fields: Mapping) -> dict:
        """Its reply to stage ``setup``, ``share-keys`` or ``unmask``.

        Raises:
            ValueError: If the stage is unknown, or comes before the round's key setup.
        """
        from fedexlora.secagg.protocol import ClientSession
        from fedexlora.secagg.rounds import client_session_reply

        if stage == "setup":  # a new round: a new session, and the setup's own keys
            self.session = ClientSession(self.client)
            self.setup = {k: v for k, v in fields.items() if "." in k}
        elif self.session is None:
            raise ValueError(f"secure aggregation stage {stage!r} before the round's key setup")
        return client_session_reply(self.session, stage, fields)

    def masked(
        self,
        fields: Mapping,
        upload,
        *,
        seed: int | None,
        rnd: int,
        reply: Callable[..., bytes | None] | None = None,
    ) -> bytes | None:
        """Stage 2: ``upload`` as its masked vector (``None``: it drops out).

        Args:
            fields: The stage-2 message (the shares forwarded to it).
            upload: What it would have uploaded in the clear.
            seed: :func:`rounding_seed` of the run.
            rnd: The round.
            reply: Called as :func:`fedexlora.secagg.rounds.client_reply` (its default)
                is; a test may wrap it to play a client that drops out (``None``).

        Raises:
            ValueError: If it refuses to send what it must not (its count out of range,
                an upload that is not finite), or comes before the key setup.
        """
        if self.session is None:
            raise ValueError("secure aggregation stage 'collect' before the round's key setup")
        if reply is None:
            from fedexlora.secagg.rounds import client_reply as reply
        return reply(self.session, self.setup, fields, upload, seed=seed, rnd=rnd)

    def to_dict(self) -> dict[str, Any]:
        """Its state as flat values (a Flower ``ConfigRecord``)."""
        return {**self.session.to_dict(), **{f"{_SETUP}{k}": v for k, v in self.setup.items()}}

    @classmethod
    def from_dict(cls, client: int, d: Mapping) -> SecureClient:
        """Back from :meth:`to_dict`."""
        from fedexlora.secagg.protocol import ClientSession

        state = dict(d)
        setup = {k[len(_SETUP) :]: state.pop(k) for k in list(state) if k.startswith(_SETUP)}
        return cls(client, ClientSession.from_dict(state), setup)
