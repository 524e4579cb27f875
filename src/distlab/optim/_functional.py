"""Helpers the optimizers share: reading a parameter's gradient the way torch's ``_single_tensor_*`` do."""
from __future__ import annotations

from ..autograd.sparse import SparseGrad

__all__ = ["dense_grad", "check_non_negative"]


def dense_grad(optimizer, p, maximize: bool, weight_decay: float = 0.0):
    """``p``'s gradient as a dense array, negated for ``maximize``, plus ``weight_decay * p`` (torch's coupled
    weight decay); a new array whenever either applies, so the gradient itself is never written in place.

    Raises RuntimeError for a sparse gradient, as torch does for every optimizer but SGD, Adagrad and SparseAdam.
    """
    if isinstance(p.grad, SparseGrad):
        raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients (as in torch); use SGD "
                           "or Adagrad for sparse embeddings")
    grad = p.grad.data
    grad = -grad if maximize else grad
    return grad + weight_decay * p.data if weight_decay != 0 else grad


def check_non_negative(**values) -> None:
    """torch's constructor checks: ``ValueError("Invalid <name> value: <v>")`` for a negative hyper-parameter."""
    for name, value in values.items():
        if not 0.0 <= value:
            raise ValueError(f"Invalid {name} value: {value}")
