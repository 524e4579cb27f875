"""Adam and AdamW (mirrors torch/optim/adam.py ``_single_tensor_adam`` and torch/optim/adamw.py).

Per parameter, at step ``t`` (1-based)::

    g = g + weight_decay * p                      (Adam, coupled weight decay)
    p = p * (1 - lr * weight_decay)               (AdamW, decoupled weight decay)
    m = m + (1 - beta1) * (g - m)                 (torch's exp_avg.lerp_)
    v = beta2 * v + (1 - beta2) * g * g
    vmax = max(vmax, v); use vmax for v           (amsgrad)
    p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``fused`` (as torch's): all of it in one element-wise kernel per parameter, the same operations in the same order
(bit-equal on numpy). None, the default, fuses on device arrays and keeps this readable code on numpy.
"""
from __future__ import annotations

import math

from ..autograd._array import array_module
from ._functional import fused_adam
from .optimizer import Optimizer

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam; ``decoupled_weight_decay=True`` makes it AdamW."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, maximize: bool = False, decoupled_weight_decay: bool = False, fused=None):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError("lr, eps and weight_decay must be non-negative")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize,
                                      decoupled_weight_decay=decoupled_weight_decay, fused=fused))

    def _init_state(self, p, group, xp) -> dict:
        state = {"step": 0, "exp_avg": xp.zeros_like(p.data), "exp_avg_sq": xp.zeros_like(p.data)}
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = xp.zeros_like(p.data)
        return state

    def _update(self, p, group) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        decoupled = group["decoupled_weight_decay"]
        state, grad = self._begin_dense(p, group, 0.0 if decoupled else wd)
        step = state["step"]
        if grad is None:
            fused_adam(p, state, lr, beta1, beta2, eps, wd, decoupled, group["amsgrad"], group["maximize"], step)
            return
        xp = array_module(p.data)
        if wd != 0 and decoupled:
            p.data *= 1 - lr * wd
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += (1 - beta1) * (grad - m)
        v *= beta2
        v += (1 - beta2) * grad * grad
        if group["amsgrad"]:
            xp.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
            v = state["max_exp_avg_sq"]
        step_size = lr / (1 - beta1 ** step)
        denom = xp.sqrt(v) / math.sqrt(1 - beta2 ** step) + eps
        p.data -= step_size * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (default ``weight_decay=1e-2``), as torch.optim.AdamW."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, maximize: bool = False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, decoupled_weight_decay=True, fused=fused)
