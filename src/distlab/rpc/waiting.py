"""How the RPC listener waits for messages: the adaptive wait (shared plumbing of :mod:`distlab.rpc`).

A listener blocked in ``MPI_Mprobe`` (GIL released, MPICH's progress engine polls in C) gives the fastest round
trip; ``MPI_Improbe`` polled from Python with back-off is several times slower, and spinning on ``Improbe`` makes
the caller wait for the GIL (docs/measurements.md, "RPC: how the listener waits", has the figures and the
command). But a blocking ``Mprobe`` busy-polls inside MPICH: an idle worker burnt a whole core. So (``DISTLAB_RPC_WAIT=adaptive``, the default; ``block`` keeps the
blocking probe throughout):

- *blocking*: ``Mprobe`` while there is traffic;
- *idle*: after ``IDLE_AFTER`` with no message and no answer awaited, the timeout thread sends the listener a
  ``wake`` message (:meth:`AdaptiveWait.maybe_go_idle`), and it polls ``Improbe`` with pauses on an Event (no
  spinning, back-off up to ``IDLE_SLEEP_MAX``), which a send from this worker or any arriving message ends;
- *streaming*: while other threads stream sends (rpc_async, remote) and nobody blocks in ``call_sync``, it
  polls with ``STREAM_PAUSE`` pauses: a listener in ``Mprobe`` holds MPICH's lock while it polls, and each
  ``MPI_Send`` of the streaming thread waited for it.

The caller always waits on a condition variable: only one Python thread ever waits in MPI, and nobody spin-polls.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .._env import choice

__all__ = ["AdaptiveWait", "IDLE_AFTER", "IDLE_SLEEP_MAX", "STREAM_WINDOW", "STREAM_PAUSE"]

IDLE_AFTER = 0.05        # no message and nothing awaited for this long -> idle mode
IDLE_SLEEP_MAX = 0.002   # longest pause between polls when idle (the wake-up latency of an idle worker)
STREAM_WINDOW = 0.001    # another thread sent within this -> poll with pauses (streaming mode)
STREAM_PAUSE = 5e-5      # pause between polls in streaming mode


class AdaptiveWait:
    """The listener's way of waiting, and what the other threads tell it.

    Parameters
    ----------
    tag : int
        The MPI tag of header messages.
    busy : callable
        ``busy() -> bool``: this worker awaits answers (the listener then never goes idle).
    send_wake : callable
        ``send_wake()``: send the listener a ``wake`` message (without blocking).
    """

    def __init__(self, tag: int, busy: Callable, send_wake: Callable):
        from mpi4py import MPI

        self._MPI = MPI
        self._tag = tag
        self._busy = busy
        self._send_wake = send_wake
        self.mode = choice("DISTLAB_RPC_WAIT", "adaptive", ("adaptive", "block"))
        self.adaptive = self.mode == "adaptive"
        self.idle = False               # the listener polls with pauses (idle mode)
        self.running = True
        self.listener_ident = None
        self.on_leave_idle: Callable = lambda: None  # the timeout thread resumes its idleness checks
        self._last_activity = time.monotonic()
        self._wake = threading.Event()  # set by a send to end an idle pause at once
        self._wake_sent = False         # a wake message to the listener is in flight
        self._last_send = 0.0           # monotonic time of the last send by a thread other than the listener
        self._sync_threads = set()      # threads blocked in call_sync (they want the lowest latency)
        self._streaming = False

    # -- what the other threads say ---------------------------------------------------------------------------
    def after_send(self) -> None:
        """A thread sent a request: note it for the streaming mode, and end an idle pause at once."""
        if threading.get_ident() != self.listener_ident:
            self._last_send = time.monotonic()
        if self.idle:
            self._wake.set()

    def sync_begin(self) -> int:
        """This thread is about to block in ``call_sync``: the listener goes back to its blocking probe."""
        ident = threading.get_ident()
        self._sync_threads.add(ident)
        if self._streaming:
            self._wake.set()
        return ident

    def sync_end(self, ident: int) -> None:
        self._sync_threads.discard(ident)

    # -- the listener -----------------------------------------------------------------------------------------
    def probe(self, comm, status):
        """Wait for the next header message and return it (matched, ``MPI_Message``)."""
        if self.adaptive:
            if self.idle:
                return self._probe_idle(comm, status)
            if not self._sync_threads and time.monotonic() - self._last_send < STREAM_WINDOW:
                return self._probe_streaming(comm, status)
        return comm.Mprobe(self._MPI.ANY_SOURCE, self._tag, status)

    def activity(self) -> None:
        """The listener received a message (not a wake-up)."""
        self._last_activity = time.monotonic()

    def woken(self) -> None:
        """The listener received the timeout thread's wake message: go idle unless something is awaited."""
        self._wake_sent = False
        if not self._busy() and time.monotonic() - self._last_activity >= IDLE_AFTER:
            self.idle = True

    def _probe_streaming(self, comm, status):
        wake = self._wake
        self._streaming = True
        try:
            while True:
                message = comm.Improbe(self._MPI.ANY_SOURCE, self._tag, status)
                if message is not None:
                    return message
                if self._sync_threads or time.monotonic() - self._last_send >= STREAM_WINDOW or wake.is_set():
                    wake.clear()
                    return comm.Mprobe(self._MPI.ANY_SOURCE, self._tag, status)
                wake.wait(STREAM_PAUSE)
        finally:
            self._streaming = False

    def _probe_idle(self, comm, status):
        delay = 0.0
        wake = self._wake
        while True:
            message = comm.Improbe(self._MPI.ANY_SOURCE, self._tag, status)
            if message is not None or self._busy() or wake.is_set():
                wake.clear()
                self.idle = False
                self.on_leave_idle()
                if message is not None:
                    return message
                return comm.Mprobe(self._MPI.ANY_SOURCE, self._tag, status)
            delay = min(max(delay * 2.0, 5e-5), IDLE_SLEEP_MAX)
            wake.wait(delay)

    # -- the timeout thread -----------------------------------------------------------------------------------
    def idle_interval(self):
        """How long the timeout thread may sleep before it checks idleness again (None: no check needed)."""
        return IDLE_AFTER if self.adaptive and not self.idle else None

    def maybe_go_idle(self) -> None:
        """After IDLE_AFTER without traffic, break the listener out of its busy-polling ``Mprobe`` (a wake
        message) so it can switch to idle polling."""
        if (not self.adaptive or self.idle or self._wake_sent or self._busy() or not self.running
                or time.monotonic() - self._last_activity < IDLE_AFTER):
            return
        self._wake_sent = True
        try:
            self._send_wake()
        except Exception:  # noqa: BLE001 - the agent is stopping
            self._wake_sent = False
