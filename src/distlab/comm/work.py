"""Operations in flight: :class:`Work`, their one owner :class:`InFlight`, the poll loop every wait runs, and
:func:`progress`.

MPI moves a nonblocking operation only while some MPI call runs on the rank, so distlab never sleeps inside one
blocking ``MPI_Wait`` (which could not time out either): it polls the request. The loop (:func:`spin`) spins
first (a large transfer needs every progress call), then backs off with short sleeps (a transfer across a network
link still needs progress calls to feed the socket: longer sleeps slowed a shaped link's allreduce); when the
machine runs more ranks than they have cores it also yields the core every fourth poll, or a spinning rank would
keep its peer from running the other half of the collective (docs/measurements.md, "Collectives: the poll
loop", has the figures and the commands). The
machine, not MPI's node, because virtual hosts on one kernel share its cores (:func:`~distlab.comm.board.node_keys`).
Past its spin phase a waiting rank reads the side channel's notes between sleeps (:mod:`distlab.comm.missing`)
and calls the group's ``interrupt`` (if its owner set one: it raises to end the wait), and near its deadline it
asks the other nodes where their ranks are.

A Work belongs to a group's :class:`~distlab.comm.steps.GroupSteps` (``work.steps``), which it reads (the lock,
the timeout, the side channel) and tells when a timeout breaks the group; the async work of every group is kept by
one :class:`InFlight` (:data:`IN_FLIGHT`), the only object that adds or removes it.
"""
from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

from mpi4py import MPI

from ..errors import DistTimeoutError, ProcessFailedError
from ..futures import Future, resolve_timeout
from .missing import ask_lead, listen_all, operation_label, timeout_error
from .ulfm import as_failure

if TYPE_CHECKING:
    from .steps import GroupSteps

__all__ = ["Work", "InFlight", "IN_FLIGHT", "spin", "progress", "StatusRequest"]

SPIN_SECONDS = 0.01  # busy-poll this long before backing off (large transfers need every progress call)
YIELD_EVERY = 3  # oversubscribed: yield the core every 4th poll (a mask: measured best of 1, 4 and 16)


class Work:
    """Handle on an operation in flight (``torch.distributed.Work``).

    Most operations are one MPI request plus an optional ``finish`` step run once it completes (divide for
    ``avg``, copy a staged device array back). Operations needing several requests in sequence (objects: sizes,
    then payload) pass ``stages``, a generator that yields each request and returns the result.
    ``wait`` and ``is_completed`` push the operation forward.
    """

    __slots__ = ("steps", "op", "seq", "name", "nbytes", "peer", "_stages", "_request", "_finish_step", "_done",
                 "_exception", "_result", "_future", "_start_us", "_ended", "_waited", "__weakref__")

    def __init__(self, steps: "GroupSteps", op: str, seq: int, name, nbytes: int, request=None, finish=None,
                 result=None, peer=None, stages=None, start_us: float = 0.0):
        self.steps = steps
        self.op = op
        self.seq = seq
        self.name = name
        self.nbytes = nbytes
        self.peer = peer
        self._stages = stages
        self._request = request
        self._finish_step = finish
        self._done = False
        self._exception: BaseException | None = None
        self._result = result
        self._future: Future | None = None
        self._start_us = start_us
        self._ended: tuple | None = None  # (exception or None,) once the last stage ran (advance: completed later)
        self._waited = False  # a wait() is polling its request (advance must leave it alone)
        if stages is not None:
            self._request_done()  # start the first stage

    def _request_done(self, complete: bool = True) -> None:
        """The current request completed: start the next stage, or run the finish step and complete; with
        ``complete`` False (:meth:`advance`) the ending is kept for the next poll to complete."""
        if self._ended is None:
            try:
                if self._stages is not None:
                    try:
                        self._request = self._stages.send(None)
                        return
                    except StopIteration as stop:
                        self._result = stop.value
                elif self._finish_step is not None:
                    self._finish_step()
                self._ended = _CLEAN
            except Exception as exc:  # noqa: BLE001 - a failed step fails the work; wait() raises it
                # (MPI refusing to post a stage's request because a process failed: ProcessFailedError naming it)
                self._ended = (as_failure(exc, self.steps.comm, self.op, self.steps.name),)
        if complete:
            self._complete(self._ended[0])
        else:
            self._request = _ENDED

    def _complete(self, exception) -> None:
        self._done, self._exception, self._request = True, exception, None
        IN_FLIGHT.done(self)
        if self._start_us:
            self.steps.record(self.op, self.name, self.seq, self.nbytes, self._start_us)
        if self._future is not None:
            self._complete_future()

    def _complete_future(self) -> None:
        if self._future.done():
            return
        if self._exception is not None:
            self._future.set_exception(self._exception)
        else:
            self._future.set_result(self._result)

    def _poll(self) -> bool:
        """Test the current request and move on while requests complete. True when done."""
        if self._done:
            return True
        with self.steps.lock:
            try:
                while not self._done and self._request.Test():
                    self._request_done()
            except MPI.Exception as exc:
                self._fail_or_raise(exc)
        return self._done

    def _fail_or_raise(self, exc) -> None:
        """Fail this work with ProcessFailedError when a failed process caused MPI's error ``exc`` (fault
        tolerance: its own wait raises it, not the poll of another operation that drove it); else raise ``exc``."""
        failure = as_failure(exc, self.steps.comm, self.op, self.steps.name)
        if failure is exc:
            raise exc
        self._complete(failure)

    def advance(self) -> bool:
        """Run the stages whose requests completed, but leave completing the work (and its future's callbacks,
        which may issue collectives) to its next poll; True once only that is left.

        What a wait on another operation of the same group does for the group's multi-step work (a device
        transport's arrive, reduce, done), so that a peer waiting on this rank's next step is not kept waiting,
        as MPI's own nonblocking collectives progress inside any MPI call; completing there could issue a
        callback's collectives in the middle of the wait, in another order than on the other ranks.
        """
        if self._done or self._ended is not None:
            return True
        if self._stages is None or self._waited:  # one MPI request progresses by itself; a wait drives its own
            return False
        self._drive_unless_locked(complete=False)
        return self._ended is not None

    def _try_poll(self) -> bool:
        """:meth:`_poll` unless another thread holds the group's lock (then False): what a wait calls for other
        groups, which must never block on their locks (two threads waiting, each on a group the other drives)."""
        if not self._done:
            self._drive_unless_locked(complete=True)
        return self._done

    def _drive_unless_locked(self, complete: bool) -> None:
        """Move on while requests complete, unless another thread holds the group's lock (``complete``: as
        :meth:`_request_done` takes it)."""
        lock = self.steps.lock
        if not lock.acquire(blocking=False):
            return
        try:
            while not self._done and (complete or self._ended is None) and self._request.Test():
                self._request_done(complete)
        except MPI.Exception as exc:
            self._fail_or_raise(exc)
        finally:
            lock.release()

    def is_completed(self) -> bool:
        """True once the operation finished (this call also drives it forward)."""
        return self._poll()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes; raise its error, or DistTimeoutError after ``timeout`` s.

        A timeout fails the operation (and its future) with that error: the group is broken from then on.
        """
        if not self._done:
            steps = self.steps
            timeout = resolve_timeout(timeout, "Work.wait(timeout)", steps.timeout)
            deadline = time.monotonic() + timeout
            # Hold the group's lock for the whole wait and poll the MPI request itself: no lock round trip per
            # poll (another thread's progress() simply finds this work done afterwards).
            with steps.lock:
                self._waited = True
                try:
                    while not self._done:
                        request = self._request
                        if not request.Test():
                            spin(steps, request.Test, deadline, timeout, self.op, self.seq, self.name,
                                 self.nbytes, self.peer)
                        self._request_done()
                except (DistTimeoutError, ProcessFailedError) as exc:
                    self._complete(exc)
                except MPI.Exception as exc:  # a failed process, under fault tolerance: ProcessFailedError
                    self._complete(as_failure(exc, steps.comm, self.op, steps.name))
                finally:
                    self._waited = False
        if self._exception is not None:
            raise self._exception
        return True

    def result(self):
        """The operation's output (the array it wrote, the gathered list, ...) once it completed."""
        self.wait()
        return self._result

    def exception(self) -> BaseException | None:
        """The error the operation ended with, if any."""
        return self._exception

    def get_future(self) -> Future:
        """A :class:`~distlab.futures.Future` completed with :meth:`result` (waiting on it drives the work)."""
        if self._future is None:
            description = f"{self.op} #{self.seq}" + (f" of {self.name!r}" if self.name else "")
            self._future = Future(driver=self._drive_future, description=description)
            if self._done:
                self._complete_future()
        return self._future

    def _drive_future(self, timeout: float | None) -> None:
        try:
            self.wait(timeout)
        except BaseException:  # noqa: BLE001 - a failed or timed-out work completed the future with its error
            if not self._done:
                raise

    def __repr__(self) -> str:
        return f"<Work {self.op} #{self.seq} {'done' if self._done else 'pending'}>"


class _Ended:
    """The request of a work whose stages :meth:`Work.advance` ran to their end: complete."""

    __slots__ = ()

    @staticmethod
    def Test() -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return True


_ENDED = _Ended()
_CLEAN = (None,)  # how a work that raised nothing ended


class StatusRequest:
    """An Irecv request whose Test fills a Status (mpi4py's Test takes it as an argument)."""

    __slots__ = ("request", "status")

    def __init__(self, request, status):
        self.request, self.status = request, status

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return self.request.Test(self.status)


class InFlight:
    """Every group's async work not yet seen complete, in issue order: the one object that owns work in flight.

    :meth:`GroupSteps.issue <distlab.comm.steps.GroupSteps.issue>` and ``run`` add a group's async work, a Work
    removes itself when it completes, and :meth:`progress` drives what is left. A group with work here stays alive
    until it completes, even if the user dropped the group: MPI is still writing into its buffers.
    """

    __slots__ = ("_works", "_abandoned")

    def __init__(self):
        self._works: dict = {}  # GroupSteps -> {Work: None}, in issue order
        self._abandoned: list = []  # work in flight when its group was destroyed (MPI may still use its buffers)

    def __bool__(self) -> bool:
        return bool(self._works)

    def add(self, work: Work) -> None:
        """Keep ``work`` until it completes (unless its stages already ran to the end)."""
        if not work._done:
            works = self._works.get(work.steps)
            if works is None:
                self._works[work.steps] = {work: None}
            else:
                works[work] = None

    def done(self, work: Work) -> None:
        """``work`` completed: forget it (and its group, once it has nothing left in flight)."""
        steps = work.steps
        works = self._works.get(steps)
        if works is not None:
            works.pop(work, None)
            if not works:
                del self._works[steps]

    def of(self, steps: "GroupSteps") -> list:
        """``steps``' work in flight, in issue order."""
        return list(self._works.get(steps, ()))

    def abandon(self, steps: "GroupSteps", error_for) -> None:
        """Fail ``steps``' work in flight with ``error_for(work)`` (its group was destroyed); keep the buffers."""
        for work in self.of(steps):
            self._abandoned.append(work)
            work._complete(error_for(work))
        self._works.pop(steps, None)

    def progress(self, skip=None) -> int:
        """See :func:`progress`."""
        pending = 0
        for steps in list(self._works):
            if steps is skip:  # its multi-step work moves on, completed only by the group's own polls (advance)
                for work in self.of(steps):
                    work.advance()
                continue
            works = self.of(steps)
            for index, work in enumerate(works):
                if not (work._poll() if skip is None else work._try_poll()):
                    # Operations of one group finish in the order they were issued, as a rule: the first one still
                    # running says the rest are too (testing them all was measurably slower per DDP gradient hook).
                    pending += len(works) - index
                    break
        return pending


#: The work in flight of every group of this process.
IN_FLIGHT = InFlight()


def spin(steps: "GroupSteps", test, deadline: float, timeout: float, op: str, seq: int, name, nbytes: int,
         peer) -> None:
    """Poll ``test()`` until True (MPI progresses only inside MPI calls); past ``deadline`` raise the timeout.

    The clock is read on every poll: a deadline read every 16th poll overshot by seconds when each poll was slow
    (a ``Test`` waiting for MPI's lock while another thread is inside MPI, a yield on a loaded machine). Reading
    it costs less per poll than ``Request.Test`` itself, and a collective that completes on its first test (most
    small ones) never enters this loop (docs/measurements.md, "Collectives: the poll loop"). Past
    the spin phase the loop reads the side channel's notes between sleeps; ``ask_lead`` before the deadline it
    asks the other nodes. A timeout breaks the group (the operation may still be in flight inside MPI).
    """
    side = steps.side
    now = time.monotonic()
    spin_until = now + SPIN_SECONDS
    ask_at = deadline - ask_lead(timeout) if side.remote else math.inf
    next_event = min(ask_at, deadline)  # one comparison per poll for both
    pause = 0.0
    polls = 0
    oversubscribed = steps.oversubscribed
    try:
        while not test():
            now = time.monotonic()
            if now >= next_event:
                if now >= deadline:
                    error = timeout_error(side, steps.name, timeout, op, seq, name, nbytes, peer)
                    steps.mark_broken(f"{operation_label(op, seq, name, nbytes)} timed out and may still be in "
                                      "flight")
                    raise error
                next_event = deadline
                side.waiting_seq = seq
                side.ask(seq)
            polls += 1
            if oversubscribed and not polls & YIELD_EVERY:
                os.sched_yield()
            if now > spin_until:
                side.waiting_seq = seq
                listen_all()
                if steps.interrupt is not None:
                    _interrupt(steps, op, seq, name)
                if IN_FLIGHT:
                    IN_FLIGHT.progress(skip=steps)  # other groups' multi-step work (a device transport's) needs driving
                pause = min(max(pause * 2, 2e-5), 2e-4)
                time.sleep(pause)
    except MPI.Exception as exc:  # a failed process, under fault tolerance: ProcessFailedError naming it
        failure = as_failure(exc, steps.comm, op, steps.name)
        if failure is exc:
            raise
        raise failure from exc
    finally:
        side.waiting_seq = 0


def _interrupt(steps: "GroupSteps", op: str, seq: int, name) -> None:
    """Call the group's ``interrupt``; if it raises, the wait ends with its error and the group is broken."""
    try:
        steps.interrupt()
    except BaseException:
        steps.mark_broken(f"{operation_label(op, seq, name)} was interrupted and may still be in flight")
        raise


def progress(skip=None) -> int:
    """Drive the outstanding async operations of every group; returns how many may still be pending. ``skip``'s
    (the steps of the group a wait is on) only move on (:meth:`Work.advance`), completed by the group's own polls.

    A wait past its spin phase calls it for the other groups: an operation of several steps (a device
    transport's arrive, reduce, done) moves only when polled, and a peer may be waiting on it to reach the
    operation this rank waits for, as MPI's own nonblocking collectives progress inside any MPI call.

    Each group's operations are tested in the order they were issued, up to the first one still running (any
    test moves all of MPI's traffic; the later ones are looked at once the earlier ones are done, or by their
    own ``wait``).
    """
    return IN_FLIGHT.progress(skip)
