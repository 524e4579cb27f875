"""RMSprop (mirrors torch/optim/rmsprop.py ``_single_tensor_rmsprop``).

Per parameter::

    g = g + weight_decay * p                      (if weight_decay)
    v = alpha * v + (1 - alpha) * g * g
    centered:  m = m + (1 - alpha) * (g - m);  avg = sqrt(v - m * m) + eps
    else:      avg = sqrt(v) + eps
    momentum > 0:  buf = momentum * buf + g / avg;  p = p - lr * buf
    else:          p = p - lr * g / avg

``fused``: the whole update in one element-wise kernel per parameter (see :class:`~distlab.optim.SGD`); None, the
default, fuses on device arrays only.
"""
from __future__ import annotations

from ..autograd._array import array_module
from ._functional import check_non_negative, fused_rmsprop
from .optimizer import Optimizer

__all__ = ["RMSprop"]


class RMSprop(Optimizer):
    """RMSprop, with optional momentum and the centered variant (normalised by an estimate of the variance).

    Defaults as torch: ``lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False``.
    """

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False, maximize: bool = False, fused=None):
        check_non_negative(learning_rate=lr, epsilon=eps, momentum=momentum, weight_decay=weight_decay,
                           alpha=alpha)
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered, maximize=maximize, fused=fused))

    def _init_state(self, p, group, xp) -> dict:
        state = {"step": 0, "square_avg": xp.zeros_like(p.data)}
        if group["momentum"] > 0:
            state["momentum_buffer"] = xp.zeros_like(p.data)
        if group["centered"]:
            state["grad_avg"] = xp.zeros_like(p.data)
        return state

    def _update(self, p, group) -> None:
        state, grad = self._begin_dense(p, group)
        if grad is None:
            fused_rmsprop(p, state, group["lr"], group["alpha"], group["eps"], group["weight_decay"],
                          group["momentum"], group["centered"], group["maximize"])
            return
        xp = array_module(p.data)
        alpha, eps = group["alpha"], group["eps"]
        square_avg = state["square_avg"]
        square_avg *= alpha
        square_avg += (1 - alpha) * grad * grad
        if group["centered"]:
            grad_avg = state["grad_avg"]
            grad_avg += (1 - alpha) * (grad - grad_avg)  # torch's lerp_
            avg = xp.sqrt(square_avg - grad_avg * grad_avg) + eps
        else:
            avg = xp.sqrt(square_avg) + eps
        if group["momentum"] > 0:
            buf = state["momentum_buffer"]
            buf *= group["momentum"]
            buf += grad / avg
            p.data -= group["lr"] * buf
        else:
            p.data -= group["lr"] * (grad / avg)
