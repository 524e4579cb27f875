"""``ProcessGroup``: a group of ranks and its collectives, and the default group (:func:`world`, :func:`new_group`).

A group owns one MPI communicator (a duplicate of the one it was given), its node's arrival board, the
:class:`~distlab.comm.steps.GroupSteps` its calls take (numbering, arrival, issue, wait), and its device
transport (:mod:`distlab.comm.transports`), which it made with those steps. Its calls (the call families it
inherits) check their arguments, then take the steps: number themselves (the sequence number), post arrival on the
board, and hand MPI the array's own buffer, or hand device arrays to the transport.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from .. import _backend
from ..futures import resolve_timeout
from .board import ArrivalBoard, node_keys
from .exchange import ExchangeOperations
from .operations import GroupOperations
from .pieces import PieceSize
from .rooted import RootedOperations
from .setup import barrier_within, bounded_wait, dup_within, free_deferred, release_comm
from .shared import create_arena, layout
from .steps import GroupSteps, debug_level
from .transports import select as select_transport
from .ulfm import prepare as prepare_fault_tolerance

__all__ = ["ProcessGroup", "world", "new_group", "debug_level", "check_usable", "set_world"]


class ProcessGroup(GroupOperations, RootedOperations, ExchangeOperations):
    """A group of ranks running collectives together (``torch.distributed.ProcessGroup`` over MPI).

    Construction is collective over ``mpi_comm`` and bounded by ``timeout``: a rank that never arrives makes the
    others raise :class:`~distlab.errors.DistTimeoutError` naming it. A group is a context manager (``with``
    destroys it on exit); a group that is dropped releases its communicator when it is garbage-collected.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Intracomm, optional
        The communicator to run over; it is duplicated. Default ``MPI.COMM_WORLD``.
    timeout : float or datetime.timedelta, optional
        Seconds any wait may block; default ``DISTLAB_TIMEOUT`` (300). ``inf`` means no deadline; NaN, negative
        and 0 are refused (:func:`distlab.futures.check_timeout`).
    name : str, optional
        Used in error messages and timeline lanes.
    fingerprint_checks : bool, optional
        Whether each collective's fingerprint is compared across ranks before it is posted (a blocking allgather;
        see :doc:`/comm`). Default (None): when ``DISTLAB_DEBUG=DETAIL``. ``True`` checks regardless of the
        variable (every rank must agree). ``False`` keeps a group unchecked even under DETAIL,
        for a group whose collectives some rank issues out of step with another group's (a joined rank's
        SyncBatchNorm shadows: the check would make it wait for ranks that wait for it).

    Attributes
    ----------
    rank, size : int
        This process's rank in the group, and the group's size.
    comm : mpi4py.MPI.Intracomm
        The group's own communicator.
    device_comm : str
        How the group moves device arrays (``ipc``, ``nccl``, ``staged`` or ``mpi``), chosen when it was made from
        every rank's placement and ``DISTLAB_DEVICE_COMM`` (:mod:`distlab.comm.transports`).

    The group's :attr:`interrupt` is what every wait calls between its polls (the collectives engine sets it).
    """

    def __init__(self, mpi_comm=None, timeout: float | None = None, name: str | None = None,
                 fingerprint_checks: bool | None = None):
        timeout = resolve_timeout(timeout, "ProcessGroup(timeout)")
        if fingerprint_checks not in (None, True, False):
            raise TypeError(f"ProcessGroup(fingerprint_checks): True, False or None, got {fingerprint_checks!r}")
        free_deferred()
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        comm = dup_within(parent, f"ProcessGroup {name or 'world'!r} setup", timeout)
        # Every group over COMM_WORLD has the same node layout: asked of MPI once (all ranks took part).
        self._setup(comm, timeout, name, _world_node if parent == MPI.COMM_WORLD else None, fingerprint_checks)
        if parent == MPI.COMM_WORLD:
            _remember_world_node((self._steps.node_keys, self._steps.oversubscribed))

    def _setup(self, comm, timeout: float, name, node=None, fingerprint_checks=None) -> None:
        """Adopt ``comm`` (freed with the group): open the arrival board; ``node`` = a parent's node layout."""
        self.comm = comm
        self.name = name or "world"
        self.timeout = timeout
        try:
            prepare_fault_tolerance(comm)  # under fault tolerance: errors returned, not fatal
            deadline = time.monotonic() + timeout

            def wait(request, step: str) -> None:
                bounded_wait(request, f"ProcessGroup {self.name!r} setup ({step})", comm, timeout, deadline)

            keys, oversubscribed = node if node is not None else node_keys(comm, wait)
            board = ArrivalBoard(comm, keys, wait)
        except BaseException:
            comm.Free()
            raise
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        steps = self._steps = GroupSteps(comm, self.name, timeout, keys, oversubscribed, board,
                                         _backend.load("fingerprint"), fingerprint_checks)
        self._arenas = []  # shared-memory arenas whose arrays allreduce reduces in place
        self._pieces = PieceSize()
        if steps.info:
            _log_to_stderr(comm.Get_rank())
        try:
            self._transport, self.device_comm, why = select_transport(
                steps, lambda request, step: bounded_wait(request, f"ProcessGroup {self.name!r} setup ({step})",
                                                          comm, timeout, time.monotonic() + timeout))
        except BaseException:
            comm.Free()
            raise
        if steps.timeline_on:
            steps.timeline.instant(f"device transport {self.device_comm}", cat="comm", lane=f"comm {self.name}",
                                   args={"transport": self.device_comm, "why": why})
        # Released when the group's steps are collected (the group dropped, and its work in flight completed) or
        # the group is destroyed; must hold neither (a transport's own release, such as its NCCL communicator's,
        # holds only what it frees).
        release = self._transport.releaser() if self._transport is not None else None
        self._release = weakref.finalize(steps, _release, comm, steps.side, release)

    @property
    def node_keys(self):
        """Every member's node, by group rank, as an int64 array: a node's key is the smallest world rank on it
        (MPI's shared-memory split; ``DISTLAB_RANKS_PER_NODE`` simulates nodes). Read-only; Horovod's
        ``local_rank`` and ``cross_rank`` are computed from it."""
        keys = self._steps.node_keys.view()
        keys.flags.writeable = False
        return keys

    def shared_arena(self, nbytes: int):
        """Collective: ``nbytes`` of shared memory per rank, whose arrays :meth:`allreduce` reduces in place.

        Returns a :class:`~distlab.comm.shared.SharedArena` (take arrays with ``arena.array(offset, count,
        dtype)``), or None on every rank when the group spans several nodes, has one rank, or shared memory is
        off or full (see :mod:`distlab.comm.shared`). Arrays are reduced in place while the arena object lives:
        keep it as long as them (its memory lives as long as any array of it does).
        """
        arena = create_arena(self, nbytes)
        if arena is not None:
            self._arenas = [a for a in self._arenas if a() is not None] + [weakref.ref(arena)]
        return arena

    def shared_arrays(self, specs):
        """Collective: one shared-memory array per ``(count, dtype)`` of ``specs``, each cache-line aligned.

        Returns ``(arena, arrays)``, or None on every rank when :meth:`shared_arena` would.
        """
        starts, total = layout(specs)
        arena = self.shared_arena(total)  # collective even when this rank has nothing to place
        if arena is None:
            return None
        return arena, [arena.array(start, count, dtype) for start, (count, dtype) in zip(starts, specs)]

    def device_shared_arrays(self, specs):
        """Collective: zeroed device arrays, one per ``(count, dtype)`` of ``specs``, that every rank of the node
        maps (the ipc transport's), so :meth:`allreduce` reads and writes them where they are, with no copy in
        or out (what :meth:`shared_arrays` is for host arrays; DDP puts its device buckets there).

        Returns ``(memory, arrays)`` (keep ``memory`` as long as the arrays), or None on every rank when the
        group's device collectives do not go through the ipc transport or the ranks ask for different sizes.
        """
        return self._transport.shared_arrays(specs) if self._transport is not None else None

    @property
    def interrupt(self):
        """What every wait on this group calls between its polls once past its spin phase (None: nothing).

        It may raise to end the wait with that error, which leaves the group broken (the operation may still be in
        flight). The collectives engine sets it, to stop waiting for a peer whose engine failed. It is kept by the
        group's steps, which every wait reads.
        """
        return self._steps.interrupt

    @interrupt.setter
    def interrupt(self, check) -> None:
        if check is not None and not callable(check):
            raise TypeError(f"ProcessGroup.interrupt: a callable or None, got {check!r}")
        self._steps.interrupt = check

    # -- lifecycle ------------------------------------------------------------------------------------------
    def new_group(self, ranks, name=None, timeout=None):
        """Make a sub-group of ``ranks`` (every rank of this group must call it); None on non-members.

        Bounded by ``timeout`` (default: this group's): ranks that never call it are named in a
        :class:`~distlab.errors.DistTimeoutError`. Every rank must pass the same ``ranks``; a difference is a
        ValueError on every rank. The group is a context manager: ``with pg.new_group([0, 1]) as g:``.
        """
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"new_group: ranks {ranks} must be distinct ranks of group {self.name!r} "
                             f"(size {self.size})")
        self._steps.check_usable()
        timeout = resolve_timeout(timeout, "new_group(timeout)", self.timeout)
        what = f"new_group({ranks}) of group {self.name!r}"
        checks = barrier_within(self.comm, what, timeout, check=zlib.crc32(np.asarray(ranks, np.int64)))
        if len(set(checks)) > 1:
            mine = [r for r, c in enumerate(checks) if c == checks[self.rank]]
            others = [r for r, c in enumerate(checks) if c != checks[self.rank]]
            raise ValueError(f"{what}: ranks {others} passed a different list of ranks than ranks {mine}; every "
                             f"rank must pass the same list")
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        group = ProcessGroup.__new__(ProcessGroup)  # adopts sub (every rank is here: no second dup needed)
        steps = self._steps
        group._setup(sub, timeout, name or f"{self.name}{ranks}", (steps.node_keys[ranks], steps.oversubscribed))
        return group

    def destroy(self) -> None:
        """Release the group's communicator now; the group is unusable afterwards.

        Local: it waits for no peer, so it ends at once even when a peer is gone. Async work still in flight is
        failed with :class:`~distlab.errors.ProcessGroupBrokenError` (MPI may still complete it in the
        background; its buffers are kept alive until the process ends).
        """
        if not self._release.alive:
            return
        self._steps.abandon("it was destroyed")
        self._release()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} rank {self.rank}/{self.size} device {self.device_comm}>"


def _release(comm, side, transport_release=None) -> None:
    """Free a group's communicator, and its transport's resources (the finalizer of a dropped or destroyed group).

    Freeing a communicator is local in practice (MPICH and Open MPI release it without talking to peers), so a
    dropped group never waits for anyone; the board is a mapped file, unmapped with its last view. A finalizer may
    run in any thread, and in the middle of the group's own side-channel listen: without ``MPI_THREAD_MULTIPLE``
    (only the main thread may call MPI), or while the communicator is in use, the free waits for the next group
    the main thread creates.
    """
    if transport_release is not None:
        transport_release()
    release_comm(comm, now=side.close())


_world_node = None  # (node keys, oversubscribed) of COMM_WORLD, once a group over it was made


def _remember_world_node(node) -> None:
    global _world_node
    _world_node = node


def _log_to_stderr(rank: int) -> None:
    """DISTLAB_DEBUG=INFO: show distlab's INFO log on stderr, tagged with the rank (unless logging is set up)."""
    logger = logging.getLogger("distlab")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


_world: ProcessGroup | None = None
_world_lock = threading.Lock()


def world() -> ProcessGroup:
    """The default group: every rank of ``COMM_WORLD`` (created on first use; every rank must call it).

    A destroyed world group is replaced by a new one on the next call.
    """
    global _world
    group = _world
    if group is None or not group._release.alive:
        with _world_lock:
            if _world is None or not _world._release.alive:
                _world = ProcessGroup(name="world")
            group = _world
    return group


def set_world(group: ProcessGroup) -> None:
    """Make ``group`` the default group (what :func:`world` returns): the survivors' world after a failure
    (:func:`distlab.comm.recovery.rebuild`)."""
    global _world
    with _world_lock:
        _world = group


def new_group(ranks, name=None, timeout=None):
    """Sub-group of the world group (``torch.distributed.new_group``); every rank calls it, None on non-members."""
    return world().new_group(ranks, name=name, timeout=timeout)


def check_usable(group: ProcessGroup) -> None:
    """Raise ProcessGroupBrokenError when ``group`` timed out or was destroyed (what its every call checks first:
    for a caller that checks several calls before starting any, as ``batch_isend_irecv`` does)."""
    group._steps.check_usable()
