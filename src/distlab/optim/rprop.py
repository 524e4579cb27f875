"""Rprop, resilient backpropagation (mirrors torch/optim/rprop.py ``_single_tensor_rprop``).

Only the sign of the gradient is used. Per parameter, with the previous gradient ``prev``::

    s = sign(g * prev)
    step_size = clip(step_size * (etaplus if s > 0, etaminus if s < 0, 1 if s == 0), *step_sizes)
    g = 0 where s < 0                             (a sign change: skip this coordinate once)
    p = p - sign(g) * step_size
    prev = g

``step_size`` starts at ``lr`` for every coordinate.
"""
from __future__ import annotations

from ..autograd._array import array_module
from ._functional import check_non_negative, dense_grad
from .optimizer import Optimizer

__all__ = ["Rprop"]


class Rprop(Optimizer):
    """Rprop. Defaults as torch: ``lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50)``."""

    def __init__(self, params, lr: float = 1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), maximize: bool = False):
        check_non_negative(learning_rate=lr)
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")
        super().__init__(params, dict(lr=lr, etas=tuple(etas), step_sizes=tuple(step_sizes), maximize=maximize))

    def _init_state(self, p, group, xp) -> dict:
        return {"step": 0, "prev": xp.zeros_like(p.data), "step_size": xp.full_like(p.data, group["lr"])}

    def _update(self, p, group) -> None:
        xp = array_module(p.data)
        grad = dense_grad(self, p, group["maximize"])
        state = self._state(p, group)
        state["step"] += 1
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        sign = xp.sign(grad * state["prev"])
        factor = xp.where(sign > 0, etaplus, xp.where(sign < 0, etaminus, 1.0)).astype(p.data.dtype)
        step_size = state["step_size"]
        step_size *= factor
        xp.clip(step_size, step_size_min, step_size_max, out=step_size)
        grad = xp.where(sign < 0, 0, grad).astype(p.data.dtype)  # a sign change: no step, and no memory of it
        p.data -= xp.sign(grad) * step_size
        state["prev"][...] = grad
