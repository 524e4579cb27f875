"""Finite-difference gradient checking (a small ``torch.autograd.gradcheck``)."""
from __future__ import annotations

import numpy as np

from ._array import asarray_like, to_numpy
from .tensor import Tensor

__all__ = ["numerical_grad", "gradcheck"]


def numerical_grad(fn, inputs, eps: float = 1e-6):
    """Central differences of ``sum(fn(*inputs) * v)`` for a fixed random ``v``, per input.

    Returns ``(v, grads)``: the weighting used (so the analytical side can use the same one) and one array per
    input (None for inputs that do not require grad).
    """
    out = fn(*inputs)
    v = asarray_like(np.random.default_rng(0).standard_normal(out.shape), out.data, np.float64)  # on out's device
    grads = []
    for x in inputs:
        if not (isinstance(x, Tensor) and x.requires_grad):
            grads.append(None)
            continue
        g = np.zeros(x.data.shape, dtype=np.float64)  # the numerical gradient, on the host
        flat, gflat = x.data.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            orig = float(flat[i])  # a number: on a device, flat[i] is a view that the writes below would change
            flat[i] = orig + eps
            plus = float((fn(*inputs).data * v).sum())
            flat[i] = orig - eps
            minus = float((fn(*inputs).data * v).sum())
            flat[i] = orig
            gflat[i] = (plus - minus) / (2 * eps)
        grads.append(g)
    return v, grads


def gradcheck(fn, inputs, eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """Assert that autograd's gradients of ``fn`` match finite differences (inputs should be float64).

    Raises
    ------
    AssertionError
        Naming the input and the largest difference when they disagree.
    """
    v, expected = numerical_grad(fn, inputs, eps)
    for x in inputs:
        if isinstance(x, Tensor):
            x.grad = None
    fn(*inputs).backward(v.astype(np.float64))
    for i, (x, num) in enumerate(zip(inputs, expected)):
        if num is None:
            continue
        got = np.zeros_like(num) if x.grad is None else to_numpy(getattr(x.grad, "to_dense", lambda: x.grad.data)())
        if not np.allclose(got, num, atol=atol, rtol=rtol):
            raise AssertionError(f"gradient of input {i} differs from finite differences: "
                                 f"max |diff| = {np.max(np.abs(got - num)):.3g}\nautograd:\n{got}\nnumerical:\n{num}")
    return True
