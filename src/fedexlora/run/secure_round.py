"""One secure round in-process: the server's SecAgg+ side and each sampled client's.

The in-process engine (:mod:`fedexlora.run.inprocess`) runs every client in this process;
under secure aggregation it plays SecAgg+'s stages between them and the server through
:class:`SecureRun`, and the server sees only what Flower's would
(:mod:`fedexlora.secagg.rounds`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from fedexlora.run.secure_client import SecureClient, clipped_warning
from fedexlora.server.server import Server

__all__ = ["SecureRun"]


class SecureRun:
    """One secure round in-process: the server's SecAgg+ side and each client's.

    The server's side sees only what Flower's would: the clients' replies to each
    stage, and their masked vectors (:mod:`fedexlora.secagg.rounds`). Each client's side
    is a :class:`fedexlora.run.secure_client.SecureClient`, as under Flower.
    """

    def __init__(
        self,
        server: Server,
        method: str,
        clients: list[int],
        seed: int,
        rnd: int,
        *,
        reply: Callable[..., bytes | None] | None = None,
    ):
        from fedexlora.secagg.rounds import SecAggError, SecureRound

        self.server, self.method, self.rnd = server, method, rnd
        self.client_reply = reply
        self.clients = list(clients)
        self.sessions = {c: SecureClient(c) for c in clients}  # each client's side
        self.masked: dict[int, bytes] = {}
        self.refused: dict[int, str] = {}
        self.error: str | None = None
        self.collecting: dict[int, dict] = {}
        self.protocol_bytes = 0  # the clients' keys and shares (stages 0, 1 and 3)
        self.round = None
        try:  # fewer than 2 clients (DP budgets spent) fail here: an unchanged round
            self.round = SecureRound(
                server.upload_template(rnd),
                method,
                clients,
                seed=seed * 100_003 + rnd,
                uniform=server.weighting == "uniform",
            )
            self.setups = self.round.setup()
            self.round.keys(self._exchange)
            self.collecting = self.round.collect()
        except SecAggError as exc:
            self.error = str(exc)

    def _exchange(self, stage: str, messages: dict[int, dict]) -> dict[int, dict]:
        from fedexlora.secagg.traffic import protocol_nbytes

        if stage == "setup":
            messages = self.setups
        replies = {c: self.sessions[c].answer(stage, m) for c, m in messages.items()}
        self.protocol_bytes += sum(protocol_nbytes(r) for r in replies.values())
        return replies

    def reply(self, client, up) -> int:
        """A client's masked vector (:meth:`fedexlora.run.client.Client.reply`); its bytes.

        Args:
            client: The :class:`fedexlora.run.client.Client`.
            up: Its upload.
        """
        c = client.client
        try:
            data = client.reply(up, self.sessions[c], self.collecting[c], reply=self.client_reply)
        except ValueError as exc:  # a client refuses to send what it must not (NaN)
            self.refused[c] = str(exc)
            data = None
        if data is None:  # dropped out after training
            return 0
        self.masked[c] = data
        return len(data)

    @property
    def dropped(self) -> set[int]:
        """Sampled clients not in the sum."""
        if self.round is None:
            return set(self.clients)
        return set(self.clients) - set(self.round.session.survivors)

    def aggregate(self):
        """Stages 2 and 3, then the server's round from the sums."""
        from fedexlora.secagg.rounds import SecAggError

        sums = None
        if self.error is None:
            try:
                sums = self.round.finish(self.masked, self._exchange)
            except SecAggError as exc:
                self.error = str(exc)
        if sums is None:
            rejected = {c: f"secure aggregation failed: {self.error}" for c in self.clients}
            seconds = self.round.seconds if self.round is not None else 0.0
            return self.server.aggregate_secure(
                None, [], rejected=rejected, protocol_seconds=seconds
            )
        survivors = sorted(self.round.session.survivors)
        rejected = {**self.round.dropped_reasons(), **self.refused}
        outcome = self.server.aggregate_secure(
            sums, survivors, rejected=rejected, protocol_seconds=self.round.seconds
        )
        if sums.clipped:
            warnings.warn(
                clipped_warning(self.method, self.server.round, sums.clipped,
                                self.round.quant.clip),
                stacklevel=2,
            )  # fmt: skip
        return outcome
