"""Where a large negotiated allreduce keeps its copy on one host: regions of the set's shared-memory arena.

On one host the process group reduces an array of a shared-memory arena in place, each rank summing its block
of every rank's copy (:mod:`distlab.comm.shared`), about twice as fast as MPI's copies through its own cells.
A negotiated allreduce must copy the caller's array anyway (the caller may reuse it at once), so on a set whose
ranks share a node the copy goes straight into a region of this rank's slot of the set's arena, and the
allreduce reduces it there (:meth:`distlab.comm.ProcessGroup.allreduce_placed`): the ranks submit in different
orders, so each rank places its copies where it has room and the arrival step tells every rank where the others'
are. The result is copied out into the caller's own array and the region is free again. A rank without room (or
with a device array) places nothing, and then every rank of that allreduce goes through MPI, with the same bits.

The arena is made in the cycle thread, at the first allreduce large enough to use it (every member runs that
response at the same point, so the collective creation pairs up); DISTLAB_SHARED_MEMORY=0 turns it off.
"""
from __future__ import annotations

import threading

import numpy as np

from .._types import ReduceOp
from ..comm import shared

__all__ = ["Placement", "placeable", "ARENA_MIN_BYTES"]

#: The least an arena is made with (per rank): room for a few large tensors in flight.
ARENA_MIN_BYTES = 64 << 20


def placeable(nbytes: int, dtype, mpi_op: str) -> bool:
    """Whether an allreduce of ``nbytes`` of ``dtype`` with ``mpi_op`` is reduced in shared memory when placed."""
    return nbytes >= shared.SHARED_MIN_BYTES and shared.reducible(np.dtype(dtype), ReduceOp.parse(mpi_op))


class Placement:
    """A set's arena and the free regions of this rank's slot (first fit; submissions and the cycle share it)."""

    def __init__(self, arena):
        self.arena = arena
        self.free = [(0, arena.slot_bytes)]  # (start, length), sorted by start
        self.lock = threading.Lock()

    @classmethod
    def create(cls, group, nbytes: int):
        """Collective over ``group``: a Placement, or None on every rank when the ranks have no shared arena."""
        arena = shared.create_arena(group, max(ARENA_MIN_BYTES, 2 * int(nbytes)))
        return None if arena is None else cls(arena)

    def region(self, count: int, dtype):
        """An uninitialised region of ``count`` elements (a fusion buffer) and its offset; ``(None, None)``."""
        dtype = np.dtype(dtype)
        nbytes = shared.aligned(max(count * dtype.itemsize, 1))
        with self.lock:
            for i, (start, length) in enumerate(self.free):
                if length >= nbytes:
                    self.free[i:i + 1] = [(start + nbytes, length - nbytes)] if length > nbytes else []
                    break
            else:
                return None, None
        return self.arena.array(start, count, dtype), start

    def release(self, offset: int, nbytes: int) -> None:
        """Give the region at ``offset`` back (merged with its free neighbours)."""
        nbytes = shared.aligned(max(nbytes, 1))
        with self.lock:
            free = sorted(self.free + [(offset, nbytes)])
            merged = [free[0]]
            for start, length in free[1:]:
                last_start, last_length = merged[-1]
                if last_start + last_length == start:
                    merged[-1] = (last_start, last_length + length)
                else:
                    merged.append((start, length))
            self.free = merged
