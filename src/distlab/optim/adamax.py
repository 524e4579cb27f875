"""Adamax (mirrors torch/optim/adamax.py ``_single_tensor_adamax``): Adam with the infinity norm.

Per parameter, at step ``t`` (1-based)::

    g = g + weight_decay * p                      (if weight_decay)
    m = m + (1 - beta1) * (g - m)                 (torch's lerp_)
    u = max(beta2 * u, |g| + eps)
    p = p - (lr / (1 - beta1^t)) * m / u

``fused``: the whole update in one element-wise kernel per parameter (see :class:`~distlab.optim.SGD`); None, the
default, fuses on device arrays only.
"""
from __future__ import annotations

from ..autograd._array import array_module
from ._functional import check_non_negative, fused_adamax
from .optimizer import Optimizer

__all__ = ["Adamax"]


class Adamax(Optimizer):
    """Adamax. Defaults as torch: ``lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0``."""

    def __init__(self, params, lr: float = 2e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 maximize: bool = False, fused=None):
        check_non_negative(learning_rate=lr, epsilon=eps, weight_decay=weight_decay)
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize, fused=fused))

    def _init_state(self, p, group, xp) -> dict:
        return {"step": 0, "exp_avg": xp.zeros_like(p.data), "exp_inf": xp.zeros_like(p.data)}

    def _update(self, p, group) -> None:
        state, grad = self._begin_dense(p, group)
        beta1, beta2 = group["betas"]
        clr = group["lr"] / (1 - beta1 ** state["step"])
        if grad is None:
            fused_adamax(p, state, clr, beta1, beta2, group["eps"], group["weight_decay"], group["maximize"])
            return
        xp = array_module(p.data)
        exp_avg, exp_inf = state["exp_avg"], state["exp_inf"]
        exp_avg += (1 - beta1) * (grad - exp_avg)
        exp_inf *= beta2
        xp.maximum(exp_inf, xp.abs(grad) + group["eps"], out=exp_inf)
        p.data -= clr * (exp_avg / exp_inf)
