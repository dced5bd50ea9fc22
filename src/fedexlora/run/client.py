"""One client, for every engine: payload in, training, reply out, state kept.

:class:`Client` is what one client does in one round, whichever engine carries the
round (the in-process engine, :mod:`fedexlora.run.inprocess`; Flower's ClientApp,
:mod:`fedexlora.flower.client_app`):

1. :meth:`Client.apply` brings its model to the global model of the round's payload,
   with the parts it keeps of its own (:attr:`MethodSpec.keeps`).
2. :meth:`Client.refuses` says whether its DP-SGD budget is spent (then it trains
   nothing and sends nothing of its data): the one test, :meth:`Budget.allows`.
3. :meth:`Client.train` trains through :attr:`Client.update` (default
   :func:`fedexlora.run.client_step.local_update`; a caller may put another step with
   its signature there, such as a worker group's), counts the steps against its budget
   and keeps its DP record.
4. :meth:`Client.keep` keeps its state for the next round (or forgets it).
5. :meth:`Client.reply` is its reply: the upload in the clear, or, under secure
   aggregation, its masked vector (:class:`fedexlora.run.secure_client.SecureClient`,
   the one client side of SecAgg+).
6. :meth:`Client.evaluate` measures its own model on its own test split (personalized
   methods), and :meth:`Client.save_adapter` writes its adapter (``save_client_adapters``).

What a client keeps between rounds goes to a store (:mod:`fedexlora.run.client_store`:
in memory, a state directory, or Flower's node state). How it holds its model is its
*holder*, and the two engines hold it differently, on purpose:

- :class:`SharedModel` (in-process): ONE model for every client, whose base already
  holds the server's global residuals, so no client needs a model of its own. Applying
  a payload sets the server's global state on it (the payload's bytes are counted, its
  residual is already in the base) and then the client's kept parts; a client of
  another rank trains in a temporary view (:func:`client_view`) restored bit for bit.
  Its state is only its kept parts.
- :class:`OwnModel` (Flower): the client's own model, holding the base version its
  previous payloads left. Applying a payload folds the residual into that base (or its
  fp32 side branch) and loads the global factors
  (:func:`fedexlora.bridge.steps.apply_payload`). Its state is everything it must
  keep to rebuild the model (:func:`fedexlora.bridge.steps.client_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from fedexlora.bridge.adapters import get_state, layer_info, set_state
from fedexlora.bridge.fold import fold_residuals, restore_base, snapshot_base
from fedexlora.config import RunConfig
from fedexlora.core.messages import ClientUpload, Payload
from fedexlora.core.methods import get_method
from fedexlora.core.state import AdapterState
from fedexlora.run.client_step import local_update, save_client_adapter
from fedexlora.run.client_store import ClientStore
from fedexlora.run.secure_client import SecureClient, rounding_seed
from fedexlora.run.timing import phase

__all__ = ["Client", "Holder", "OwnModel", "SharedModel", "client_view"]


class Holder(Protocol):
    """How a client holds its model (:class:`SharedModel`, :class:`OwnModel`)."""

    model: torch.nn.Module
    shared: bool  # one model for many clients: its state is only the kept parts

    def apply(self, client: int, payload: Payload, load: Callable[[], dict | None]) -> None:
        """Brings the model to the payload's global model (``load``: the kept state)."""

    def view(self, client: int) -> contextlib.AbstractContextManager:
        """The context the client trains in."""

    def state(self) -> dict[str, torch.Tensor] | None:
        """What the client keeps between rounds (``None``: nothing)."""


class SharedModel:
    """The in-process holder: one model for every client (see the module docstring).

    Args:
        model: The server's global model; its base holds the global residuals.
        server: The method's server (its global state; heterogeneous ranks' views).
        cfg: The run configuration.
        method: The method.
    """

    shared = True

    def __init__(self, model, server, cfg: RunConfig, method: str):
        self.model, self.server, self.cfg, self.method = model, server, cfg, method
        self.spec = get_method(method)

    def apply(self, client: int, payload: Payload, load: Callable[[], dict | None]) -> None:
        """The server's global state, then the client's kept parts (unless ``reset``).

        The payload's residual is not folded: the shared base holds it already.
        """
        set_state(self.model, self.server.state)
        kept = None if payload.reset else load()
        if kept is not None:  # what it keeps (MethodSpec.keeps)
            set_state(self.model, AdapterState.from_flat(kept))

    def view(self, client: int) -> contextlib.AbstractContextManager:
        """The client's own rank's view of the shared model (heterogeneous ranks)."""
        from fedexlora.run.build import client_adapter

        adapter = client_adapter(self.cfg, self.method, client)
        return client_view(self.model, self.server, client, adapter)

    def state(self) -> dict[str, torch.Tensor] | None:
        """Its kept parts (a personalized method), else nothing."""
        if not self.spec.personalized:
            return None
        return get_state(self.model, **self.spec.kept_parts()).to_flat()


class OwnModel:
    """A client's own model (Flower's holder; see the module docstring).

    The engine gives it the model already holding the base version the payload builds
    on (from its cache, or restored from the store, :meth:`restore`).

    Args:
        model: The client's peft model.
        adapter: The peft adapter it trains (its own rank under ``client_ranks``).
        cfg: The run configuration (the side-branch caps).
    """

    shared = False

    def __init__(self, model, adapter: str, cfg: RunConfig):
        self.model, self.adapter, self.cfg = model, adapter, cfg

    def apply(self, client: int, payload: Payload, load: Callable[[], dict | None]) -> None:
        """Folds the payload's residual into its base, then loads the global factors."""
        from fedexlora.bridge.fold import side_caps
        from fedexlora.bridge.steps import apply_payload

        caps = side_caps(self.model, side_rank=self.cfg.side_rank, budget=self.cfg.side_budget)
        apply_payload(self.model, payload, side_rank=caps, adapter=self.adapter)

    def view(self, client: int) -> contextlib.AbstractContextManager:
        """Its own model: nothing to change."""
        return contextlib.nullcontext()

    def state(self) -> dict[str, torch.Tensor]:
        """What it folded into its base, and its adapter (``client_state``)."""
        from fedexlora.bridge.steps import client_state

        return client_state(self.model)

    def restore(self, flat: dict[str, torch.Tensor]) -> None:
        """Back from :meth:`state` into a freshly loaded (pretrained) model."""
        from fedexlora.bridge.steps import load_client_state

        load_client_state(self.model, flat)


class Client:
    """One client in one round, on any engine (see the module docstring).

    Args:
        cfg: The run configuration.
        method: A registered method.
        client: Its id (its partition).
        data: Its training examples.
        holder: How it holds its model (:class:`SharedModel`, :class:`OwnModel`).
        store: What it keeps between rounds (:mod:`fedexlora.run.client_store`).
        prep: The run's prepared data (its tokenizer, its test split); ``None``: no
            tokenizer and no evaluation.
        update: Its training step, called as :func:`fedexlora.run.client_step.local_update`
            (the default) is: the seam for another trainer (a worker group) or a test's
            wrapper.
        steps: Local steps (``None``: ``cfg.local_steps``).
        progress: Whether to show a progress bar.
        budget: Its DP-SGD budget this round (:class:`fedexlora.training.privacy.Budget`;
            ``None``: no DP). :meth:`train` counts its steps on it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        method: str,
        client: int,
        data,
        holder: Holder,
        store: ClientStore,
        *,
        prep=None,
        update: Callable[..., ClientUpload] | None = None,
        steps: int | None = None,
        progress: bool = False,
        budget=None,
    ):
        self.cfg, self.method, self.client, self.data = cfg, method, client, data
        self.holder, self.store, self.prep = holder, store, prep
        self.update = local_update if update is None else update
        self.steps, self.progress, self.budget = steps, progress, budget
        self.spec = get_method(method)
        self.round: int | None = None

    @property
    def model(self) -> torch.nn.Module:
        """Its model (its holder's)."""
        return self.holder.model

    def apply(self, payload: Payload, since: int = -1) -> None:
        """Brings its model to the global model of ``payload`` (built on base ``since``)."""
        with phase("setup"):
            self.holder.apply(self.client, payload, lambda: self.store.load(self.client, since))

    @property
    def want(self) -> int:
        """The local steps it takes this round (what its budget must allow)."""
        from fedexlora.training.privacy import steps_per_round

        return self.steps if self.steps is not None else steps_per_round(self.cfg, len(self.data))

    def refuses(self) -> bool:
        """Whether its DP-SGD budget is spent: it then trains nothing and sends nothing."""
        return self.budget is not None and not self.budget.allows(self.want)

    def train(self, rnd: int) -> ClientUpload:
        """Trains one round through :attr:`update`; its budget counts the steps.

        Raises:
            ValueError: If DP-SGD cannot train this model (a layer Opacus refuses).
            DPCheckError: If DP-SGD's first step did not train what it must.
        """
        self.round = rnd
        with phase("setup"):  # its view and checks; the steps themselves are "train"
            if self.budget is not None:
                from fedexlora.training.privacy import check_model

                check_model(self.model)
            tokenizer = None if self.prep is None else self.prep.tokenizer
            with self.holder.view(self.client), phase("train", self.client):
                up = self.update(
                    self.cfg, self.method, self.model, self.data, rnd, self.client,
                    steps=self.steps, progress=self.progress, dp=self.budget,
                    tokenizer=tokenizer,
                )  # fmt: skip
            if self.budget is not None:  # its own accounting, kept where it keeps its state
                self.budget.steps += self.want
                self.store.save_dp_record(self.client, self.budget.record())
        return up

    def keep(self, version: int, keep: bool = True) -> None:
        """Keeps its state after base ``version`` for its next round (or forgets it)."""
        with phase("setup"):
            if not keep:
                self.store.forget(self.client)
                return
            flat = self.holder.state()
            if flat is not None:
                self.store.save(self.client, version, flat)

    def reply(
        self,
        up: ClientUpload,
        secure: SecureClient | None = None,
        fields: dict | None = None,
        *,
        reply: Callable[..., bytes | None] | None = None,
    ) -> ClientUpload | bytes | None:
        """Its reply: ``up`` in the clear, or its masked vector under secure aggregation.

        Args:
            up: Its upload.
            secure: Its side of the round's SecAgg+ (``None``: in the clear).
            fields: The stage-2 message (the shares forwarded to it).
            reply: The masking step (:meth:`SecureClient.masked`'s ``reply``).

        Raises:
            ValueError: Under secure aggregation, if it refuses to send what it must not.
        """
        if secure is None:
            return up
        return secure.masked(
            fields or {}, up, seed=rounding_seed(self.cfg), rnd=self.round, reply=reply
        )

    def evaluate(self, state: AdapterState) -> tuple[dict[str, float], int]:
        """Its own model (the global parts of ``state``, its kept parts) on its test split."""
        from fedexlora.run.rounds import evaluate_personal

        with phase("evaluate"):
            own = None
            if self.holder.shared:  # the shared model holds no client's own parts
                own = AdapterState.from_flat(self.store.load(self.client, -1))
            return evaluate_personal(
                self.cfg, self.method, self.model, self.prep, self.client, state, own
            )

    def save_adapter(self, out_dir: Path, rnd: int, num_examples: int) -> Path:
        """Writes its adapter as trained (``save_client_adapters``)."""
        with phase("checkpoint"):
            return save_client_adapter(self.model, Path(out_dir), rnd, self.client, num_examples)


@contextlib.contextmanager
def client_view(model, server: Any, client: int, adapter: str | None) -> Iterator[None]:
    """Temporarily turns the shared model into a client of another rank.

    The client's remainder ``T_c`` is folded into the shared base under the client's own
    adapter and scale, and restored bit for bit afterwards.
    """
    if adapter is None:
        yield
        return
    snapshot = snapshot_base(model)
    info = layer_info(model, adapter)
    remainder = server.remainder.get(client, {})
    fold_residuals(
        model, {n: t.scaled(1.0 / info[n].scale) for n, t in remainder.items()}, adapter=adapter
    )
    model.set_adapter(adapter)
    set_state(model, server.sent[client], adapter=adapter)
    try:
        yield
    finally:
        restore_base(model, snapshot)
        model.set_adapter("default")
