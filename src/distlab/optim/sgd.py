"""Stochastic gradient descent with momentum, dampening, weight decay and Nesterov (mirrors torch/optim/sgd.py).

The update, per parameter ``p`` with gradient ``g`` (torch's ``_single_tensor_sgd``)::

    g = g + weight_decay * p                      (if weight_decay)
    buf = g              (first step)             (if momentum)
    buf = momentum * buf + (1 - dampening) * g    (later steps)
    g = g + momentum * buf  if nesterov  else  buf
    p = p - lr * g

``fused`` (as torch's): the whole update in one element-wise kernel per parameter, the same operations in the
same order (bit-equal on numpy). None, the default, fuses on device arrays, where each separate operation is one
kernel launch, and keeps this operation-by-operation code on numpy.
"""
from __future__ import annotations

from ..autograd._array import array_module, index_add
from ..autograd.sparse import SparseGrad
from ._functional import fusable, fused_sgd
from .optimizer import Optimizer, required

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD; a row-sparse gradient with no momentum and no weight decay updates only the touched rows."""

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, fused=None):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0 or weight_decay < 0.0:
            raise ValueError("momentum and weight_decay must be non-negative")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize, fused=fused))

    def _update_in(self, p, group) -> None:
        self._update(p, group["lr"], group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"],
                     group["maximize"], group.get("fused"))

    def _update(self, p, lr, momentum, dampening, wd, nesterov, maximize, fused=None) -> None:
        if fusable(fused, p):
            fused_sgd(p, self.state.setdefault(p, {}) if momentum != 0 else None, lr, momentum, dampening, wd,
                      nesterov, maximize)
            return
        grad = p.grad
        if isinstance(grad, SparseGrad):
            if momentum == 0 and wd == 0:
                scale = lr if maximize else -lr
                index_add(p.data, grad.indices, scale * grad.values)  # touched rows only
                return
            grad = grad.to_dense()  # as torch: sparse + dense (weight decay, momentum) is dense
        else:
            grad = grad.data
        if maximize:
            grad = -grad
        if wd != 0:
            grad = grad + wd * p.data
        if momentum != 0:
            state = self.state.get(p)
            if state is None:
                state = self.state[p] = {}
            buf = state.get("momentum_buffer")
            if buf is None:
                # an array even for a 0-d parameter, whose maths numpy gives as scalars (which `*=` cannot update)
                buf = state["momentum_buffer"] = array_module(p.data).array(grad)
            else:
                buf *= momentum
                buf += (1 - dampening) * grad if dampening else grad
            grad = grad + momentum * buf if nesterov else buf
        p.data -= lr * grad
