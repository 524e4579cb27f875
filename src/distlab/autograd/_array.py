"""Array-module helpers: one code path for numpy and cupy arrays.

cupy is never imported at module level: :func:`array_module` recognises a cupy array by the module its type
comes from, so a machine without cupy (or without a GPU) never pays for it.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["array_module", "is_cupy", "unbroadcast", "index_add", "to_numpy", "asarray_like"]


def is_cupy(arr) -> bool:
    """Return True if ``arr`` is a cupy array (checked without importing cupy)."""
    return type(arr).__module__.startswith("cupy")


def array_module(arr):
    """Return the array module of ``arr``: ``cupy`` for cupy arrays, ``numpy`` for everything else.

    Mirrors ``cupy.get_array_module`` without importing cupy when it is not already loaded.
    """
    if is_cupy(arr):
        return sys.modules["cupy"]
    return np


def to_numpy(arr) -> np.ndarray:
    """Return ``arr`` as a numpy array (copying device memory to the host for cupy arrays)."""
    if is_cupy(arr):
        return arr.get()
    return np.asarray(arr)


def asarray_like(value, like, dtype=None):
    """Convert ``value`` to an array of the same array module (and, by default, dtype) as ``like``."""
    xp = array_module(like)
    return xp.asarray(value, dtype=like.dtype if dtype is None else dtype)


def unbroadcast(grad, shape):
    """Sum ``grad`` down to ``shape``: the adjoint of numpy broadcasting.

    Broadcasting prepends size-1 axes and stretches size-1 axes; the gradient of a broadcast input is the sum of
    the output gradient over exactly those axes (mirrors ``at::sum_to`` used by torch's ``BroadcastBackward``).
    """
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    if lead:
        grad = grad.reshape(grad.shape[lead:])
    return grad.reshape(shape)


def index_add(target, index, values) -> None:
    """Add ``values`` into ``target[index]`` in place, accumulating repeated indices (``np.add.at``)."""
    if is_cupy(target):
        import cupyx  # only reachable when cupy is in use

        cupyx.scatter_add(target, index, values)
    else:
        np.add.at(target, index, values)
