"""Adagrad (mirrors torch/optim/adagrad.py ``_single_tensor_adagrad``).

Per parameter, at step ``t`` (1-based)::

    g = g + weight_decay * p                      (if weight_decay)
    clr = lr / (1 + (t - 1) * lr_decay)
    sum = sum + g * g                             (sum starts at initial_accumulator_value)
    p = p - clr * g / (sqrt(sum) + eps)

A row-sparse gradient (``nn.Embedding(sparse=True)``) updates only the rows it touches, after summing repeated
rows (the update is not linear in g), as torch does; weight decay cannot be combined with it.

``fused``: the whole update in one element-wise kernel per parameter (see :class:`~distlab.optim.SGD`); None, the
default, fuses on device arrays only.
"""
from __future__ import annotations

from ..autograd._array import array_module
from ..autograd.sparse import SparseGrad
from ._functional import check_non_negative, dense_grad, fusable, fused_adagrad
from .optimizer import Optimizer

__all__ = ["Adagrad"]


class Adagrad(Optimizer):
    """Adagrad: each coordinate's step shrinks with the sum of its squared gradients.

    Defaults as torch: ``lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10``.
    """

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, maximize: bool = False,
                 fused=None):
        check_non_negative(learning_rate=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                           initial_accumulator_value=initial_accumulator_value, epsilon=eps)
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps,
                                      maximize=maximize, fused=fused))

    def _init_state(self, p, group, xp) -> dict:
        # torch creates this state in the constructor; here on first use (the same values)
        return {"step": 0, "sum": xp.full_like(p.data, group["initial_accumulator_value"])}

    def _update(self, p, group) -> None:
        state = self._state(p, group)
        state["step"] += 1
        clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
        if isinstance(p.grad, SparseGrad):
            self._sparse_update(p, p.grad, state["sum"], clr, group)
            return
        if fusable(group.get("fused"), p):
            fused_adagrad(p, state["sum"], clr, group["eps"], group["weight_decay"], group["maximize"])
            return
        grad = dense_grad(self, p, group["maximize"], group["weight_decay"])
        state_sum = state["sum"]
        state_sum += grad * grad
        std = array_module(p.data).sqrt(state_sum) + group["eps"]
        p.data -= clr * (grad / std)

    @staticmethod
    def _sparse_update(p, grad: SparseGrad, state_sum, clr: float, group) -> None:
        if group["weight_decay"] != 0:
            raise RuntimeError("weight_decay option is not compatible with sparse gradients")
        grad = grad.coalesce()  # the update is non-linear, so repeated rows are summed first
        rows, values = grad.indices, (-grad.values if group["maximize"] else grad.values)
        state_sum[rows] += values * values
        std = array_module(values).sqrt(state_sum[rows]) + group["eps"]
        p.data[rows] -= clr * (values / std)
