"""The federated server: its fields, and the one class that joins its parts.

:class:`Server` is the server both engines run (and a user's own loop; see
``docs/API.md``). It holds the global adapter state, the base-weight version, the
residual history that clients who skipped rounds need to catch up, and what was folded
since ``W0`` (:class:`~fedexlora.server.record.DeltaRecord`); it never touches a model:
engines fold the returned residuals into whatever model they hold (see
:mod:`fedexlora.bridge.fold`). Its methods come by concern, one module each:
sampling and payloads (:mod:`~fedexlora.server.payloads`), clients of other ranks
(:mod:`~fedexlora.server.hetero`), the round's aggregation and commit
(:mod:`~fedexlora.server.aggregation`), the lossy modes (:mod:`~fedexlora.server.lossy`)
and its state for checkpoints (:mod:`~fedexlora.server.state_dict`); its own seconds per
round are counted by :mod:`~fedexlora.server.timing`. The messages it sends and receives
are in :mod:`fedexlora.core.messages`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fedexlora.core.aggregation import Residual
from fedexlora.core.dora import dora_modules
from fedexlora.core.methods import get_method, method_names
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.server.aggregation import Aggregation
from fedexlora.server.hetero import HeteroRanks
from fedexlora.server.lossy import LossyModes
from fedexlora.server.payloads import Payloads
from fedexlora.server.record import DeltaRecord
from fedexlora.server.state_dict import StateDict

__all__ = ["Server"]


class Server(Payloads, HeteroRanks, Aggregation, LossyModes, StateDict):
    """The federated server: global state, client sampling, payloads, aggregation.

    Its memory is bounded whatever the number of clients: per adapted layer it keeps the
    accumulated base delta (factored while that is smaller, else one dense matrix) and
    only as much residual history as fits beside it in one dense update's worth, plus
    the latest round's residual. A client away longer than that history reaches is sent
    a ``reset`` payload built from the base delta (see :meth:`payload_for`).

    An engine that holds the global model can spare the server its dense copy of the base
    delta: with :attr:`delta_source` set (both of fedex-lora's engines set it to
    :func:`fedexlora.bridge.fold.folded_delta` on their model), a layer whose record
    would turn dense is dropped instead (:attr:`outgrown`) and read back from the model
    when a reset payload or a checkpoint needs it. Each round then costs the server no
    more than aggregating: no dense rebuild, no growing copy.

    Args:
        state: The initial global adapter state (with A for every module).
        layers: Scale, orientation and shape of each LoRA layer.
        method: A federated method of the registry
            (:data:`fedexlora.core.methods.REGISTRY`; ``fedexlora methods`` lists them).
        num_clients: Clients in the federation.
        fraction: Fraction of clients sampled per round (at least one).
        weighting: ``examples`` or ``uniform``; ``None``: the method's own
            (:attr:`~fedexlora.core.methods.MethodSpec.weighting`: ``uniform`` for
            ``fedsa``, as its release, ``examples`` otherwise).
        seed: Seed for sampling and FLoRA's re-initialisation.
        residual_rank: Truncate residuals to this rank (lossy, with error feedback).
        side_rank: Keep the accumulated base delta (what side branches hold) at this rank
            at most (lossy, with error feedback): each round's residual moves it to the
            best rank-``side_rank`` approximation of the exact accumulated delta.
        max_update_norm: Reject uploads whose change from the global state is larger.
        client_layers: Per client, the LoRA layer info of the adapter it trains when it
            differs from the global one (heterogeneous ranks; see
            :mod:`fedexlora.core.hetero`). Supported with ``fedex`` and ``flora``.
    """

    def __init__(
        self,
        state: AdapterState,
        layers: Mapping[str, LayerInfo],
        *,
        method: str = "fedex",
        num_clients: int = 1,
        fraction: float = 1.0,
        weighting: str | None = None,
        seed: int = 0,
        residual_rank: int | None = None,
        side_rank: int | None = None,
        max_update_norm: float | None = None,
        client_layers: Mapping[int, Mapping[str, LayerInfo]] | None = None,
    ):
        self.state = state.clone()
        self.layers = dict(layers)
        self.method = method
        self.spec = get_method(method)  # an unknown name: a clear error here
        self.num_clients = num_clients
        self.fraction = fraction
        self.weighting = weighting or self.spec.weighting
        self.seed = seed
        self.residual_rank = residual_rank
        self.side_rank = side_rank
        self.max_update_norm = max_update_norm
        self.round = 0
        self.version = 0
        self.history: dict[int, dict[str, Residual]] = {}  # v -> residuals from v to v+1
        self.last_sizes: dict[str, tuple[int, int]] = {}  # latest residual: (bytes, dense)
        self.client_version: dict[int, int] = {}  # base version each client holds
        self.feedback: dict[str, Residual] = {}  # lossy mode: residual kept back
        self.record = DeltaRecord(self.layers)  # everything folded since W0, per layer
        self.client_layers = {int(c): dict(v) for c, v in (client_layers or {}).items()}
        if self.client_layers and not self.spec.hetero_ranks:
            hetero = " or ".join(repr(m) for m in method_names(hetero_ranks=True))
            raise ValueError(f"heterogeneous client ranks need method {hetero}, got {method!r}")
        _check_dora(self)
        self.remainder: dict[int, dict[str, Residual]] = {}  # hetero: T_i each client holds
        self.sent: dict[int, AdapterState] = {}  # hetero: the view each client trains from
        self.client_rank: dict[int, int] = {}  # HetLoRA: the rank a client pruned itself to
        self.awaiting: set[int] = set()  # clients sent the coming round's payload
        self._busy = 0.0  # the server's seconds in the current round, so far
        self.last_round_seconds = 0.0  # the server's own seconds in the latest round

    # -- what was folded since W0 (the record) ---------------------------------------
    @property
    def base_delta(self) -> dict[str, Residual]:
        """The base deltas the server holds itself (:attr:`record`'s ``kept``)."""
        return self.record.kept

    @property
    def delta_source(self) -> Callable[[str], Residual] | None:
        """Reads what the global model holds folded (:class:`DeltaRecord`'s ``source``).

        Set by an engine that folds every outcome into a model it holds: the server then
        keeps no dense copy of it.
        """
        return self.record.source

    @delta_source.setter
    def delta_source(self, source: Callable[[str], Residual] | None) -> None:
        self.record.source = source

    @property
    def outgrown(self) -> set[str]:
        """The layers whose base delta only the model holds."""
        return self.record.outgrown

    def delta(self, name: str) -> Residual | None:
        """Module ``name``'s base delta: everything folded into it since ``W0``, or None."""
        return self.record.get(name)

    def deltas(self) -> dict[str, Residual]:
        """Every nonzero base delta (:meth:`delta`): a reset payload's residuals."""
        return {k: r for k, r in self.record.all().items() if r is not None and not r.is_zero}


def _check_dora(server: Server) -> None:
    """Refuses DoRA layers (their row scale among the extras) where they are not exact.

    Only a method whose spec says ``dora`` aggregates them exactly, and not with clients
    of other ranks.
    """
    dora = dora_modules(server.state.extra)
    if not dora:
        return
    if not server.spec.dora:
        exact = " or ".join(repr(m) for m in method_names(dora=True))
        raise ValueError(
            f"module {dora[0]!r} uses DoRA (use_dora=True), which method "
            f"{server.method!r} does not aggregate exactly; use method {exact} or set "
            "use_dora=False"
        )
    if server.client_layers:
        raise ValueError(
            f"module {dora[0]!r} uses DoRA (use_dora=True), which is not supported with "
            "heterogeneous client ranks; give every client the same rank or set use_dora=False"
        )
