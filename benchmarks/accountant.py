"""The privacy accountant's figures of docs/PRIVACY.md, recomputed.

fedex-lora computes epsilon with Renyi DP of the Poisson-subsampled Gaussian at the
whole-number orders 2-255 only (``fedexlora.training.privacy``). This script prints, with
Google's ``dp-accounting`` as the independent accountant:

1. Opacus's RDP against dp-accounting's at fractional and whole orders (one step);
2. the noise multiplier Opacus's own ``get_noise_multiplier`` picks for a budget, and the
   epsilon dp-accounting (its default orders) gives it;
3. fedex-lora's noise multiplier for the same budget, and dp-accounting's epsilon at it;
4. what leaving out the orders below 2 costs: dp-accounting's epsilon at fedex-lora's
   noise multiplier for other sampling rates.

Deterministic: no timing. Needs ``opacus`` and ``dp-accounting`` (the ``[test]`` extra).

Usage::

    python benchmarks/accountant.py
"""

from __future__ import annotations

import argparse
import warnings


def dp_accounting_rdp(q: float, sigma: float, order: float) -> float:
    """dp-accounting's RDP of one Poisson-subsampled Gaussian step at ``order``."""
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant(orders=[order])
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
    return float(acc.rdp[0])


def dp_accounting_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """dp-accounting's epsilon (its default orders) of ``steps`` steps.

    dp-accounting logs a warning for each fractional order below 2 where its series does
    not converge, and leaves that order out (which can only raise its epsilon); the
    warnings are silenced here.
    """
    import logging

    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant()
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    logging.disable(logging.WARNING)
    try:
        acc.compose(dp_event.SelfComposedDpEvent(event, steps))
        return float(acc.get_epsilon(delta))
    finally:
        logging.disable(logging.NOTSET)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-4)
    ap.add_argument("--sample-rate", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--sigma", type=float, default=1.03, help="for the RDP comparison")
    ap.add_argument("--rates", default="0.2,0.089,0.05", help="sampling rates for the last table")
    args = ap.parse_args()
    import numpy as np
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.utils import get_noise_multiplier

    from fedexlora.training.privacy import epsilon_spent, noise_multiplier, rdp_one_step

    q, sigma = args.sample_rate, args.sigma
    whole = list(range(2, 256))
    opacus_whole = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=whole))
    ref_whole = np.asarray([dp_accounting_rdp(q, sigma, a) for a in whole])
    ours_whole = rdp_one_step(q, sigma)
    print(f"0. RDP of one step at the whole orders 2-255, q = {q}, sigma = {sigma}:")
    for name, got in (("Opacus 1.6", opacus_whole), ("fedex-lora's vectorised form", ours_whole)):
        worst = float(np.max(np.abs(got / ref_whole - 1)))
        print(f"   {name} vs dp-accounting: max relative difference {worst:.1e}")
    print(f"\n1. RDP of one step, q = {q}, sigma = {sigma}\n")
    print("| order | Opacus 1.6 | dp-accounting | Opacus vs dp-accounting |\n|---|---|---|---|")
    for order in (1.75, 2.0, 2.25, 2.5, 3.0):
        opacus_rdp = float(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[order])[0])
        ref = dp_accounting_rdp(q, sigma, order)
        print(
            f"| {order:g} | {opacus_rdp:.6g} | {ref:.6g} | {100 * (opacus_rdp / ref - 1):+.1f}% |"
        )

    eps, delta, steps = args.epsilon, args.delta, args.steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s_opacus = get_noise_multiplier(
            target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps
        )
    s_ours = noise_multiplier(eps, delta, q, steps)
    print(f"\n2-3. Budget epsilon = {eps:g} at delta = {delta:g}, q = {q}, {steps} steps\n")
    print("| noise multiplier from | sigma | dp-accounting's epsilon | within budget |")
    print("|---|---|---|---|")
    for name, s in (("Opacus get_noise_multiplier", s_opacus), ("fedex-lora", s_ours)):
        e = dp_accounting_epsilon(s, q, steps, delta)
        print(f"| {name} | {s:.4f} | {e:.3f} | {'yes' if e <= eps else 'no'} |")

    print(f"\n4. fedex-lora's sigma for epsilon = {eps:g} ({steps} steps, delta = {delta:g})\n")
    print("| q | sigma | fedex-lora's epsilon (orders 2-255) | dp-accounting's epsilon |")
    print("|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        s = noise_multiplier(eps, delta, rate, steps)
        mine = epsilon_spent(s, rate, steps, delta)
        ref = dp_accounting_epsilon(s, rate, steps, delta)
        print(f"| {rate:g} | {s:.4f} | {mine:.3f} | {ref:.3f} |")


if __name__ == "__main__":
    main()
