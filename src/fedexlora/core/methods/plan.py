"""What one round of a method asks of its clients and its server: :class:`RoundPlan`.

A method's round plan (:meth:`fedexlora.core.methods.spec.MethodSpec.plan`) is the one
place that says, for round ``rnd``, which parts of the adapter a client trains, which it
uploads and which it keeps for itself, and what the server sends a client that already
holds the current base. Every reader asks it: the client step freezes and unfreezes
the factors from it and uploads exactly what it says (:mod:`fedexlora.run.client_step`),
the server builds its upload template and payloads from it (:mod:`fedexlora.server`),
and ``fedexlora bench comm`` drives that same server. So a method cannot train one
thing and upload another.

The three parts of an adapter are ``A`` and ``B`` (every LoRA layer's factors, or
Fed-SB's latent core as ``B``) and ``extra``: the trainable tensors beside them (the
task head, LoRA biases).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoundPlan"]

_PARTS = ("A", "B", "extra")


@dataclass(frozen=True)
class RoundPlan:
    """One round of a method, as its clients and its server carry it out.

    Every part a client trains it either uploads or keeps (never both); a part it does
    not train it neither uploads nor keeps (the server keeps the global one, and the
    client gets it from the server).

    Attributes:
        train_A: Clients train every layer's A (frozen otherwise: FFA-LoRA, RoLoRA's odd
            rounds).
        train_B: Clients train every layer's B (Fed-SB: its latent core).
        train_extra: Clients train the task head and other trainable extras.
        upload_A: Clients upload A.
        upload_B: Clients upload B.
        upload_extra: Clients upload the extras (the server averages them).
        keep_A: Clients keep their own A: trained, never uploaded, never replaced by the
            global one after their first round.
        keep_B: The same for B (FedSA-LoRA).
        keep_extra: The same for the extras (FedSA-LoRA's head).
        refactors: The server re-factors the update into new global factors every round
            (FedSVD): it sends both, and keeps neither factor of its own bit for bit.
        sends_uploaded_only: A client that holds the current base is sent only the
            parts clients upload this round: it holds the rest already (a frozen A sent
            once, FFA-LoRA and Fed-SB) or keeps its own (FedSA-LoRA). A client that starts
            over is sent everything whatever this says.

    Raises:
        ValueError: A part uploaded and kept, uploaded or kept without being trained,
            trained and then neither uploaded nor kept, or a round that uploads no
            factor.
    """

    train_A: bool = True
    train_B: bool = True
    train_extra: bool = True
    upload_A: bool = True
    upload_B: bool = True
    upload_extra: bool = True
    keep_A: bool = False
    keep_B: bool = False
    keep_extra: bool = False
    refactors: bool = False
    sends_uploaded_only: bool = False

    def __post_init__(self) -> None:
        for part in _PARTS:
            train, upload, keep = (
                getattr(self, f"{w}_{part}") for w in ("train", "upload", "keep")
            )
            if upload and keep:
                raise ValueError(f"round plan: {part} is both uploaded and kept")
            if (upload or keep) and not train:
                what = "uploads" if upload else "keeps"
                raise ValueError(f"round plan: {what} {part} but does not train it")
            if train and not (upload or keep):
                raise ValueError(
                    f"round plan: trains {part} but neither uploads nor keeps it "
                    "(the round's training of it would be lost)"
                )
        if not (self.upload_A or self.upload_B):
            raise ValueError("round plan: uploads neither A nor B (the server has nothing to do)")

    @property
    def trained(self) -> tuple[bool, bool]:
        """``(train_A, train_B)``."""
        return self.train_A, self.train_B

    @property
    def uploaded(self) -> tuple[bool, bool]:
        """``(upload_A, upload_B)``."""
        return self.upload_A, self.upload_B

    @property
    def kept(self) -> dict[str, bool]:
        """What a client keeps, as :func:`fedexlora.bridge.adapters.get_state` reads it."""
        return {
            "include_A": self.keep_A,
            "include_B": self.keep_B,
            "include_extra": self.keep_extra,
        }

    @property
    def keeps_global_factors(self) -> bool:
        """Whether the server keeps, bit for bit, the global factors not uploaded.

        A frozen A, Fed-SB's ``A = I``, RoLoRA's other factor, a B the clients keep; not
        when the server re-factors both (FedSVD) or every factor is uploaded.
        """
        return not (self.upload_A and self.upload_B) and not self.refactors
