"""Fed-SB: frozen shared A and B, a trained r x r core R, averaged exactly."""

from __future__ import annotations

import functools

from fedexlora.core.methods.ffa import shared_A_aggregate
from fedexlora.core.methods.spec import MethodSpec


def check(cfg) -> list[str]:
    """Fed-SB's gradient initialisation reads every client's examples before round 1."""
    if cfg.fedsb_init_resolved != "gradient":
        return []
    errs = []
    if cfg.dp:
        errs.append(
            "`fedsb_init` gradient reads the clients' examples without noise, so it cannot "
            "be combined with --dp-epsilon; fix: --fedsb-init random (or auto)"
        )
    if cfg.engine == "flower":
        errs.append(
            "`fedsb_init` gradient needs the sum of every client's gradient before round 1, "
            "which the Flower engine does not collect; fix: --fedsb-init random"
        )
    return errs


def install_basis(setup) -> None:
    """Fed-SB's frozen A and B around the core (``prepare_model``).

    From the run's ``fedsb_init``: seeded, or from the pooled clients' gradient.
    """
    cfg = setup.cfg
    init = cfg.fedsb_init_resolved
    grads = setup.pooled_gradients(cfg.fedsb_init_samples) if init == "gradient" else None
    setup.install_latent(init=init, grads=grads, total_steps=cfg.rounds * (cfg.local_steps or 1))


SPEC = MethodSpec(
    name="fedsb",
    title="Fed-SB",
    paper="Singhal et al., 2025 (arXiv 2502.15436)",
    trains="the r x r core R (A and B frozen, shared)",
    keeps_local="nothing",
    uploads="R_i",
    downloads="R̄",
    exact=True,
    linear=True,
    bytes_per_round="up 4kr^2; down 4kr^2 (r: the Fed-SB rank)",
    # In latent coordinates (A = I shared, B = R) FFA-LoRA's rule is Fed-SB's: exact,
    # because the update B R A is linear in R.
    aggregate=functools.partial(shared_A_aggregate, method="fedsb"),
    frozen_A=True,
    latent=True,
    prepare_model=install_basis,
    claims=(("fedex", "Fed-SB ahead of FedEx-LoRA under DP (Fed-SB, arXiv 2502.15436)"),),
    check=check,
)
