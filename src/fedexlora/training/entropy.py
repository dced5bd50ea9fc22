"""DP-SGD's noise from OS entropy, never from a seed the server knows.

Opacus's ``DPOptimizer`` drawing its Gaussian noise from
:class:`fedexlora.core.entropy.SecureRandom`.
"""

from __future__ import annotations

from fedexlora.core.entropy import SecureRandom

__all__ = ["SecureRandom", "secure_dp_optimizer"]


def secure_dp_optimizer(optimizer, **kwargs):
    """Opacus's ``DPOptimizer`` around ``optimizer``, its noise from :class:`SecureRandom`.

    ``kwargs`` are ``DPOptimizer``'s (``noise_multiplier``, ``max_grad_norm``,
    ``expected_batch_size``, ``loss_reduction``); no ``generator`` is taken.
    """
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class SecureNoiseDPOptimizer(DPOptimizer):
        """DP-SGD whose Gaussian noise is drawn from OS entropy, per parameter and step."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.noise_source = SecureRandom()

        def add_noise(self) -> None:
            std = self.noise_multiplier * self.max_grad_norm
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                ref = p.summed_grad
                noise = self.noise_source.normal(ref.shape, std) if std > 0 else None
                grad = ref if noise is None else ref + noise.to(ref.device, ref.dtype)
                p.grad = grad.view_as(p)
                _mark_as_processed(p.summed_grad)

    return SecureNoiseDPOptimizer(optimizer, **kwargs)
