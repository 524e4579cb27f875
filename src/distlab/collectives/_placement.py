"""Where a large negotiated allreduce keeps its copy on one host: regions of the set's shared-memory arena.

On one host the process group reduces an array of a shared-memory arena in place, each rank summing its block
of every rank's copy (:mod:`distlab.comm.shared`), about twice as fast as MPI's copies through its own cells.
A negotiated allreduce must copy the caller's array anyway (the caller may reuse it at once), so on a set whose
ranks share a node the copy goes straight into a region of this rank's slot of the set's arena, and the
allreduce reduces it there (:meth:`distlab.comm.ProcessGroup.allreduce_placed`): the ranks submit in different
orders, so each rank places its copies where it has room and the arrival step tells every rank where the others'
are. The result of a single tensor is that region itself, leased to the caller: every view of it keeps the lease
alive, and when the last one is gone the region is free again (no rank writes into a region that is not in an
allreduce it announced). The members of a fused response are copied out of their fusion region. A rank without
room (results kept alive fill the arena, or a device array) places nothing, and then every rank of that
allreduce goes through MPI, with the same bits.

The arena is made in the cycle thread, at the first allreduce large enough to use it (every member runs that
response at the same point, so the collective creation pairs up); DISTLAB_SHARED_MEMORY=0 turns it off.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from .._types import ReduceOp
from ..comm import shared

__all__ = ["ArenaRegions", "placeable", "lease", "ARENA_MIN_BYTES"]

#: The least an arena is made with (per rank): room for a few large tensors in flight.
ARENA_MIN_BYTES = 64 << 20


def placeable(nbytes: int, dtype, mpi_op: str) -> bool:
    """Whether an allreduce of ``nbytes`` of ``dtype`` with ``mpi_op`` is reduced in shared memory when placed."""
    return nbytes >= shared.SHARED_MIN_BYTES and shared.reducible(np.dtype(dtype), ReduceOp.parse(mpi_op))


class ArenaRegions:
    """A set's arena and the free regions of this rank's slot (first fit; submissions and the cycle share it)."""

    def __init__(self, arena):
        self.arena = arena
        self.free = [(0, arena.slot_bytes)]  # (start, length), sorted by start
        self.lock = threading.Lock()
        self.returned = collections.deque()  # regions of leases that died: a lock-free append, merged when locked

    @classmethod
    def create(cls, group, nbytes: int):
        """Collective over ``group``: an ArenaRegions, or None on every rank when the ranks have no shared arena."""
        arena = shared.create_arena(group, max(ARENA_MIN_BYTES, 2 * int(nbytes)))
        return None if arena is None else cls(arena)

    def region(self, count: int, dtype):
        """An uninitialised region of ``count`` elements (a fusion buffer) and its offset; ``(None, None)``."""
        dtype = np.dtype(dtype)
        nbytes = shared.aligned(max(count * dtype.itemsize, 1))
        with self.lock:
            self._merge_returned()
            for i, (start, length) in enumerate(self.free):
                if length >= nbytes:
                    self.free[i:i + 1] = [(start + nbytes, length - nbytes)] if length > nbytes else []
                    break
            else:
                return None, None
        return self.arena.array(start, count, dtype), start

    def in_use(self) -> int:
        """Bytes of this rank's slot in regions not free (copies in flight, results still alive)."""
        with self.lock:
            self._merge_returned()
            return self.arena.slot_bytes - sum(length for _start, length in self.free)

    def release(self, offset: int, nbytes: int) -> None:
        """Give the region at ``offset`` back (merged with its free neighbours)."""
        self.returned.append((offset, nbytes))
        with self.lock:
            self._merge_returned()

    def _merge_returned(self) -> None:
        if not self.returned:
            return
        given = []
        while self.returned:
            offset, nbytes = self.returned.popleft()
            given.append((offset, shared.aligned(max(nbytes, 1))))
        free = sorted(self.free + given)
        merged = [free[0]]
        for start, length in free[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self.free = merged


class _Lease:
    """Owns a region handed to the caller as its result: numpy makes it the base of the result and of every view
    of it, so the region goes back (a lock-free append: a finaliser may run inside the placement's lock) once
    the last view is gone."""

    __slots__ = ("view", "offset", "returned", "__array_interface__")

    def __init__(self, view, offset, returned):
        self.view, self.offset, self.returned = view, offset, returned
        self.__array_interface__ = view.__array_interface__

    def __del__(self):
        self.returned.append((self.offset, self.view.nbytes))


def lease(placement: ArenaRegions, view, offset: int):
    """The region ``view`` at ``offset`` as the caller's own array, given back when it and its views are gone."""
    return np.asarray(_Lease(view, offset, placement.returned))
