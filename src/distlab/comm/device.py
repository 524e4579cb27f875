"""Device buffers: how the comm layer hands numpy and device arrays (cupy, or the CI stand-in) to MPI.

A backend says whether an array lives on a device, how to wait for the device's stream, and how to stage it
through host memory. numpy is the host backend; every device array type registered with
``distlab.autograd.register_device_array`` (cupy registers itself lazily; ``distlab.fakegpu``, a host-memory
stand-in that exposes ``__cuda_array_interface__`` as mpi4py's own tests do, registers itself when imported) gets
a backend built from its array module, so the device paths are exercised without a GPU.

``DISTLAB_CUDA_AWARE=auto|1|0`` decides whether device arrays go to MPI directly (1) or are staged through host
memory (0). ``auto`` asks the MPI library itself (``MPIX_Query_cuda_support``, exported by MPICH and Open MPI
when built with CUDA); neither PyPI wheel is CUDA-aware, and handing a device pointer to an MPI that is not
crashes the process, so anything but a clear "yes" means staging.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..autograd._array import device_module
from .reduce_ops import check_movable

__all__ = ["ArrayBackend", "backend_for", "cuda_aware", "mpi_cuda_support", "mpi_buffer", "check_buffer",
           "empty_like", "device_array", "pickled", "displacements"]


@dataclass(frozen=True)
class ArrayBackend:
    """How to move one kind of array to and from MPI.

    Attributes
    ----------
    name : str
        For messages (``"numpy"``, ``"cupy"``).
    on_device : bool
        True when the array's memory is device memory.
    synchronize : callable
        ``synchronize(array)`` waits until pending device work writing the array is done.
    to_host : callable
        ``to_host(array) -> numpy.ndarray`` (a copy).
    from_host : callable
        ``from_host(array, host)`` copies ``host`` back into ``array`` in place.
    """

    name: str
    on_device: bool = False
    synchronize: Callable[[Any], None] = lambda a: None
    to_host: Callable[[Any], np.ndarray] = np.asarray
    from_host: Callable[[Any, np.ndarray], None] = lambda a, h: None


_NUMPY = ArrayBackend("numpy")


@functools.lru_cache(maxsize=None)
def _device_backend(module) -> ArrayBackend:
    def synchronize(_array) -> None:
        module.cuda.get_current_stream().synchronize()

    def from_host(array, host) -> None:
        array.set(host)

    return ArrayBackend(module.__name__, True, synchronize, module.asnumpy, from_host)


def backend_for(array) -> ArrayBackend:
    """Return the backend of ``array``; a clear TypeError for anything MPI cannot take."""
    if isinstance(array, np.ndarray):
        return _NUMPY
    module = device_module(array)
    if module is not None:
        return _device_backend(module)
    raise TypeError(
        f"distlab collectives take numpy or cupy arrays, got {type(array).__module__}.{type(array).__name__}; "
        "for a distlab.Tensor pass tensor.data"
    )


@functools.lru_cache(maxsize=None)
def mpi_cuda_support() -> bool | None:
    """Ask the loaded MPI library whether it is CUDA-aware (None when it cannot say)."""
    from mpi4py import MPI  # noqa: F401 - loads libmpi

    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libmpi" in line and ".so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library("mpi")
    if not path:
        return None
    try:
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
    except OSError:
        return None
    if query is None:
        return None
    query.restype = ctypes.c_int
    return bool(query())


def cuda_aware() -> bool:
    """Whether device arrays go to MPI directly (see the module docstring for ``DISTLAB_CUDA_AWARE``)."""
    setting = os.environ.get("DISTLAB_CUDA_AWARE", "auto").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    if setting != "auto":
        raise ValueError(f"DISTLAB_CUDA_AWARE={setting!r}: expected auto, 1 or 0")
    return mpi_cuda_support() is True


def mpi_buffer(array, what: str):
    """Return (buffer to give MPI, step copying results back or None), staging device arrays if needed."""
    if type(array) is np.ndarray:  # the hot path: host memory, no staging
        if not array.flags.c_contiguous:
            raise _not_contiguous(array, what)
        return array, None
    backend = _checked_backend(array, what)
    if not backend.on_device:
        return array, None
    backend.synchronize(array)  # the kernels writing this array must finish before MPI reads it
    if cuda_aware():
        return array, None
    host = backend.to_host(array)
    return host, (lambda: backend.from_host(array, host))


def check_buffer(array, what: str) -> None:
    """The checks of :func:`mpi_buffer` (a TypeError for what MPI cannot take, a ValueError for an array that is
    not C-contiguous) without its staging: for a call that may yet hand the array to a transport."""
    if type(array) is np.ndarray:
        if not array.flags.c_contiguous:
            raise _not_contiguous(array, what)
        return
    _checked_backend(array, what)


def _checked_backend(array, what: str) -> ArrayBackend:
    backend = backend_for(array)
    if not _is_contiguous(array):
        raise _not_contiguous(array, what)
    return backend


def _not_contiguous(array, what: str) -> ValueError:
    return ValueError(f"{what}: the array must be C-contiguous (got strides {array.strides}); "
                      "pass np.ascontiguousarray(a) and copy the result back")


def device_array(array, what: str, name=None, host_too: bool = False) -> bool:
    """True when ``array`` is a device array (or with ``host_too`` a numpy array) a transport can take; checked:
    C-contiguous, a movable dtype."""
    if not (host_too and type(array) is np.ndarray) and device_module(array) is None:
        return False
    if not _is_contiguous(array):
        raise _not_contiguous(array, what)
    check_movable(array.dtype, what, name)
    return True


def empty_like(array, shape):
    """An uninitialised array of ``shape`` with ``array``'s dtype, in the same memory (host or device)."""
    module = device_module(array)
    if module is None:
        backend_for(array)  # a clear TypeError for anything that is not an array MPI takes
        return np.empty(shape, dtype=array.dtype)
    return module.empty(shape, dtype=array.dtype)


def _is_contiguous(array) -> bool:
    flags = getattr(array, "flags", None)
    if flags is not None:
        return bool(flags["C_CONTIGUOUS"]) if not hasattr(flags, "c_contiguous") else bool(flags.c_contiguous)
    return True


def pickled(obj) -> np.ndarray:
    """``obj`` pickled (highest protocol), as a uint8 array MPI can send."""
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def displacements(sizes) -> np.ndarray:
    """Where each of ``sizes`` starts when they are laid end to end (MPI's ``displs`` of a ``v`` call)."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]])
