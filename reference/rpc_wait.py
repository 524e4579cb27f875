"""How an RPC thread waits for a message, and who listens: the waiter and the listener's seat (reference twin).

Twinned with ``core/_rpc_wait.pyx``. The RPC agent (:mod:`distlab.rpc.messenger`) gives one :class:`Waiter` to its
listener and one to each thread that waits for the reply of its own ``rpc_sync``, and one :class:`Seat` to the
threads that take turns at listening.

**Why waiting is the question.** PyTorch's TensorPipe agent sleeps in epoll and the kernel wakes it when bytes
arrive. MPI has no such wake-up: a message is seen only by a thread that is inside an MPI call. A thread blocked in
``MPI_Mprobe`` sees it first (MPICH polls inside, with the GIL released), but it polls without end: an idle worker
burnt a whole core, and on a 2-core host two such pollers per rank starve the other rank. So every waiting thread
here (guarantee: *no thread polls without bound, and an idle worker costs almost no CPU*):

1. **polls** ``MPI_Improbe`` for ``spin`` seconds after its last activity (a message it matched, or a
   :meth:`Waiter.touch`: its worker sent something, so an answer may come soon), then
2. **sleeps** between polls, each sleep twice the last, up to ``sleep_max`` (up to ``IDLE_SLEEP_MAX`` once idle
   for ``IDLE_AFTER``: a worker idle that long wakes up less often, and a message to it waits at most 1% longer
   than the idleness lasted); a :meth:`Waiter.touch` from another thread ends the sleep at once, and
   :meth:`Waiter.wake` ends the wait (stop, or a deadline to check).

The core twin polls with the GIL released (it calls ``MPI_Improbe`` through the library mpi4py loaded) and gives
up the core at every poll (``sched_yield``), so the other threads, and the other ranks, get it when they need
it. This twin cannot: a Python thread that polls without sleeping keeps the GIL from every other thread (each
hand-off then waits for the interpreter's 5 ms switch interval). So where the core yields, the reference sleeps
its shortest sleep (on Linux, a sleep lasts some 50 us at least): it is several times slower per round trip and
says so in the benchmarks.

**Who listens.** A worker receives requests on one thread at a time, *the seat* (messages are handled in order).
The thread that holds the seat runs a request itself instead of handing it to another thread (a hand-off costs a
wake-up, tens of microseconds): it leaves the seat (:meth:`Seat.leave`), runs the handler, and comes back
(:meth:`Seat.come_back`). A handler may block (it calls another worker, or sleeps); so while the holder is away, a
*standby* thread watches the seat (:meth:`Seat.watch`) and takes it after ``takeover`` seconds: the worker then
listens again while the handler goes on, and the old holder, back too late, joins the pool. Mirrors the
leader/followers pattern (Schmidt et al., *Leader/Followers*, 2000); TensorPipe's agent hands every request to
its thread pool instead.
"""
from __future__ import annotations

import threading
import time

from distlab._common.rpc_wait import IDLE_AFTER, IDLE_SLEEP_MAX, SLEEP_FIRST, check_times
from distlab.comm.ulfm import failed_probe

__all__ = ["Waiter", "Seat"]


class Waiter:
    """Waits for messages of one source and tag on a communicator: polls, then sleeps with back-off.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The communicator the messages come on.
    spin : float
        Seconds of polling after the last activity before the first sleep.
    sleep_max : float
        The longest sleep between polls (seconds).

    Attributes
    ----------
    status : mpi4py.MPI.Status
        The status of the message :meth:`probe` matched last (its source, tag and byte count).
    message : mpi4py.MPI.Message
        That message, matched and not yet received (``message.Recv(buffer)`` receives it).
    path : str
        How this waiter calls MPI: ``"mpi4py"`` here (the core twin says ``"libmpi"`` when it calls the library
        itself, else ``"mpi4py"`` and why).
    """

    def __init__(self, comm, spin: float, sleep_max: float):
        from mpi4py import MPI

        check_times("Waiter", spin=spin, sleep_max=sleep_max)
        self.comm = comm
        self.status = MPI.Status()
        self.message = MPI.Message()
        self.spin = spin
        self.sleep_max = sleep_max
        self.path = "mpi4py"
        self._last = time.monotonic()   # the last activity: polling goes on for `spin` seconds after it
        self._sleeping = False
        self._woken = False
        self._event = threading.Event()  # ends a sleep: set by touch() and wake()

    @property
    def idle(self) -> bool:
        """True while the waiter sleeps between polls (no activity for ``spin`` seconds)."""
        return self._sleeping

    def probe(self, source: int, tag: int, timeout: float) -> bool:
        """Wait until a message from ``source`` with ``tag`` is matched (True), for at most ``timeout`` seconds.

        False when the time is up or :meth:`wake` was called: the caller checks its deadline, or whether its agent
        stops, and waits again. Under fault tolerance, a peer's death raises
        :class:`~distlab.errors.ProcessFailedError` naming it (:func:`distlab.comm.ulfm.failed_probe`).
        """
        comm, status = self.comm, self.status
        deadline = time.monotonic() + timeout
        delay = SLEEP_FIRST
        while True:
            try:
                message = comm.Improbe(source, tag, status)
            except Exception as exc:
                raise failed_probe(comm, exc) from None  # a dead peer: ProcessFailedError (fault tolerance)
            if message is not None:
                self.message = message
                self._last = time.monotonic()
                return True
            if self._woken:
                self._woken = False
                return False
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - self._last < self.spin:
                delay = SLEEP_FIRST  # polling: the shortest sleep (the core twin yields the core instead)
            self._sleeping = now - self._last >= self.spin
            if self._event.wait(min(delay, deadline - now)):
                self._event.clear()
                delay = SLEEP_FIRST  # touched or woken: poll again at once
            else:  # each sleep twice the last, up to sleep_max (IDLE_SLEEP_MAX if longer, once idle for good)
                longest = self.sleep_max if now - self._last < IDLE_AFTER else max(self.sleep_max, IDLE_SLEEP_MAX)
                delay = min(delay * 2, longest)
            self._sleeping = False

    def touch(self) -> None:
        """Activity on this worker (it sent a request): poll for ``spin`` seconds again; a sleep ends at once."""
        self._last = time.monotonic()
        if self._sleeping:
            self._event.set()

    def wake(self) -> None:
        """End the running (or the next) :meth:`probe` at once; it returns False."""
        self._woken = True
        self._event.set()


class Seat:
    """The listener's seat: which thread listens, whether it is away running a handler, and its standby.

    Parameters
    ----------
    takeover : float
        Seconds a holder may be away before the standby takes the seat.
    poll : float
        How often the standby looks at the seat (seconds).
    """

    def __init__(self, takeover: float, poll: float):
        check_times("Seat", positive=True, takeover=takeover, poll=poll)
        self.takeover = takeover
        self.poll = poll
        self.holder = None        # ident of the thread that holds the seat (None: free)
        self.away_since = None    # when the holder left to run a handler (None: it listens)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._left = threading.Event()  # set by leave(): the standby sleeps on it while the holder listens

    def take(self) -> bool:
        """Take the seat if it is free; True if this thread holds it now."""
        with self._lock:
            if self.holder is None:
                self.holder = threading.get_ident()
                self.away_since = None
            return self.holder == threading.get_ident()

    def listening(self) -> bool:
        """True on the thread that holds the seat while it listens (not away running a handler)."""
        return self.holder == threading.get_ident() and self.away_since is None

    def leave(self) -> None:
        """The holder leaves to run a handler that may block: the standby may take the seat after ``takeover``."""
        self.away_since = time.monotonic()
        self._left.set()  # wakes the standby, which sleeps while nobody is away

    def come_back(self) -> bool:
        """The holder is back: True if it still holds the seat (it listens on), False if the standby took it."""
        with self._lock:
            if self.holder == threading.get_ident():
                self.away_since = None
                return True
            return False

    def watch(self, timeout: float) -> bool:
        """The standby: wait until the holder has been away ``takeover`` seconds, then take the seat (True).

        False after ``timeout`` seconds, or at once after :meth:`stop`. While the holder listens, the standby
        sleeps until :meth:`leave` wakes it (an idle worker's standby costs no CPU); while the holder is away, it
        looks at the seat every ``poll`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= deadline:
                return False
            away = self.away_since
            if away is None:  # the holder listens: sleep until it leaves
                self._left.wait(deadline - now)
                self._left.clear()
                continue
            if now - away < self.takeover:
                self._stop.wait(min(self.poll, away + self.takeover - now, deadline - now))
                continue
            with self._lock:
                away = self.away_since   # still away that long (not back, or away again since)?
                if away is not None and time.monotonic() - away >= self.takeover:
                    self.holder = threading.get_ident()
                    self.away_since = None
                    return True
        return False

    def release(self) -> None:
        """Give the seat up (the holder stops listening)."""
        with self._lock:
            if self.holder == threading.get_ident():
                self.holder = None
                self.away_since = None

    def stop(self) -> None:
        """End every :meth:`watch`, now and later."""
        self._stop.set()
        self._left.set()
