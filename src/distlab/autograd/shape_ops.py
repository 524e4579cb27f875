"""Reductions, shape operations, indexing and (log-)softmax with their backward nodes.

Formulas follow torch's tools/autograd/derivatives.yaml; reductions take numpy's ``axis``/``keepdims``.
"""
from __future__ import annotations

import builtins

import numpy as np

from ._array import array_module, index_add
from .node import Node
from .ops import _ShapeOnly, record
from .tensor import Tensor

__all__ = ["sum", "mean", "reshape", "transpose", "getitem", "concatenate", "stack", "log_softmax", "softmax"]


def _axes(axis, ndim):
    """Normalise ``axis`` (None, int or tuple) to a sorted tuple of non-negative axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(sorted(a % ndim for a in axis))


def _expand_reduced(g, shape, axes, keepdims):
    """Broadcast the gradient of a reduction back to the input ``shape``."""
    xp = array_module(g)
    if not keepdims and axes:
        g = xp.expand_dims(g, axes)
    return xp.broadcast_to(g, shape)


class SumBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        shape, axes, keepdims = self.saved
        return (_expand_reduced(g, shape, axes, keepdims),)


class MeanBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        shape, axes, keepdims, count = self.saved
        return (_expand_reduced(g / count, shape, axes, keepdims),)


def sum(a: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis`` (all axes when None)."""
    axes = _axes(axis, a.data.ndim)
    out = a.data.sum(axis=axes, keepdims=keepdims)
    return record(out, SumBackward, (a,), (a.data.shape, axes, keepdims))


def mean(a: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (all axes when None)."""
    axes = _axes(axis, a.data.ndim)
    count = 1
    for ax in axes:
        count *= a.data.shape[ax]
    out = a.data.mean(axis=axes, keepdims=keepdims)
    return record(out, MeanBackward, (a,), (a.data.shape, axes, keepdims, count))


class ReshapeBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        return (g.reshape(self.saved),)


def reshape(a: Tensor, *shape) -> Tensor:
    """Reshape (``a.reshape(2, 3)`` or ``a.reshape((2, 3))``)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return record(a.data.reshape(shape), ReshapeBackward, (a,), a.data.shape)


class TransposeBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        return (g.transpose(self.saved),)


def transpose(a: Tensor, *axes) -> Tensor:
    """Permute axes (reverse them when none are given), as ``numpy.transpose``."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    if not axes:
        axes = tuple(reversed(range(a.data.ndim)))
    inverse = tuple(int(i) for i in np.argsort(axes))
    return record(a.data.transpose(axes), TransposeBackward, (a,), inverse)


def _is_basic(index) -> bool:
    """True for basic indexing (ints, slices, None, Ellipsis): each element is selected at most once."""
    parts = index if isinstance(index, tuple) else (index,)
    return builtins.all(isinstance(p, (int, slice, type(None), type(Ellipsis))) for p in parts)


def _unwrap_index(index):
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(p.data if isinstance(p, Tensor) else p for p in index)
    return index


class GetitemBackward(Node):
    """Scatter the gradient back into a zero array; advanced indices may repeat, so they accumulate."""

    __slots__ = ()

    def apply(self, g):
        shape, dtype, index = self.saved
        grad = array_module(g).zeros(shape, dtype=dtype)
        if _is_basic(index):
            grad[index] = g
        else:
            index_add(grad, index, g)
        return (grad,)


def getitem(a: Tensor, index) -> Tensor:
    """``a[index]`` with numpy's basic and advanced indexing."""
    index = _unwrap_index(index)
    return record(a.data[index], GetitemBackward, (a,), (a.data.shape, a.data.dtype, index))


class ConcatBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        bounds, axis = self.saved
        xp = array_module(g)
        return tuple(xp.split(g, bounds, axis=axis)) if len(self.next_nodes) > 1 else (g,)


def concatenate(tensors, axis: int = 0) -> Tensor:
    """Join tensors along an existing axis (``numpy.concatenate``/``torch.cat``)."""
    tensors = list(tensors)
    arrays = [t.data if isinstance(t, Tensor) else t for t in tensors]
    xp = array_module(arrays[0])
    bounds = list(np.cumsum([x.shape[axis] for x in arrays])[:-1])
    return record(xp.concatenate(arrays, axis=axis), ConcatBackward, tuple(tensors), (bounds, axis))


class StackBackward(_ShapeOnly):
    __slots__ = ()

    def apply(self, g):
        xp = array_module(g)
        return tuple(xp.take(g, i, axis=self.saved) for i in range(len(self.next_nodes)))


def stack(tensors, axis: int = 0) -> Tensor:
    """Join tensors along a new axis (``numpy.stack``/``torch.stack``)."""
    tensors = list(tensors)
    arrays = [t.data if isinstance(t, Tensor) else t for t in tensors]
    out = array_module(arrays[0]).stack(arrays, axis=axis)
    return record(out, StackBackward, tuple(tensors), axis % out.ndim)


class LogSoftmaxBackward(Node):
    __slots__ = ()

    def apply(self, g):
        out, axis = self.saved
        xp = array_module(out)
        return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    """``log(softmax(a))`` computed stably (shifted by the max)."""
    xp = array_module(a.data)
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
    return record(out, LogSoftmaxBackward, (a,), (out, axis))


class SoftmaxBackward(Node):
    __slots__ = ()

    def apply(self, g):
        out, axis = self.saved
        return (out * (g - (g * out).sum(axis=axis, keepdims=True)),)


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    """Softmax along ``axis``."""
    xp = array_module(a.data)
    e = xp.exp(a.data - a.data.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)
    return record(out, SoftmaxBackward, (a,), (out, axis))


# -- Tensor's reductions, shape methods and indexing (installed here: tensor.py imports no op module) -----------
def _flatten(self): return reshape(self, -1)


for _name, _fn in (("sum", sum), ("mean", mean), ("reshape", reshape), ("view", reshape), ("flatten", _flatten),
                   ("transpose", transpose), ("log_softmax", log_softmax), ("softmax", softmax),
                   ("__getitem__", getitem)):
    setattr(Tensor, _name, _fn)
del _name, _fn
