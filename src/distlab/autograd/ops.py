"""Element-wise and matrix operations with their backward nodes.

Each op computes its forward with the input's array module (numpy or cupy) and, when grad mode is on and an
input requires grad, records a Node whose ``apply`` mirrors the formula in torch's
tools/autograd/derivatives.yaml. Non-Tensor operands (Python scalars, arrays) are constants: they stay as they
are, so ``float32_tensor * 2.0`` stays float32 under numpy's promotion rules.
"""
from __future__ import annotations

import numpy as np

from . import grad_mode
from ._array import array_module, is_cupy, unbroadcast
from ._kernels import elementwise_kernel
from .node import Node
from .tensor import Tensor

__all__ = ["add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "relu", "tanh", "sigmoid", "abs",
           "matmul", "record", "needs_grad", "edge"]


# -- recording helpers ------------------------------------------------------------------------------------------
def _d(x):
    """The array behind ``x`` (a Tensor), or ``x`` itself (a constant)."""
    return x.data if isinstance(x, Tensor) else x


def needs_grad(*inputs) -> bool:
    """True when grad mode is on and any input is a Tensor that requires grad."""
    if not grad_mode._state.enabled:
        return False
    for x in inputs:
        if isinstance(x, Tensor) and x.requires_grad:
            return True
    return False


def edge(x):
    """The node that will receive ``x``'s gradient (its grad_fn or AccumulateGrad), or None."""
    if isinstance(x, Tensor) and x.requires_grad:
        fn = x.grad_fn
        return fn if fn is not None else x._grad_node()
    return None


def record(data, node_cls, inputs, saved=None) -> Tensor:
    """Wrap ``data`` as the output of an op; record ``node_cls(edges, saved)`` if a gradient is needed.

    This is the hot path of every forward op (torch's ``collect_next_edges`` + ``set_history``): one pass over
    the inputs builds the edges, and a node is created only if one of them is not None.
    """
    if grad_mode._state.enabled:
        edges = tuple([edge(x) for x in inputs])
        for e in edges:
            if e is not None:
                return Tensor._wrap(data, node_cls(edges, saved))
    return Tensor._wrap(data)


def _shape(x):
    return np.shape(x) if not hasattr(x, "shape") else x.shape


class _ShapeOnly(Node):
    """A node that saves only shapes: nothing to free, so running it twice is allowed (as in torch)."""

    __slots__ = ()

    def release(self):
        pass


# -- arithmetic ---------------------------------------------------------------------------------------------------
class AddBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        sa, sb = self.saved
        return (unbroadcast(g, sa) if self.needs(0) else None,
                unbroadcast(g, sb) if self.needs(1) else None)


class SubBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        sa, sb = self.saved
        return (unbroadcast(g, sa) if self.needs(0) else None,
                unbroadcast(-g, sb) if self.needs(1) else None)


class MulBackward(Node):
    __slots__ = ()

    def apply(self, g):
        a, b = self.saved
        return (unbroadcast(g * b, _shape(a)) if self.needs(0) else None,
                unbroadcast(g * a, _shape(b)) if self.needs(1) else None)


class DivBackward(Node):
    __slots__ = ()

    def apply(self, g):
        a, b = self.saved
        ga = g / b
        return (unbroadcast(ga, _shape(a)) if self.needs(0) else None,
                unbroadcast(-ga * a / b, _shape(b)) if self.needs(1) else None)


class NegBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        return (-g,)


def add(a, b) -> Tensor:
    """``a + b`` with broadcasting."""
    da, db = _d(a), _d(b)
    return record(da + db, AddBackward, (a, b), (_shape(da), _shape(db)))


def sub(a, b) -> Tensor:
    """``a - b`` with broadcasting."""
    da, db = _d(a), _d(b)
    return record(da - db, SubBackward, (a, b), (_shape(da), _shape(db)))


def mul(a, b) -> Tensor:
    """``a * b`` with broadcasting."""
    da, db = _d(a), _d(b)
    return record(da * db, MulBackward, (a, b), (da, db))


def div(a, b) -> Tensor:
    """``a / b`` with broadcasting."""
    da, db = _d(a), _d(b)
    return record(da / db, DivBackward, (a, b), (da, db))


def neg(a) -> Tensor:
    """``-a``."""
    return record(-a.data, NegBackward, (a,), ())


class PowBackward(Node):
    __slots__ = ()

    def apply(self, g):
        a, b, out = self.saved
        ga = gb = None
        if self.needs(0):
            ga = unbroadcast(g * b * a ** (b - 1), _shape(a))
        if self.needs(1):
            xp = array_module(out)
            # d(a**b)/db = a**b * log(a); torch masks a == 0 to give 0 there instead of nan
            log_a = xp.log(xp.where(a > 0, a, 1))
            gb = unbroadcast(g * out * log_a, _shape(b))
        return ga, gb


def pow(a, b) -> Tensor:
    """``a ** b``; either may be a Tensor."""
    da, db = _d(a), _d(b)
    out = da ** db
    return record(out, PowBackward, (a, b), (da, db, out))


# -- unary functions ------------------------------------------------------------------------------------------------
class ExpBackward(Node):
    __slots__ = ()

    def apply(self, g):
        return (g * self.saved,)


class LogBackward(Node):
    __slots__ = ()

    def apply(self, g):
        return (g / self.saved,)


class SqrtBackward(Node):
    __slots__ = ()

    def apply(self, g):
        return (g / (2 * self.saved),)


class ReluBackward(Node):
    """``g * (out > 0)``: on a device, one fused kernel instead of a comparison and a product (same bits)."""

    __slots__ = ()

    def apply(self, g):
        out = self.saved
        if is_cupy(g) and type(g) is type(out) and g.dtype == out.dtype and g.shape == out.shape:
            return (elementwise_kernel(array_module(g), "T g, T out", "T gx", "gx = g * (out > 0);",
                                       "distlab_relu_backward")(g, out),)
        return (g * (out > 0),)


class TanhBackward(Node):
    __slots__ = ()

    def apply(self, g):
        out = self.saved
        return (g * (1 - out * out),)


class SigmoidBackward(Node):
    __slots__ = ()

    def apply(self, g):
        out = self.saved
        return (g * out * (1 - out),)


class AbsBackward(Node):
    __slots__ = ()

    def apply(self, g):
        return (g * array_module(self.saved).sign(self.saved),)


def exp(a) -> Tensor:
    out = array_module(a.data).exp(a.data)
    return record(out, ExpBackward, (a,), out)


def log(a) -> Tensor:
    return record(array_module(a.data).log(a.data), LogBackward, (a,), a.data)


def sqrt(a) -> Tensor:
    out = array_module(a.data).sqrt(a.data)
    return record(out, SqrtBackward, (a,), out)


def relu(a) -> Tensor:
    xp = array_module(a.data)
    out = xp.maximum(a.data, 0)
    return record(out, ReluBackward, (a,), out)


def tanh(a) -> Tensor:
    out = array_module(a.data).tanh(a.data)
    return record(out, TanhBackward, (a,), out)


def sigmoid(a) -> Tensor:
    xp = array_module(a.data)
    out = 1 / (1 + xp.exp(-a.data))
    return record(out, SigmoidBackward, (a,), out)


def abs(a) -> Tensor:
    return record(array_module(a.data).abs(a.data), AbsBackward, (a,), a.data)


# -- matmul -----------------------------------------------------------------------------------------------------------
class MatmulBackward(Node):
    """Gradient of numpy ``matmul`` including 1-D operands and batch broadcasting (torch's matmul backward)."""

    __slots__ = ()

    def apply(self, g):
        a, b = self.saved
        xp = array_module(g)
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        if b.ndim == 1:  # restore the axes numpy's matmul dropped for 1-D operands (b's first)
            g = g[..., None]
        if a.ndim == 1:
            g = g[..., None, :]
        ga = gb = None
        if self.needs(0):
            ga = unbroadcast(g @ xp.swapaxes(b2, -1, -2), a2.shape).reshape(a.shape)
        if self.needs(1):
            gb = unbroadcast(xp.swapaxes(a2, -1, -2) @ g, b2.shape).reshape(b.shape)
        return ga, gb


def matmul(a, b) -> Tensor:
    """``a @ b`` with numpy's matmul rules."""
    da, db = _d(a), _d(b)
    if not hasattr(da, "ndim"):
        da = np.asarray(da)
    if not hasattr(db, "ndim"):
        db = np.asarray(db)
    return record(da @ db, MatmulBackward, (a, b), (da, db))


# -- Tensor's operators and element-wise methods ----------------------------------------------------------------
# Installed here rather than written in tensor.py, so that tensor.py imports no op module (ops import Tensor).
# The forward operators are the ops themselves: no extra Python frame per operation.
def _radd(self, other): return add(other, self)
def _rsub(self, other): return sub(other, self)
def _rmul(self, other): return mul(other, self)
def _rtruediv(self, other): return div(other, self)
def _rmatmul(self, other): return matmul(other, self)
def _rpow(self, base): return pow(base, self)


for _name, _fn in (("__add__", add), ("__radd__", _radd), ("__sub__", sub), ("__rsub__", _rsub),
                   ("__mul__", mul), ("__rmul__", _rmul), ("__truediv__", div), ("__rtruediv__", _rtruediv),
                   ("__matmul__", matmul), ("__rmatmul__", _rmatmul), ("__pow__", pow), ("__rpow__", _rpow),
                   ("__neg__", neg), ("exp", exp), ("log", log), ("sqrt", sqrt), ("relu", relu), ("tanh", tanh),
                   ("sigmoid", sigmoid), ("abs", abs)):
    setattr(Tensor, _name, _fn)
del _name, _fn
