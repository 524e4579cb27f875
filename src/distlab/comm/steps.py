"""The steps every call of a process group takes: number it, post its arrival, issue it, wait for it.

:class:`GroupSteps` is an object: each :class:`~distlab.comm.ProcessGroup` owns one, and so does its device
transport (the group hands it over when it makes the transport, as c10d hands a ``Backend`` its store and
options). It holds the state those steps need (the communicator, the numbering, the arrival slot, the side
channel, the lock, whether the group is broken, the timeline) and nothing else; only its own methods change it.
The call families (:class:`~distlab.comm.operations.GroupOperations`, :class:`~distlab.comm.rooted.
RootedOperations`, :class:`~distlab.comm.exchange.ExchangeOperations`) reach it through :class:`Calls`, their
common base, which declares what they share with the group. Each call checks its arguments, then takes these
steps, so calls go one way: group -> the call families (or the transport) -> these steps ->
:mod:`~distlab.comm.work`.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from .._env import choice
from .._types import ReduceOp
from .._wire import COLLECTIVE_OPS, COMM_RESERVED_TAGS, FINGERPRINT_WORDS
from ..errors import CollectiveMismatchError, ProcessGroupBrokenError
from ..timeline import get_timeline, now_us
from .device import check_buffer, mpi_buffer
from .missing import SideChannel
from .reduce_ops import check_movable
from .work import IN_FLIGHT, Work, spin

if TYPE_CHECKING:
    from .pieces import PieceSize
    from .transports import Transport

__all__ = ["GroupSteps", "Calls", "check_rank", "check_tag", "movable", "debug_level"]

log = logging.getLogger("distlab.comm")
_OP_CODES = {name: code for code, name in enumerate(COLLECTIVE_OPS)}


def debug_level() -> str:
    """``DISTLAB_DEBUG``: ``OFF`` (default), ``INFO`` (log each collective) or ``DETAIL`` (check fingerprints)."""
    return choice("DISTLAB_DEBUG", "OFF", ("OFF", "INFO", "DETAIL"), upper=True)


class GroupSteps:
    """Numbering, arrival, issue and wait: what every collective and point-to-point call of one group runs.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The group's own communicator.
    name : str
        The group's name (errors, timeline lanes).
    timeout : float
        Seconds any wait may block (resolved and checked).
    node_keys : numpy.ndarray
        Every member's node key, by group rank.
    oversubscribed : bool
        Whether this rank's machine runs more ranks than it has cores (the poll loop yields then).
    board : distlab.comm.board.ArrivalBoard
        This node's arrival board (the slot this rank posts to).
    fingerprint : module
        The active ``fingerprint`` twin (``DISTLAB_DEBUG=DETAIL``'s checks).
    fingerprint_checks : bool, optional
        Whether each collective's fingerprint is compared across ranks first; default (None): under
        ``DISTLAB_DEBUG=DETAIL``.

    Attributes
    ----------
    seq : int
        The sequence number of the last collective entered (0: none yet).
    broken : str or None
        Why the group cannot be used any more (a timeout, ``destroy()``), else None.
    lock : threading.RLock
        Held while a thread drives this group's work (a wait holds it throughout).
    side : distlab.comm.missing.SideChannel
        Where the missing ranks of a timed-out wait are learnt.
    interrupt : callable or None
        What every wait calls between its polls once past its spin phase (None: nothing); what it raises ends
        the wait and breaks the group (:attr:`distlab.comm.ProcessGroup.interrupt` sets it).
    """

    def __init__(self, comm, name: str, timeout: float, node_keys, oversubscribed: bool, board, fingerprint,
                 fingerprint_checks: bool | None = None):
        self.comm = comm
        self.name = name
        self.timeout = timeout
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.node_keys = node_keys
        self.oversubscribed = oversubscribed
        self.side = SideChannel(comm, board)
        self.lock = threading.RLock()
        self.broken: str | None = None
        self.interrupt = None
        self.timeline = get_timeline()
        self.timeline_on = self.timeline.enabled
        level = debug_level()
        self.detail = level == "DETAIL" if fingerprint_checks is None else fingerprint_checks
        self.info = level == "INFO"
        self.fingerprint = fingerprint
        self.seq = 0
        self._slot = board.my_slot
        self._next_seq = itertools.count(1).__next__  # atomic under the GIL: no lock on the hot path

    # -- state ------------------------------------------------------------------------------------------------
    def next_seq(self) -> int:
        """Take the next sequence number without entering a collective (a test's way to put a rank out of step)."""
        self.seq = self._next_seq()
        return self.seq

    def check_usable(self) -> None:
        """Raise ProcessGroupBrokenError when the group timed out or was destroyed."""
        if self.broken:
            raise ProcessGroupBrokenError(
                f"process group {self.name!r} cannot be used: {self.broken}. Create a new group or restart.")

    def mark_broken(self, reason: str) -> None:
        """The group cannot be used any more (a wait timed out, or it was destroyed), because of ``reason``."""
        self.broken = reason

    def check_rank(self, rank, what: str) -> None:
        """A ValueError unless ``rank`` is a rank of this group."""
        check_rank(rank, self.size, self.name, what)

    # -- issuing operations ---------------------------------------------------------------------------------
    def enter(self, op: str, name, array=None, root: int = -1, reduce_op="", check: bool = True) -> int:
        """Number the collective, post arrival, and (DETAIL) check it matches on every rank (unless ``check`` is
        False: ``monitored_barrier`` carries its fingerprint in its own messages)."""
        if self.broken:
            self.check_usable()
        seq = self.seq = self._next_seq()
        self._slot[1] = _OP_CODES[op]
        self._slot[0] = seq
        if self.info:
            log.info("group %s rank %d: %s #%d %s", self.name, self.rank, op, seq, name or "")
        if self.detail and check:
            shape = None if array is None else array.shape
            dtype = None if array is None else array.dtype
            reduce_name = reduce_op.value if isinstance(reduce_op, ReduceOp) else reduce_op
            self._check_fingerprint(self.fingerprint.make_fingerprint(seq, op, shape, dtype, root, reduce_name),
                                    op, seq, name)
        return seq

    def _check_fingerprint(self, words, op: str, seq: int, name) -> None:
        table = np.empty((self.size, FINGERPRINT_WORDS), dtype=np.int64)

        def stages():
            yield self.comm.Iallgather(words, table)

        Work(self, op, seq, f"{name or op} (DETAIL fingerprint check)", table.nbytes, stages=stages()).wait()
        message = self.fingerprint.find_mismatch(table)
        if message is not None:
            where = f" ({name!r})" if name else ""
            raise CollectiveMismatchError(f"rank {self.rank}{where}: {message}", seq=seq,
                                          groups=self.fingerprint.fingerprint_groups(table))

    def issue(self, op: str, seq: int, name, nbytes: int, request, finish, result, async_op: bool,
              peer=None, start_us: float = 0.0):
        """Complete a one-request operation: return a Work (async) or wait here and return ``result``.

        The sync path makes no Work object: it is the hot path of small collectives.
        """
        if async_op:
            work = Work(self, op, seq, name, nbytes, request, finish, result, peer, start_us=start_us)
            IN_FLIGHT.add(work)
            return work
        if not request.Test():
            timeout = self.timeout
            spin(self, request.Test, time.monotonic() + timeout, timeout, op, seq, name, nbytes, peer)
        if finish is not None:
            finish()
        if start_us:
            self.record(op, name, seq, nbytes, start_us)
        return result

    def run(self, op: str, seq: int, name, nbytes: int, stages, async_op: bool, peer=None):
        """Run a multi-request operation (``stages`` yields each request and returns the result): its Work
        when ``async_op``, else its result once it completed."""
        start_us = self.start()
        work = Work(self, op, seq, name, nbytes, peer=peer, stages=stages, start_us=start_us)
        if async_op:
            IN_FLIGHT.add(work)  # unless its stages already ran to the end
            return work
        return work.result()

    def start(self) -> float:
        """The timeline's clock now, when the timeline records (else 0.0: nothing is recorded)."""
        return now_us() if self.timeline_on else 0.0

    def record(self, op: str, name, seq: int, nbytes: int, start_us: float) -> None:
        """Put a completed operation on the timeline (from ``start_us`` to now)."""
        self.timeline.complete(f"{op} {name}" if name else op, start_us, cat="comm", lane=f"comm {self.name}",
                               args={"seq": seq, "bytes": nbytes, "op": op})

    def in_flight(self) -> list:
        """This group's async work not yet seen complete, in issue order."""
        return IN_FLIGHT.of(self)

    def abandon(self, reason: str) -> None:
        """Break the group and fail its work in flight (``destroy()``): MPI may still complete it in the
        background, so its buffers are kept alive until the process ends."""
        self.broken = reason
        IN_FLIGHT.abandon(self, lambda work: ProcessGroupBrokenError(
            f"{work.op} #{work.seq} on process group {self.name!r} was still in flight when the group was "
            f"destroyed"))


class Calls:
    """The base of the call families: what they share with the group that combines them, declared here.

    :class:`~distlab.comm.ProcessGroup` sets these when it is made; the families read nothing else of it.
    """

    rank: int
    size: int
    comm: object
    name: str
    _steps: GroupSteps
    _transport: "Transport | None"  # the group's device transport (None: the plain path)
    _arenas: list  # weak references to the shared-memory arenas whose arrays allreduce reduces in place
    _pieces: "PieceSize"  # how large allreduces across nodes are cut (distlab.comm.pieces)


# -- argument checks (shared by the call families and the module functions) ---------------------------------------
def check_rank(rank, size: int, group_name: str, what: str) -> None:
    """A ValueError unless ``rank`` is an int in ``[0, size)`` (a rank of group ``group_name``)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
        raise ValueError(f"{what}={rank!r} is not a rank of group {group_name!r} (size {size})")


def check_tag(tag, what: str) -> None:
    """A ValueError unless ``tag`` is an int below distlab's reserved tags."""
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < COMM_RESERVED_TAGS.start:
        raise ValueError(f"{what}: tag={tag!r} must be an int in [0, {COMM_RESERVED_TAGS.start - 1}] (tags "
                         f"{COMM_RESERVED_TAGS.start}-{COMM_RESERVED_TAGS.stop - 1} are reserved by distlab)")


def movable(array, what: str, name, stage: bool = True):
    """``mpi_buffer`` after the dtype check; ml_dtypes arrays travel as their bits. Without ``stage``, only the
    checks (``check_buffer``), for a call whose transport may yet take the array: ``(None, None)``."""
    dtype = getattr(array, "dtype", None)
    if dtype is not None:
        check_movable(dtype, what, name)
    if not stage:
        check_buffer(array, what)
        return None, None
    buf, copy_back = mpi_buffer(array, what)
    if dtype is not None and dtype.kind == "V":
        buf = buf.view(np.uint8)
    return buf, copy_back
