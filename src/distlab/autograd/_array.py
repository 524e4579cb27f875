"""Array-module helpers: one code path for numpy and device (cupy) arrays.

Device arrays are recognised through a registry of device array types, each with its array module
(:func:`register_device_array`). cupy registers itself lazily, the first time an array of a type distlab does not
know is looked at while cupy is already imported, so a machine without cupy (or without a GPU) never pays for it;
a stand-in (``distlab.fakegpu``, for CI) registers itself when imported. ``"cuda"`` names cupy unless
:func:`set_cuda_module` chose another device module.
"""
from __future__ import annotations

import sys
from types import MappingProxyType

import numpy as np

__all__ = ["array_module", "is_cupy", "device_module", "register_device_array", "device_array_types", "set_cuda_module", "cuda_module",
           "unbroadcast", "index_add", "to_numpy", "asarray_like"]

#: device array type -> its array module (``cupy``, or a stand-in with cupy's functions)
_DEVICE_MODULES: dict = {}
#: device array module -> its ``scatter_add(target, index, values)`` (``cupyx.scatter_add`` for cupy)
_SCATTER_ADD: dict = {}
_CUDA: list = []  # the module "cuda" names when not cupy (set_cuda_module)
_DEVICE_VIEW = MappingProxyType(_DEVICE_MODULES)


def register_device_array(array_type, module, scatter_add) -> None:
    """Treat instances of ``array_type`` as device arrays whose array module is ``module``.

    ``module`` offers cupy's functions (``zeros``, ``asarray``, ``asnumpy``, ``cuda.get_current_stream`` ...);
    ``scatter_add(target, index, values)`` accumulates repeated indices in place, as ``cupyx.scatter_add``.
    """
    _DEVICE_MODULES[array_type] = module
    _SCATTER_ADD[module] = scatter_add


def device_array_types():
    """``{device array type: its array module}`` registered so far (cupy's once an array of it was seen): a live,
    read-only view."""
    return _DEVICE_VIEW


def _register_cupy(arr):
    cupy = sys.modules.get("cupy")
    if cupy is None or not isinstance(arr, cupy.ndarray):
        return None
    import cupyx  # only reachable when cupy is in use

    register_device_array(type(arr), cupy, cupyx.scatter_add)
    return cupy


def device_module(arr):
    """The array module of a device array (cupy, or a registered stand-in); None for host arrays and the rest."""
    kind = type(arr)
    if kind is np.ndarray:
        return None
    module = _DEVICE_MODULES.get(kind)
    return module if module is not None else _register_cupy(arr)


def is_cupy(arr) -> bool:
    """Return True if ``arr`` is a device array: cupy's, or of a type registered with :func:`register_device_array`."""
    return type(arr) is not np.ndarray and device_module(arr) is not None


def array_module(arr):
    """Return the array module of ``arr``: its device module for device arrays, ``numpy`` for everything else.

    Mirrors ``cupy.get_array_module`` without importing cupy when it is not already loaded.
    """
    if type(arr) is np.ndarray:
        return np
    module = device_module(arr)
    return np if module is None else module


def set_cuda_module(module) -> None:
    """Make ``"cuda"`` name ``module`` (a registered device module), or cupy again with None."""
    _CUDA[:] = [] if module is None else [module]


def cuda_module():
    """The array module ``"cuda"`` names: the one :func:`set_cuda_module` chose, else cupy (imported now)."""
    if _CUDA:
        return _CUDA[0]
    import cupy

    return cupy


def to_numpy(arr) -> np.ndarray:
    """Return ``arr`` as a numpy array (copying device memory to the host for device arrays)."""
    module = device_module(arr)
    if module is not None:
        return module.asnumpy(arr)
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
    module = device_module(target)
    if module is not None:
        _SCATTER_ADD[module](target, index, values)
    else:
        np.add.at(target, index, values)
