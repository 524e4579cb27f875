"""A host-memory stand-in for a GPU array (no GPU is lent to this project), as mpi4py's tests use.

``FakeDeviceArray`` exposes ``__cuda_array_interface__`` pointing at host memory, so a "CUDA-aware" MPI can read
it, and ``get``/``set`` like cupy's. :func:`register` installs its array backend and returns counters showing
whether the comm layer staged through host memory and synchronised the "stream".
"""
import numpy as np

from distlab.comm.device import ArrayBackend, register_backend

COUNTS = {"synchronize": 0, "to_host": 0, "from_host": 0}


class FakeDeviceArray:
    def __init__(self, host):
        self._host = np.ascontiguousarray(host)

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    strides = property(lambda self: self._host.strides)
    flags = property(lambda self: self._host.flags)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._host.shape, "typestr": self._host.dtype.str, "strides": None,
                "data": (self._host.ctypes.data, False), "version": 3}

    def __getitem__(self, index):
        return self._host[index]

    def __setitem__(self, index, value):
        self._host[index] = value

    def get(self):
        return self._host.copy()

    def set(self, host):
        self._host[...] = host


def _synchronize(_array):
    COUNTS["synchronize"] += 1


def _to_host(array):
    COUNTS["to_host"] += 1
    return array.get()


def _from_host(array, host):
    COUNTS["from_host"] += 1
    array.set(host)


def register():
    register_backend(ArrayBackend("fakegpu", lambda a: isinstance(a, FakeDeviceArray), True, _synchronize,
                                  _to_host, _from_host))
    return COUNTS
