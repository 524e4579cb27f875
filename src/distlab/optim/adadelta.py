"""Adadelta (mirrors torch/optim/adadelta.py ``_single_tensor_adadelta``).

Per parameter::

    g = g + weight_decay * p                      (if weight_decay)
    v = rho * v + (1 - rho) * g * g
    delta = sqrt(u + eps) / sqrt(v + eps) * g
    u = rho * u + (1 - rho) * delta * delta
    p = p - lr * delta

``fused``: the whole update in one element-wise kernel per parameter (see :class:`~distlab.optim.SGD`); None, the
default, fuses on device arrays only.
"""
from __future__ import annotations

from ..autograd._array import array_module
from ._functional import check_non_negative, fused_adadelta
from .optimizer import Optimizer

__all__ = ["Adadelta"]


class Adadelta(Optimizer):
    """Adadelta: steps scaled by the ratio of running RMS of past updates to that of gradients.

    Defaults as torch: ``lr=1.0, rho=0.9, eps=1e-6, weight_decay=0``.
    """

    def __init__(self, params, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
                 maximize: bool = False, fused=None):
        check_non_negative(learning_rate=lr, epsilon=eps, weight_decay=weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize,
                                      fused=fused))

    def _init_state(self, p, group, xp) -> dict:
        return {"step": 0, "square_avg": xp.zeros_like(p.data), "acc_delta": xp.zeros_like(p.data)}

    def _update(self, p, group) -> None:
        state, grad = self._begin_dense(p, group)
        if grad is None:
            fused_adadelta(p, state, group["lr"], group["rho"], group["eps"], group["weight_decay"],
                           group["maximize"])
            return
        xp = array_module(p.data)
        rho, eps = group["rho"], group["eps"]
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        square_avg *= rho
        square_avg += (1 - rho) * grad * grad
        delta = xp.sqrt(acc_delta + eps) / xp.sqrt(square_avg + eps) * grad
        acc_delta *= rho
        acc_delta += (1 - rho) * delta * delta
        p.data -= group["lr"] * delta
