"""A strict stand-in for cupy, over host memory: what CI runs the device paths on when no GPU is at hand.

``from distlab import fakegpu as xp`` is used as ``import cupy as xp`` would be: ``xp.zeros``, ``xp.asarray``,
``xp.concatenate``, ``xp.random.default_rng``, ``xp.cuda.Stream``, ``xp.asnumpy``, and arrays of type
:class:`ndarray` that refuse every implicit conversion to numpy (``np.asarray(a)`` raises cupy's TypeError).
Importing it registers its array type with distlab (``distlab.autograd.register_device_array``), so distlab treats
its arrays as device arrays: :func:`distlab.autograd.array_module` returns this module for them, the comm layer
stages them through host memory (or hands them to a "CUDA-aware" MPI through ``__cuda_array_interface__``).
:func:`use_as_cuda` makes ``"cuda"`` (``module.to("cuda")``) mean the stand-in instead of cupy. ``cuda.Memory``
and the runtime's IPC calls (:mod:`._memory`) emulate CUDA IPC between processes, so code that shares device memory
by handle (the ipc transport's slots) runs as it would on a GPU.

Every public name is cupy 14's, with cupy's parameters (``tests/test_fakegpu_matches_cupy.py`` checks them against
a snapshot of cupy's API), but the counters below, :func:`use_as_cuda` and :class:`MultiTensorKernel`: code that
runs on the stand-in calls nothing cupy lacks.

Every transfer between host and "device", and every stream wait, is counted by the distlab module that asked for
it (:func:`transfers`, :func:`total`, :func:`round_trips`), so a test can show which components stage through
the host and that none converts implicitly. Every kernel a GPU would launch (a ufunc, a reduction, a matmul, an
allocation, a copy, a fill, an :class:`ElementwiseKernel`) is counted the same way (:func:`launches`,
:func:`launch_total`); :func:`reset` forgets both. The maths is numpy's on the host memory: a seeded run is
bit-equal to numpy.

What it cannot show: device rounding (cupy's reductions and matmuls differ from numpy's in the last bits), what a
launch and a copy cost, and the real stream ordering; those need a GPU (``tests/test_gpu.py``).
"""
from __future__ import annotations

import numpy as _np

import types as _types

from . import _memory, _nccl, cuda, lib, random
from ._kernels import ElementwiseKernel, MultiTensorKernel
from ._ndarray import ndarray, launched as _launched, unwrap as _unwrap, unwrap_index as _unwrap_index, \
    wrap as _wrap
from ._transfers import launch_total, launches, reset, round_trips, total, transfers
from ._transfers import count as _count, count_launch as _count_launch

cuda.nccl = _nccl  # cupy.cuda.nccl
# cupy.cuda.memory (cupy's names only: the helpers stay in _memory), its classes under cupy.cuda too, and the
# runtime's IPC calls over them
cuda.memory = _types.ModuleType(f"{cuda.__name__}.memory", "``cupy.cuda.memory`` for the stand-in.")
for _name in ("BaseMemory", "Memory", "UnownedMemory", "MemoryPointer"):
    setattr(cuda.memory, _name, getattr(_memory, _name))
    setattr(cuda, _name, getattr(_memory, _name))
for _name in ("CUDARuntimeError", "cudaIpcMemLazyEnablePeerAccess", "ipcGetMemHandle", "ipcOpenMemHandle",
              "ipcCloseMemHandle"):
    setattr(cuda.runtime, _name, getattr(_memory, _name))

__all__ = ["ndarray", "ElementwiseKernel", "MultiTensorKernel", "cuda", "lib", "linalg", "random", "asarray",
           "array", "ascontiguousarray", "asnumpy", "get_array_module", "use_as_cuda", "transfers", "total",
           "round_trips", "launches", "launch_total", "reset"]


def _from_host(value, dtype=None, copy=False):
    if isinstance(value, ndarray):
        a = value._a
        if dtype is not None and a.dtype != _np.dtype(dtype):
            _count_launch("copy")
            return _wrap(a.astype(dtype))
        if copy:
            _count_launch("copy")
            return _wrap(a.copy())
        return value
    if isinstance(value, _np.ndarray):
        _count("from_host")
    elif isinstance(value, (list, tuple)) and any(isinstance(v, ndarray) for v in value):
        raise TypeError("asarray of a list holding device arrays: use xp.stack")
    return _wrap(_np.array(value, dtype=dtype, copy=True))


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """``a`` on the device: device arrays pass through (cast if ``dtype`` differs), host data is copied in."""
    if copy is False and (not isinstance(a, ndarray) or dtype is not None and a.dtype != _np.dtype(dtype)):
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    return _from_host(a, dtype, copy=bool(copy))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A new device array holding ``obj`` (always a copy unless ``copy=False`` and nothing changes)."""
    if subok:
        raise NotImplementedError  # as cupy's
    out = _from_host(obj, dtype, copy=bool(copy))
    return out if ndmin <= out.ndim else _wrap(out._a.reshape((1,) * (ndmin - out.ndim) + out.shape))


def ascontiguousarray(a, dtype=None):
    out = _from_host(a, dtype)
    if out._a.flags.c_contiguous:
        return out
    _count_launch("copy")
    return _wrap(_np.ascontiguousarray(out._a))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """Copy a device array to the host (numpy arrays pass through), as ``cupy.asnumpy``."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return _np.asarray(a, order=order)


def get_array_module(*args):
    """This module if any argument is a stand-in array, numpy otherwise."""
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def _scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` accumulating repeated indices (``cupyx.scatter_add``)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"scatter_add takes a device array, got {type(a).__name__}")
    _count_launch("elementwise")
    _np.add.at(a._a, _unwrap_index(slices), value._a if isinstance(value, ndarray) else _unwrap(value))


def use_as_cuda(enabled: bool = True) -> None:
    """Make ``"cuda"`` mean the stand-in (``Module.to("cuda")``, ``tensor(..., device="cuda")``), or stop to."""
    from distlab.autograd._array import set_cuda_module
    import sys

    set_cuda_module(sys.modules[__name__] if enabled else None)


def _device_function(name, host_function):
    def function(*args, **kwargs):
        args = _unwrap(args, name)
        result = host_function(*args, **_unwrap(kwargs, name))
        out = kwargs.get("out")
        _launched(name, result, args, out)
        return out if out is not None else _wrap(result)  # with ``out=``, that very array, as cupy returns it
    function.__name__ = name
    function.__doc__ = f"``cupy.{name}`` on the stand-in: ``numpy.{name}`` with the result kept on the device."
    return function


#: Names the module takes from numpy unchanged: dtypes, constants, dtype arithmetic.
_PASSTHROUGH = {"dtype", "newaxis", "pi", "e", "inf", "nan", "finfo", "iinfo", "result_type", "promote_types",
                "can_cast", "issubdtype", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                "uint8", "uint16", "uint32", "uint64", "bool_", "complex64", "complex128", "integer", "floating",
                "number", "generic", "ndim", "shape", "size"}
#: numpy functions of host files and buffers: cupy's copy host data in or out, transfers the stand-in would have
#: to count; refused until device code needs one.
_HOST_IO = {"frombuffer", "fromfile", "fromiter", "load", "save", "savez", "loadtxt", "savetxt", "asanyarray",
            "asarray_chkfinite", "require"}
#: numpy's names cupy 14 lacks (tests/test_fakegpu_matches_cupy.py keeps the list whole against the snapshot of
#: cupy's API): refused, as ``cupy.<name>`` raises AttributeError. numpy's submodules are refused too: the
#: stand-in's are its own (cuda, lib, linalg, random), each with cupy's names only.
_NOT_IN_CUPY = {"False_", "True_", "ScalarType", "asmatrix", "block", "bmat", "busday_count", "busday_offset",
                "busdaycalendar", "bytes_", "character", "clongdouble", "complex256", "datetime64",
                "datetime_as_string", "datetime_data", "einsum_path", "errstate", "flexible", "float128",
                "frompyfunc", "fromregex", "geomspace", "get_include", "getbufsize", "geterr", "geterrcall",
                "histogram_bin_edges", "info", "insert", "is_busday", "isnat", "little_endian", "longdouble",
                "matrix", "matvec", "memmap", "nanpercentile", "nanquantile", "ndenumerate", "nditer",
                "nested_iters", "object_", "polyder", "polydiv", "polyint", "recarray", "record", "sctypeDict",
                "setbufsize", "seterr", "seterrcall", "show_runtime", "spacing", "str_", "test", "timedelta64",
                "typecodes", "unstack", "vecdot", "vecmat", "void"}
#: ``cupy.linalg``'s functions (numpy's linalg has more: matrix_norm, vecdot, svdvals...)
_LINALG = ("cholesky", "cond", "cross", "det", "eig", "eigh", "eigvals", "eigvalsh", "inv", "lstsq", "matmul",
           "matrix_power", "matrix_rank", "matrix_transpose", "norm", "pinv", "qr", "slogdet", "solve", "svd",
           "tensorinv", "tensorsolve")


def __getattr__(name: str):
    if name.startswith("_") or name in _HOST_IO or name in _NOT_IN_CUPY or not hasattr(_np, name) \
            or isinstance(getattr(_np, name), _types.ModuleType):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    host = getattr(_np, name)
    value = host if name in _PASSTHROUGH or isinstance(host, type) or not callable(host) \
        else _device_function(name, host)
    globals()[name] = value
    return value


linalg = _types.ModuleType(f"{__name__}.linalg", "``cupy.linalg`` for the stand-in: numpy's, on the device.")
for _name in _LINALG:
    setattr(linalg, _name, _device_function(f"linalg.{_name}", getattr(_np.linalg, _name)))
linalg.LinAlgError = _np.linalg.LinAlgError


def _register() -> None:
    import sys

    from distlab.autograd._array import register_device_array

    register_device_array(ndarray, sys.modules[__name__], _scatter_add)


_register()
