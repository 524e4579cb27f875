"""``cupy.cuda.memory`` for the stand-in, and the CUDA IPC calls of ``cupy.cuda.runtime`` over it.

:class:`Memory` is what ``cupy.cuda.Memory(size)`` is: a dedicated allocation (``cudaMalloc``, never a pool's
sub-allocation). On the stand-in it is an anonymous memory file (``memfd_create``) mapped into the process, so
another process can map it too: no name in any filesystem, nothing in ``/dev/shm``, and its pages go back to the
kernel once the last mapping and the last descriptor close, however the processes end (a SIGKILL included).

The IPC calls keep CUDA's contract, so the code a GPU runs is the code the stand-in runs:

- :func:`ipcGetMemHandle` takes the base address of a live :class:`Memory` and returns 64 bytes (the size of
  ``cudaIpcMemHandle_t``) naming it: the exporting process, its descriptor of the file, the file's identity and
  size, and the device's UUID. Any other address is refused with cupy's ``CUDARuntimeError``
  (``cudaErrorInvalidValue``). CUDA documents a base pointer only; given an interior one, drivers have been seen to
  return the handle of the whole allocation, so the peer silently maps the base: the stand-in makes that mistake
  loud (a memory-pool array is an offset in a larger allocation: send its offset beside the handle).
- :func:`ipcOpenMemHandle` maps the named memory through ``/proc/<pid>/fd/<fd>`` (any process of the same user
  on the same kernel: the virtual cluster's network namespaces share it) and returns the address. A handle made
  by this very process is refused as CUDA refuses it (``cudaErrorDeviceUninitialized``, "invalid device
  context"); one from another node (another device UUID) or malformed is ``cudaErrorInvalidValue``; one whose
  exporter is gone or freed the memory is ``cudaErrorMapBufferObjectFailed``.
- :func:`ipcCloseMemHandle` closes it: the address no longer names memory. The pages stay mapped while a stand-in
  array still views them (where a GPU would fault on an illegal address), then go.

Arrays over such memory are built as cupy builds them (``ndarray(shape, dtype, memptr=MemoryPointer(mem, 0))``);
the array keeps its :class:`MemoryPointer`, hence its memory and the memory's owner, alive, as cupy's does.
"""
from __future__ import annotations

import ctypes
import mmap
import operator
import os
import struct
import weakref

import numpy as np

from . import cuda

__all__ = ["CUDARuntimeError", "BaseMemory", "Memory", "UnownedMemory", "MemoryPointer", "cudaIpcMemLazyEnablePeerAccess",
           "ipcGetMemHandle", "ipcOpenMemHandle", "ipcCloseMemHandle", "host_bytes", "over_pointer", "IPC_HANDLE_BYTES"]

#: cupy's names and words for the CUDA runtime errors the stand-in raises (``cudaGetErrorName``/``String``)
_ERRORS = {1: ("cudaErrorInvalidValue", "invalid argument"), 2: ("cudaErrorMemoryAllocation", "out of memory"),
           201: ("cudaErrorDeviceUninitialized", "invalid device context"),
           205: ("cudaErrorMapBufferObjectFailed", "mapping of buffer object failed")}
_INVALID_VALUE, _OUT_OF_MEMORY, _INVALID_CONTEXT, _MAP_FAILED = 1, 2, 201, 205
cudaIpcMemLazyEnablePeerAccess = 1  # noqa: N816 - cupy's name
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_MAGIC = b"dlfgipc1"
_HANDLE = struct.Struct("<8s16sqqqqq")  # magic, device UUID, pid, fd, size, inode, device number of the file
_NAME = "distlab.fakegpu.Memory"


class CUDARuntimeError(RuntimeError):
    """cupy's ``cupy_backends.cuda.api.runtime.CUDARuntimeError``: ``status`` and ``"<name>: <string>"``."""

    def __init__(self, status):
        self.status = status
        name, words = _ERRORS.get(status, ("unrecognized error code", "unrecognized error code"))
        super().__init__(f"{name}: {words}")

    def __reduce__(self):
        return (type(self), (self.status,))


class BaseMemory:
    """Memory on a device: ``ptr`` (its address), ``size`` (bytes), ``device_id``."""

    ptr = 0
    size = 0
    device_id = 0

    def __int__(self):
        return self.ptr

    @property
    def device(self):
        return cuda.Device(self.device_id)


class Memory(BaseMemory):
    """``Memory(size)``: a dedicated allocation of ``size`` bytes, another process can map (see the module
    docstring); freed when collected, as cupy's (``ptr`` 0 for size 0)."""

    def __init__(self, size):
        self.size = _size_t(size)
        self.device_id = cuda.runtime.getDevice()
        self.ptr = 0
        if self.size == 0:
            return
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, self.size)  # the pages now: a full memory fails here, not later with SIGBUS
            mapping = mmap.mmap(fd, self.size)
        except OSError:
            os.close(fd)
            raise CUDARuntimeError(_OUT_OF_MEMORY) from None
        self._fd = fd
        self._host = _over(mapping, self.size)
        self.ptr = _address(self._host)
        _allocations[self.ptr] = weakref.ref(self)
        _register(self.ptr, self._host)
        weakref.finalize(self, _free, self.ptr, fd)

    def __repr__(self):
        return f"<Memory {self.ptr:#x} size={self.size} device={self.device_id}>"


class UnownedMemory(BaseMemory):
    """``UnownedMemory(ptr, size, owner, device_id=-1)``: memory allocated elsewhere (an opened IPC handle, say),
    keeping ``owner`` alive; ``device_id`` -1 is the current device."""

    def __init__(self, ptr, size, owner, device_id=-1):
        ptr, size, device_id = _int(ptr), _size_t(size), _int(device_id)
        if device_id < 0:
            if ptr == 0:
                raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
            device_id = cuda.runtime.getDevice()
        self.size = size
        self.device_id = device_id
        self.ptr = ptr
        self._owner = owner


class MemoryPointer:
    """``MemoryPointer(mem, offset)``: the address ``mem.ptr + offset``, holding ``mem`` (what ``ndarray.data``
    is, and what ``ndarray(..., memptr=...)`` takes)."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem, offset):
        if not isinstance(mem, BaseMemory):
            raise TypeError(f"Argument 'mem' has incorrect type (expected cupy.cuda.memory.BaseMemory, "
                            f"got {type(mem).__name__})")
        offset = _int(offset)
        assert mem.ptr != 0 or offset == 0
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    def __int__(self):
        return self.ptr

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + _int(offset))

    __radd__ = __add__

    def __sub__(self, offset):
        return self + -_int(offset)

    @property
    def device(self):
        return cuda.Device(self.device_id)

    def __repr__(self):
        return f"<MemoryPointer {self.ptr:#x} device={self.device_id} mem={self.mem!r}>"


#: base address -> the live :class:`Memory` allocated there
_allocations: dict[int, weakref.ref] = {}
#: address -> (bytes, weak reference to the uint8 array over them): every Memory and every opened IPC handle
_mapped: dict[int, tuple[int, weakref.ref]] = {}
#: address an IPC handle was opened at -> the uint8 array over the mapping, until ipcCloseMemHandle
_opened: dict[int, np.ndarray] = {}


def ipcGetMemHandle(devPtr):  # noqa: N802, N803 - cupy's names
    """The 64-byte handle of the :class:`Memory` whose base address is ``devPtr`` (see the module docstring)."""
    ptr = _int(devPtr)
    ref = _allocations.get(ptr)
    memory = ref() if ref is not None else None
    if memory is None:
        raise CUDARuntimeError(_INVALID_VALUE)
    info = os.fstat(memory._fd)
    uuid = cuda.runtime.getDeviceProperties(memory.device_id)["uuid"]
    return _HANDLE.pack(_MAGIC, uuid, os.getpid(), memory._fd, memory.size, info.st_ino, info.st_dev).ljust(
        IPC_HANDLE_BYTES, b"\0")


def ipcOpenMemHandle(handle, flags=cudaIpcMemLazyEnablePeerAccess):  # noqa: N802
    """Map the memory another process's :func:`ipcGetMemHandle` named; its address here."""
    if type(handle) is not bytes:
        raise TypeError(f"Argument 'handle' has incorrect type (expected bytes, got {type(handle).__name__})")
    if len(handle) < IPC_HANDLE_BYTES:
        raise IndexError(f"not enough values found during array assignment, expected {IPC_HANDLE_BYTES}, "
                         f"got {len(handle)}")
    if len(handle) > IPC_HANDLE_BYTES:
        raise IndexError(f"too many values found during array assignment, expected {IPC_HANDLE_BYTES}")
    if _int(flags) != cudaIpcMemLazyEnablePeerAccess:
        raise CUDARuntimeError(_INVALID_VALUE)
    magic, uuid, pid, fd, size, inode, device = _HANDLE.unpack_from(handle)
    here = {cuda.runtime.getDeviceProperties(i)["uuid"] for i in range(cuda.runtime.getDeviceCount())}
    if magic != _MAGIC or uuid not in here or size <= 0 or handle[_HANDLE.size:].strip(b"\0"):
        raise CUDARuntimeError(_INVALID_VALUE)
    if pid == os.getpid():
        raise CUDARuntimeError(_INVALID_CONTEXT)  # CUDA opens no handle in the process that made it
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # the exporter is gone, or closed the descriptor when it freed the memory
        raise CUDARuntimeError(_MAP_FAILED) from None
    try:
        info = os.fstat(opened)
        if (info.st_ino, info.st_dev) != (inode, device) or info.st_size != size:  # pid or fd reused meanwhile
            raise CUDARuntimeError(_MAP_FAILED)
        host = _over(mmap.mmap(opened, size), size)
    finally:
        os.close(opened)  # the mapping holds the file from now on
    ptr = _address(host)
    _opened[ptr] = host
    _register(ptr, host)
    return ptr


def ipcCloseMemHandle(devPtr):  # noqa: N802, N803
    """Close what :func:`ipcOpenMemHandle` opened at ``devPtr`` (unmapped once no stand-in array views it)."""
    ptr = _int(devPtr)
    if _opened.pop(ptr, None) is None:
        raise CUDARuntimeError(_INVALID_VALUE)
    _mapped.pop(ptr, None)


def host_bytes(ptr: int, nbytes: int):
    """The ``nbytes`` bytes at ``ptr`` as a uint8 view, if they lie inside a live :class:`Memory` or an opened
    IPC handle; else None."""
    for start, (length, ref) in list(_mapped.items()):
        host = ref()
        if host is not None and start <= ptr and ptr + nbytes <= start + length:
            return host[ptr - start:ptr - start + nbytes]
    return None


class _Span:
    """Raw bytes at an address as numpy sees them, holding what keeps them mapped (an array over it keeps it)."""

    __slots__ = ("__array_interface__", "keep")

    def __init__(self, ptr: int, nbytes: int, keep):
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.keep = keep


def over_pointer(ptr: int, nbytes: int, keep) -> np.ndarray:
    """A uint8 array over ``nbytes`` at ``ptr`` that keeps ``keep`` alive (the caller checked the range)."""
    return np.asarray(_Span(ptr, nbytes, keep))


def _over(mapping: mmap.mmap, nbytes: int) -> np.ndarray:
    """A uint8 array over a whole mapping, holding it: the pages are unmapped when the last view goes."""
    view = ctypes.c_char.from_buffer(mapping)  # only to read the address: released at once, so nothing pins it
    ptr = ctypes.addressof(view)
    del view
    return over_pointer(ptr, nbytes, mapping)


def _address(host: np.ndarray) -> int:
    return host.__array_interface__["data"][0]


def _register(ptr: int, host: np.ndarray) -> None:
    _mapped[ptr] = (host.size, weakref.ref(host, lambda ref, ptr=ptr: _forget(ptr, ref)))


def _forget(ptr: int, ref) -> None:
    known = _mapped.get(ptr)
    if known is not None and known[1] is ref:
        del _mapped[ptr]


def _free(ptr: int, fd: int) -> None:
    """A :class:`Memory` was collected: its address names nothing now; its pages go with the last view."""
    os.close(fd)
    _allocations.pop(ptr, None)
    _mapped.pop(ptr, None)


def _int(value) -> int:
    """An integer argument as Cython converts one (``intptr_t``, ``int``): anything with ``__index__``."""
    if not hasattr(value, "__index__"):
        raise TypeError("an integer is required")
    return operator.index(value)


def _size_t(value) -> int:
    value = _int(value)
    if value < 0:
        raise OverflowError("can't convert negative value to size_t")
    return value
