"""``cupy.cuda`` for the stand-in: streams, events and the device, keeping cupy's calling shape.

The stand-in's kernels run synchronously on the host, so a kernel's wait is already satisfied; what matters is
that device code calls these the way it would call cupy's (a stream as a context manager,
``Event.record(stream)``, ``stream.wait_event(event)``), and that each synchronisation is counted like a transfer
(kind ``"synchronize"``). The one device work that does not finish at once is a collective of the stand-in NCCL
(:mod:`distlab.fakegpu._nccl`, which the package sets here as ``cuda.nccl``), which runs until every member has
issued it: it is queued (:func:`distlab.fakegpu._queue.enqueue`) on the stream it was issued on, an event recorded after it is ``done``
only once it completed (as ``cudaEventQuery``), a stream that waits on that event inherits it, and a synchronize
waits for it, bounded by ``DISTLAB_TIMEOUT`` (a GPU would hang there; the stand-in raises TimeoutError).

Devices: one (id 0) unless ``DISTLAB_FAKEGPU_DEVICES=N`` presents ``N``; a process picks its own as on a GPU
(``Device(local_rank).use()``), ``runtime.getDeviceProperties(i)["uuid"]`` tells apart every (node, device), and
distinct devices of one process reach each other (``deviceCanAccessPeer``). Memory is the host's whatever the
device: what several devices let a test show is which transport the placement picks and that each rank's NCCL
communicator is on a device of its own.
"""
from __future__ import annotations

import itertools

from . import _queue, _transfers

__all__ = ["Stream", "ExternalStream", "Event", "Device", "get_current_stream", "get_elapsed_time",
           "is_available", "runtime"]

_ptrs = itertools.count(0x1000)
_state: dict = {"device": 0}
_current: list = []


class _BaseStream:
    """What every stream has (cupy's ``_BaseStream``): ``ptr`` and ``device_id``; ``with stream:`` makes it
    current."""

    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc):
        _current.pop()

    def use(self):
        _current[:] = [self]
        return self

    @property
    def done(self) -> bool:
        return not _queue.queued_on(self.ptr)

    @property
    def is_non_blocking(self) -> bool:
        return self._non_blocking

    def synchronize(self) -> None:
        _transfers.count("synchronize")
        _queue.wait_for(_queue.queued_on(self.ptr), f"synchronize of {self!r}")

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        if not isinstance(event, Event):
            raise TypeError(f"wait_event takes an Event, got {type(event).__name__}")
        for work in _queue.running(event._after):
            _queue.enqueue(self.ptr, work)

    def __eq__(self, other):
        return isinstance(other, _BaseStream) and other.ptr == self.ptr

    def __hash__(self):
        return self.ptr

    def __repr__(self):
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"


class Stream(_BaseStream):
    """A CUDA stream (no-op), as ``cupy.cuda.Stream(null=False, non_blocking=False, ptds=False,
    priority=None)``; ``Stream.null`` is the default stream."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        super().__init__(0 if null else next(_ptrs), -1 if null else _state["device"])
        self._non_blocking = bool(non_blocking)


Stream.null = Stream(null=True)


class ExternalStream(_BaseStream):
    """A stream made elsewhere, known by its pointer (``cupy.cuda.ExternalStream(ptr, device_id=-1)``)."""

    def __init__(self, ptr: int, device_id: int = -1):
        super().__init__(ptr, device_id)
        self._non_blocking = False


def get_current_stream(device_id: int = -1) -> Stream:
    """The stream device work is queued on now."""
    return _current[-1] if _current else Stream.null


class Event:
    """A CUDA event (no-op): ``record(stream)`` marks a point in the stream; ``synchronize()`` waits for it.

    An interprocess event must disable timing, or cupy refuses it (CUDA's ``cudaEventCreateWithFlags`` would)."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")  # cupy's words
        self.ptr = next(_ptrs)
        self._recorded_on = None
        self._after: list = []  # the collectives queued on the stream when it was recorded

    def record(self, stream=None) -> None:
        self._recorded_on = get_current_stream() if stream is None else stream
        self._after = _queue.queued_on(self._recorded_on.ptr)

    def synchronize(self) -> None:
        _transfers.count("synchronize")
        _queue.wait_for(self._after, "Event.synchronize")
        self._after = []

    @property
    def done(self) -> bool:
        self._after = _queue.running(self._after)
        return not self._after


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two recorded events (always 0.0 on the stand-in)."""
    if start_event._recorded_on is None or end_event._recorded_on is None:
        raise RuntimeError("get_elapsed_time: both events must be recorded")
    return 0.0


class Device:
    """A "GPU" of the stand-in: ids ``0 .. getDeviceCount() - 1`` (one unless ``DISTLAB_FAKEGPU_DEVICES`` says
    more); ``use()`` makes it this process's current device, ``with Device(i):`` for a block, as cupy's."""

    def __init__(self, device=None):
        self.id = _state["device"] if device is None else _checked(device)

    compute_capability = "90"

    def synchronize(self) -> None:
        _transfers.count("synchronize")

    def use(self):
        _state["device"] = self.id
        return self

    def __enter__(self):
        _state.setdefault("before", []).append(_state["device"])
        _state["device"] = self.id
        return self

    def __exit__(self, *exc):
        _state["device"] = _state["before"].pop()

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


_DEVICES_VAR = "DISTLAB_FAKEGPU_DEVICES"


def _device_count() -> int:
    import os

    value = os.environ.get(_DEVICES_VAR, "").strip()
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"{_DEVICES_VAR}={value!r}: expected a positive number of stand-in devices")
    return int(value) if value else 1


def _checked(device) -> int:
    index, count = int(device), _device_count()
    if not 0 <= index < count:
        raise ValueError(f"the stand-in has {count} device{'s' if count > 1 else ''} (0 .. {count - 1}; "
                         f"{_DEVICES_VAR} sets how many), not {index}")
    return index


def _node() -> str:
    """This process's node as the stand-in's UUIDs see it: the host, and the simulated node where
    ``DISTLAB_RANKS_PER_NODE`` makes several of one host (ranks on one simulated node share its devices)."""
    import os
    import socket

    per_node = os.environ.get("DISTLAB_RANKS_PER_NODE", "").strip()
    node = socket.gethostname()
    if per_node.isdigit() and int(per_node) > 0:
        from mpi4py import MPI

        if MPI.Is_initialized():
            node += f":{MPI.COMM_WORLD.Get_rank() // int(per_node)}"
    return node


def is_available() -> bool:
    return True


class runtime:  # noqa: N801 - cupy.cuda.runtime is a module
    """The parts of ``cupy.cuda.runtime`` device code asks."""

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - cupy's name
        return _device_count()

    @staticmethod
    def getDevice() -> int:  # noqa: N802
        return _state["device"]

    @staticmethod
    def setDevice(device: int) -> None:  # noqa: N802
        _state["device"] = _checked(device)

    @staticmethod
    def getDeviceProperties(device: int) -> dict:  # noqa: N802
        """cupy's dict of ``cudaDeviceProp``: the name and a 16-byte ``uuid`` distinct per (node, device)."""
        import hashlib

        index = _checked(device)
        uuid = hashlib.blake2b(f"distlab.fakegpu:{_node()}:{index}".encode(), digest_size=16).digest()
        return {"name": b"distlab.fakegpu", "uuid": uuid, "major": 9, "minor": 0}

    @staticmethod
    def deviceCanAccessPeer(device: int, peerDevice: int) -> int:  # noqa: N802, N803 - cupy's names
        """1 for two distinct devices of this process (all stand-in memory is the host's), as NVLink peers."""
        return int(_checked(device) != _checked(peerDevice))

    @staticmethod
    def deviceSynchronize() -> None:  # noqa: N802
        _transfers.count("synchronize")
