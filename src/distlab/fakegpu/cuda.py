"""``cupy.cuda`` for the stand-in: streams, events and the device, keeping cupy's calling shape.

The stand-in's kernels run synchronously on the host, so a kernel's wait is already satisfied; what matters is
that device code calls these the way it would call cupy's (a stream as a context manager,
``Event.record(stream)``, ``stream.wait_event(event)``), and that each synchronisation is counted like a transfer
(kind ``"synchronize"``). The one device work that does not finish at once is a collective of the stand-in NCCL
(:mod:`distlab.fakegpu.nccl`, which the package sets here as ``cuda.nccl``), which runs until every member has
issued it: it is queued (:func:`enqueue`) on the stream it was issued on, an event recorded after it is ``done``
only once it completed (as ``cudaEventQuery``), a stream that waits on that event inherits it, and a synchronize
waits for it, bounded by ``DISTLAB_TIMEOUT`` (a GPU would hang there; the stand-in raises TimeoutError).
"""
from __future__ import annotations

import itertools
import time

from . import _transfers

__all__ = ["Stream", "ExternalStream", "Event", "Device", "get_current_stream", "get_elapsed_time",
           "is_available", "runtime", "enqueue", "wait_for"]

_ptrs = itertools.count(0x1000)
_current: list = []
_queued: dict[int, list] = {}  # stream pointer -> collectives still running on it (anything with ``Test()``)


def enqueue(stream_ptr: int, work) -> None:
    """Queue ``work`` (polled with ``work.Test()``, True once complete) on the stream ``stream_ptr``."""
    _queued.setdefault(int(stream_ptr), []).append(work)


def _running(works: list) -> list:
    """The works of ``works`` still running (testing them moves them forward)."""
    return [work for work in works if not work.Test()]


def _queued_on(ptr: int) -> list:
    works = _running(_queued.pop(ptr, []))
    if works:
        _queued[ptr] = works
    return works


def wait_for(works: list, what: str) -> None:
    """Block until ``works`` complete, at most ``DISTLAB_TIMEOUT`` seconds."""
    if not works:
        return
    from distlab.futures import resolve_timeout

    timeout = resolve_timeout(None, f"{what}: timeout")
    deadline = time.monotonic() + timeout
    while works:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(works)} NCCL collectives queued on it did not complete within "
                               f"{timeout:g} s (DISTLAB_TIMEOUT): a member never issued them")
        time.sleep(1e-4)
        works = _running(works)


class Stream:
    """A CUDA stream (no-op): ``with stream:`` makes it current; ``null`` is the default stream."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None):
        self.ptr = 0 if null else next(_ptrs) if ptr is None else ptr
        self.non_blocking = non_blocking

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
        return not _queued_on(self.ptr)

    def synchronize(self) -> None:
        _transfers.count("synchronize")
        wait_for(_queued_on(self.ptr), f"synchronize of {self!r}")

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        if not isinstance(event, Event):
            raise TypeError(f"wait_event takes an Event, got {type(event).__name__}")
        for work in _running(event.after):
            enqueue(self.ptr, work)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<Stream {self.ptr:#x}>"


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    """A stream made elsewhere, known by its pointer."""

    def __init__(self, ptr: int):
        super().__init__(ptr=ptr)


def get_current_stream() -> Stream:
    """The stream device work is queued on now."""
    return _current[-1] if _current else Stream.null


class Event:
    """A CUDA event (no-op): ``record(stream)`` marks a point in the stream; ``synchronize()`` waits for it."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.ptr = next(_ptrs)
        self.recorded_on = None
        self.after: list = []  # the collectives queued on the stream when it was recorded

    def record(self, stream=None) -> None:
        self.recorded_on = get_current_stream() if stream is None else stream
        self.after = _queued_on(self.recorded_on.ptr)

    def synchronize(self) -> None:
        _transfers.count("synchronize")
        wait_for(self.after, "Event.synchronize")
        self.after = []

    @property
    def done(self) -> bool:
        self.after = _running(self.after)
        return not self.after


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events (always 0.0 on the stand-in)."""
    if start.recorded_on is None or end.recorded_on is None:
        raise RuntimeError("get_elapsed_time: both events must be recorded")
    return 0.0


class Device:
    """The one "GPU" (id 0)."""

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise ValueError(f"the stand-in has one device (0), not {self.id}")

    compute_capability = "90"

    def synchronize(self) -> None:
        _transfers.count("synchronize")

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def is_available() -> bool:
    return True


class runtime:  # noqa: N801 - cupy.cuda.runtime is a module
    """The parts of ``cupy.cuda.runtime`` device code asks."""

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - cupy's name
        return 1

    @staticmethod
    def getDevice() -> int:  # noqa: N802
        return 0

    @staticmethod
    def deviceSynchronize() -> None:  # noqa: N802
        _transfers.count("synchronize")

