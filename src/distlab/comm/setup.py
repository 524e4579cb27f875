"""Bounded setup: communicator creation and barriers that time out naming the ranks that never arrived.

``MPI_Comm_dup``, ``MPI_Comm_split`` and ``MPI_Barrier`` block until every rank has called them: one rank that
never arrives (a crashed start-up, a rank still loading data) hangs the others forever, saying nothing. Here each
rank first sends a *notice* to every peer (point to point, reserved tag ``COMM_SETUP_TAG``) and polls for theirs
under the deadline; the peers whose notice never came are the missing ranks. Notices are point to point, so they
name missing ranks on other nodes too, and cost nothing from a late rank (it has not sent its notice, which is
the information). Once every notice is in, every rank is at the same call, so the blocking MPI call that follows
(``Idup`` here, ``Split`` or the board's set-up in the caller) completes at once.

Other subsystems creating their own communicators call these too (``dup_within`` and ``barrier_within`` are the
same with a timeout the caller has already resolved, by :func:`distlab.futures.resolve_timeout`)::

    comm = bounded_dup(MPI.COMM_WORLD, "init_rpc", timeout)       # instead of MPI.COMM_WORLD.Dup()
    bounded_barrier(comm, "collectives.init()", timeout)           # before any blocking collective set-up

A timed-out setup leaves the communicator it ran on unusable (peers may later match its notices or its pending
``Idup``); it is an error to end a job on, not one to retry.
"""
from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

from .._wire import COMM_SETUP_TAG
from ..errors import DistTimeoutError
from ..futures import resolve_timeout
from .missing import listen_all

__all__ = ["bounded_barrier", "bounded_dup", "barrier_within", "dup_within", "bounded_wait"]

_orphans: list = []  # requests (and their buffers) of timed-out setups: MPI may still use the buffers


_deferred_frees: list = []  # communicators released by a finalizer in a thread MPI forbids (group's _release)


def free_deferred() -> None:
    """Free the communicators finalizers left behind (called from the main thread, when a group is made)."""
    while _deferred_frees and threading.current_thread() is threading.main_thread():
        _deferred_frees.pop().Free()


def release_comm(comm, now: bool = True) -> None:
    """Free ``comm`` from a finalizer: now when this thread may call MPI (the main thread, or any thread under
    ``MPI_THREAD_MULTIPLE``) and ``now`` allows it, else when the main thread next makes a group."""
    if MPI.Is_finalized():
        return
    if now and (threading.current_thread() is threading.main_thread()
                or MPI.Query_thread() == MPI.THREAD_MULTIPLE):
        comm.Free()
    else:
        _deferred_frees.append(comm)


def bounded_barrier(comm, what: str, timeout=None, check: int = 0) -> list[int]:
    """Wait until every rank of ``comm`` called this, or raise DistTimeoutError naming those that did not.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator (any: ``COMM_WORLD``, a group's, one of your own).
    what : str
        The operation, for the error (``"init_rpc"``).
    timeout : float, optional
        Seconds; default ``DISTLAB_TIMEOUT``.
    check : int, optional
        A word every rank sends to every other (say, a checksum of an argument that must agree).

    Returns
    -------
    list of int
        Every rank's ``check`` word, in rank order.
    """
    return barrier_within(comm, what, resolve_timeout(timeout, f"{what}: timeout"), check)


def barrier_within(comm, what: str, timeout: float, check: int = 0) -> list[int]:
    """:func:`bounded_barrier` with ``timeout`` already resolved (float seconds, checked)."""
    deadline = time.monotonic() + timeout
    notices = _post_notices(comm, check)
    _poll(lambda: MPI.Request.Testall(notices.requests), deadline,
          lambda: _setup_timeout(comm, what, timeout, notices))
    return notices.checks()


def bounded_dup(comm, what: str, timeout=None):
    """``comm.Dup()`` under a deadline: a DistTimeoutError naming the ranks that never arrived, not a hang."""
    return dup_within(comm, what, resolve_timeout(timeout, f"{what}: timeout"))


def dup_within(comm, what: str, timeout: float):
    """:func:`bounded_dup` with ``timeout`` already resolved (float seconds, checked)."""
    deadline = time.monotonic() + timeout
    notices = _post_notices(comm, 0)
    _poll(lambda: MPI.Request.Testall(notices.requests), deadline,
          lambda: _setup_timeout(comm, what, timeout, notices))
    duplicate, request = comm.Idup()
    bounded_wait(request, f"{what} (MPI_Comm_idup)", comm, timeout, deadline)
    return duplicate


def bounded_wait(request, what: str, comm, timeout: float, deadline: float) -> None:
    """Complete one nonblocking set-up request of ``comm`` by ``deadline`` (every rank has arrived already)."""
    _poll(request.Test, deadline, lambda: _setup_timeout(comm, what, timeout, None))


class _Notices:
    """One notice sent to and expected from every peer: ``[sender rank, check word]``."""

    def __init__(self, comm, check: int):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peers = [p for p in range(self.size) if p != self.rank]
        self.inbox = np.full((self.size, 2), -1, dtype=np.int64)
        self.inbox[self.rank] = (self.rank, check)
        self.token = np.array([self.rank, check], dtype=np.int64)
        self.receives = [comm.Irecv(self.inbox[p], source=p, tag=COMM_SETUP_TAG) for p in self.peers]
        self.sends = [comm.Isend(self.token, dest=p, tag=COMM_SETUP_TAG) for p in self.peers]
        self.requests = self.receives + self.sends

    def checks(self) -> list[int]:
        return [int(word) for word in self.inbox[:, 1]]

    def missing(self) -> list[int]:
        return [p for p, request in zip(self.peers, self.receives) if not request.Test()]

    def cancel(self) -> None:
        """Withdraw what the missing peers never matched (else MPI reports pending references at exit)."""
        pending = [request for request in self.requests if not request.Test()]
        for request in pending:
            request.Cancel()
        if not MPI.Request.Testall(pending):
            _orphans.append(self)  # not yet withdrawn: MPI may still use the buffers


def _post_notices(comm, check: int) -> _Notices:
    if comm == MPI.COMM_NULL:
        raise ValueError("cannot set up over MPI.COMM_NULL")
    return _Notices(comm, check)


def _poll(test, deadline: float, on_timeout) -> None:
    """Poll ``test()`` until True; past ``deadline`` call ``on_timeout()`` (which raises). Setup is not hot."""
    pause = 0.0
    spin_until = time.monotonic() + 0.005
    while not test():
        now = time.monotonic()
        if now >= deadline:
            on_timeout()
        if now > spin_until:
            listen_all()  # a peer of one of this rank's groups may be asking where this rank is
            pause = min(max(pause * 2, 2e-5), 1e-3)
            time.sleep(pause)


def _setup_timeout(comm, what: str, timeout: float, notices) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if notices is None:
        missing, detail = [], "every rank arrived but MPI did not complete the call"
    else:
        missing = notices.missing()
        detail = f"ranks {missing} have not entered it" if missing else "every rank arrived (too late)"
        notices.cancel()
    label = comm.Get_name() or "communicator"
    raise DistTimeoutError(
        f"{what} timed out after {timeout:g} s on rank {rank} of {label} (size {size}): {detail}. Raise "
        f"DISTLAB_TIMEOUT to wait longer; every rank must call it.",
        op=what, seq=0, name=None, missing_ranks=missing, timeout=timeout)
