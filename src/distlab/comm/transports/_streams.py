"""Stream ordering shared by the device transports (no-ops on the stand-in, whose kernels run at once).

A device collective is ordered after the work that produced its arrays by an event recorded on the caller's
current stream, never a device-wide synchronize; it runs on the transport's own streams; when it completes, the
caller's stream waits on its last event, so later kernels see the result while the host blocks only where a copy
must have landed before MPI reads host memory.
"""
from __future__ import annotations

__all__ = ["Streams"]


class Streams:
    """One transport's streams on one device module: ``down`` (device to host, and device work), ``up`` (host to
    device)."""

    def __init__(self, xp):
        self.xp = xp
        self.down = xp.cuda.Stream(non_blocking=True)
        self.up = xp.cuda.Stream(non_blocking=True)

    def after_caller(self):
        """Order the transport's streams after the caller's current stream; return the caller's stream."""
        caller = self.xp.cuda.get_current_stream()
        ready = self.xp.cuda.Event(disable_timing=True)
        ready.record(caller)
        self.down.wait_event(ready)
        self.up.wait_event(ready)
        return caller

    def record(self, stream):
        """A fresh event recorded on ``stream``."""
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def release_to(self, caller) -> None:
        """Make ``caller`` wait for everything queued on the transport's streams (the work's completion)."""
        caller.wait_event(self.record(self.down))
        caller.wait_event(self.record(self.up))
