"""Memory for a group's unsharded parameters that can be released and taken back at the same address.

torch frees an unsharded parameter after forward by resizing its storage to 0 and re-allocates it before
backward (``_fsdp_param.py`` ``free_storage`` / ``alloc_storage``): the tensor object stays, so the autograd graph
that saved it for backward still holds a valid tensor, which the backward all-gather fills again. A numpy array
cannot change its memory, and the graph keeps every array it saved alive, so dropping FSDP's own references would
free nothing before backward. :class:`UnshardedStorage` does what the resize does, for host memory: the arrays are
views of an anonymous memory map, ``free()`` hands its pages back to the kernel and ``alloc()`` takes them back
on the next write, at the same address, so every view, the graph's included, stays valid. The map's bytes are
reported to ``tracemalloc`` in numpy's domain while allocated, so memory measured with tracemalloc sees them as
it sees numpy's own arrays.

How the pages go back is ``DISTLAB_FSDP_RELEASE``:

- ``lazy`` (the default): ``madvise(MADV_FREE)``, as allocators give memory back (jemalloc, tcmalloc): the
  kernel takes the pages when it needs memory, and a page written again before that is simply kept. Measured
  here, a 1 MiB group's release and refill cost 0.3 ms, the copy alone.
- ``eager``: ``madvise(MADV_DONTNEED)``: the pages go at once (the resident size drops), and the next write
  faults in zeroed pages one by one: 4 to 6 ms for the same 1 MiB, ten times the copy.

Device arrays (cupy, the stand-in) get a new array at each ``alloc()``; ``free()`` drops FSDP's reference, and the
memory returns to the pool once the autograd graph releases it too.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from .._env import choice

__all__ = ["UnshardedStorage", "release_mode"]

_PAGE = mmap.PAGESIZE
_CAN_RELEASE = hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap.mmap, "madvise")
_NUMPY_DOMAIN = int(getattr(np.lib, "tracemalloc_domain", 389047))
_ADVICE = {"lazy": getattr(mmap, "MADV_FREE", getattr(mmap, "MADV_DONTNEED", None)),
           "eager": getattr(mmap, "MADV_DONTNEED", None)}
_track = ctypes.pythonapi.PyTraceMalloc_Track
_track.argtypes = (ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t)
_track.restype = ctypes.c_int
_untrack = ctypes.pythonapi.PyTraceMalloc_Untrack
_untrack.argtypes = (ctypes.c_uint, ctypes.c_size_t)
_untrack.restype = ctypes.c_int


class UnshardedStorage:
    """``numel`` elements of ``dtype`` for a group's all-gather outputs (each parameter's padded unsharded data).

    Attributes
    ----------
    flat : array or None
        The 1-D array the parameters' views are cut from (None while a device storage is freed).
    allocated : bool
        Whether the memory is held.
    generation : int
        Incremented each time ``flat`` is a new array (device storage), so views cut from the old one are re-cut.
    """

    def __init__(self, xp, dtype, numel: int, release: str | None = None):
        self.xp, self.dtype, self.numel = xp, np.dtype(dtype), int(numel)
        self._advice = _ADVICE[release or release_mode()]
        self.host = xp is np
        self.allocated = False
        self.generation = 0
        self.flat = None
        self._map = None
        if self.host:
            nbytes = max(self.numel * self.dtype.itemsize, 1)
            self.nbytes = -(-nbytes // _PAGE) * _PAGE
            if _CAN_RELEASE:
                # private: MADV_DONTNEED frees private anonymous pages (a shared mapping would keep them)
                self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self.flat = np.frombuffer(self._map, dtype=self.dtype, count=self.numel)
            else:  # no madvise: ordinary memory, held for good
                self.flat = np.empty(self.numel, dtype=self.dtype)
            self._address = self.flat.__array_interface__["data"][0] if self.numel else 0
        else:
            self.nbytes = self.numel * self.dtype.itemsize

    def alloc(self) -> bool:
        """Hold the memory (``alloc_storage``); True when ``flat`` is a new array whose views must be re-cut."""
        if self.allocated:
            return False
        self.allocated = True
        if self.host:
            if self._map is not None and self._address:
                _track(_NUMPY_DOMAIN, self._address, self.nbytes)
            return False
        self.flat = self.xp.empty(self.numel, dtype=self.dtype)
        self.generation += 1
        return True

    def free(self) -> None:
        """Release the memory (``free_storage``); the views stay valid objects and are filled again later."""
        if not self.allocated:
            return
        self.allocated = False
        if self.host:
            if self._map is not None and self._address:
                self._map.madvise(self._advice)
                _untrack(_NUMPY_DOMAIN, self._address)
            return
        self.flat = None

    def __del__(self):  # a storage dropped while held: tracemalloc forgets it
        if getattr(self, "allocated", False) and self.host and self._map is not None and self._address:
            _untrack(_NUMPY_DOMAIN, self._address)


def release_mode() -> str:
    """``DISTLAB_FSDP_RELEASE``: ``lazy`` (default) or ``eager`` (see the module's docstring)."""
    return choice("DISTLAB_FSDP_RELEASE", "lazy", ("lazy", "eager"))
