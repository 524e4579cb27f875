"""Shared-memory arenas, and the allreduce that reduces their arrays in place.

When every rank of a group runs on one node, MPI's allreduce of a large array is copies through shared memory:
each rank's data goes into MPI's cells, is reduced, and comes back. A
:class:`SharedArena` instead places the array itself in memory every rank of the node maps: one slot per rank,
laid out alike. DDP allocates its gradient buckets there. An allreduce of an arena array of at least
``SHARED_MIN_BYTES`` then needs no copy in or out: once every rank has arrived, rank ``r`` adds up block ``r`` of
all the slots and writes the sum into every slot, in less than half the time for a large array
(docs/measurements.md, "Collectives: shared-memory arenas"). Each rank reads and writes its block once.

The steps of one such allreduce, each a nonblocking MPI call polled like every other wait, so timeouts name
the missing ranks as usual:

1. **arrive**: an allgather of a four-word header ``[arena id, offset, element count, dtype code]``. Every rank's
   data is in its slot, and every rank checks that all passed the same region of the same arena; a mismatch
   raises :class:`~distlab.errors.CollectiveMismatchError` on every rank (they all read the same table).
2. **reduce**: this rank sums its block over the slots, in rank order (every element is summed by one rank, so
   all ranks get the very same bits), piece by piece so the sum is still in cache when it is copied out.
3. **done**: each rank tells every other rank it has written its block, with a message tagged by the
   collective's sequence number on the arena's own communicator. Not a barrier: a rank issues this step when it
   gets round to its block, so its order among other collectives varies from rank to rank, and MPI matches
   collectives on a communicator by the order they were issued in; messages match by tag. Every block is
   written before any rank reads its result or reuses its slot.

Ordering: the stores of step 2 are ordinary stores, ordered before the other ranks' loads by the MPI calls
around them (MPICH's shared-memory transport completes a message through atomic operations, which are full
memory barriers on x86-64 and fenced elsewhere).

Who may use it: the decision is per array (does it live in a live arena, and is it large enough?), so every rank
must pass its own view of the same arena region, as DDP does with its buckets; with ``DISTLAB_DEBUG=DETAIL`` the
fingerprint check names a rank that passed an ordinary array instead (the op shows as ``shared_allreduce``).
Arenas are made only for groups whose ranks share one node (MPI's view, or ``DISTLAB_RANKS_PER_NODE``), and
``DISTLAB_SHARED_MEMORY=0`` turns them off (when any rank says no, no rank gets one).
"""
from __future__ import annotations

import functools
import os
import secrets
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp
from ..errors import CollectiveMismatchError
from .board import map_node_file
from .setup import dup_within, release_comm

__all__ = ["SharedArena", "create_arena", "placement_header", "placed_offsets", "aligned", "layout", "SHARED_MEMORY_VAR", "shared_memory_enabled", "PIECE_BYTES",
           "SHARED_MIN_BYTES", "SHARED_MIN_BYTES_VAR"]

#: ``0`` turns shared-memory arenas off (DDP's buckets then live in private memory and go through MPI).
SHARED_MEMORY_VAR = "DISTLAB_SHARED_MEMORY"
#: Overrides :data:`SHARED_MIN_BYTES` (0: every arena array, which the tests use to run DDP's scenarios here).
SHARED_MIN_BYTES_VAR = "DISTLAB_SHARED_MIN_BYTES"
PIECE_BYTES = 256 * 1024  # reduce this much at a time: the sum stays in cache while it is copied to every slot
ALIGN = 64  # every region starts on a cache line
MAX_PLANS = 1024  # regions whose views are kept for the next reduction
MAX_HANDED = 4096  # arrays handed out whose offsets are remembered (dead ones are dropped past this)


def _min_bytes() -> int:
    value = os.environ.get(SHARED_MIN_BYTES_VAR, "").strip()
    if not value:
        return 256 * 1024
    if not value.isdigit():
        raise ValueError(f"{SHARED_MIN_BYTES_VAR}={value!r}: expected a number of bytes (0 or more)")
    return int(value)


#: Smaller arrays go through MPI even from an arena: two synchronisations and the Python steps cost more than
#: MPI's small allreduce; at 256 KiB the two tie (docs/measurements.md, "Collectives: shared-memory arenas").
SHARED_MIN_BYTES = _min_bytes()


def shared_memory_enabled() -> bool:
    """``DISTLAB_SHARED_MEMORY`` (default on): whether this rank wants shared-memory arenas."""
    value = os.environ.get(SHARED_MEMORY_VAR, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{SHARED_MEMORY_VAR}={value!r}: expected 1 or 0")
    return value not in ("0", "false", "off")


class SharedArena:
    """``nbytes`` of memory per rank of a one-node group, one slot per rank, all mapped by every rank.

    Made collectively by :func:`create_arena`. :meth:`array` hands out views of this rank's slot; the same
    offset in every other slot is that rank's copy.
    """

    def __init__(self, memory, slot_bytes: int, rank: int, size: int, ident: int, comm):
        self.slot_bytes = slot_bytes
        self.rank = rank
        self.ident = ident
        self.comm = comm  # the done messages travel here, tagged by sequence number
        self._tag_limit = int(comm.Get_attr(MPI.TAG_UB)) + 1
        self._peers = [k for k in range(size) if k != rank]
        weakref.finalize(self, release_comm, comm)  # freed with the arena
        self.slots = [np.frombuffer(memory, np.uint8, slot_bytes, k * slot_bytes) for k in range(size)]
        self._start = self.slots[rank].__array_interface__["data"][0]
        self._scratch = np.empty(PIECE_BYTES, dtype=np.uint8)  # the running sum of one piece
        self._handed: dict[int, tuple] = {}  # id(array) -> (weak reference, offset): arrays array() made
        self._plans: dict[tuple, tuple] = {}  # (offset, count, dtype) -> what reduce_block needs for that region

    def array(self, offset: int, count: int, dtype) -> np.ndarray:
        """A view of ``count`` elements of ``dtype`` at byte ``offset`` of this rank's slot."""
        dtype = np.dtype(dtype)
        if offset % ALIGN or offset < 0 or offset + count * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"SharedArena.array: offset {offset} and {count} x {dtype} do not fit an aligned "
                             f"region of the {self.slot_bytes}-byte slot")
        array = self.slots[self.rank][offset:offset + count * dtype.itemsize].view(dtype)
        if len(self._handed) >= MAX_HANDED:
            self._handed = {key: entry for key, entry in self._handed.items() if entry[0]() is not None}
        self._handed[id(array)] = (weakref.ref(array), offset)
        return array

    def locate(self, array) -> int | None:
        """The byte offset of ``array`` in this rank's slot, or None when it does not live there."""
        handed = self._handed.get(id(array))
        if handed is not None and handed[0]() is array:  # the hot path: DDP passes the arrays it was handed
            return handed[1]
        if type(array) is not np.ndarray or array.base is None or not array.flags.c_contiguous:
            return None  # (an array owning its memory is not a view of an arena)
        offset = array.__array_interface__["data"][0] - self._start
        if 0 <= offset and offset + array.nbytes <= self.slot_bytes:
            return offset
        return None

    def header(self, offset: int, array) -> np.ndarray:
        """What this rank posts when it arrives: which region it reduces, with what."""
        return np.array([self.ident, offset, array.size, _dtype_code(array.dtype)], dtype=np.int64)

    def _plan(self, offsets: tuple, count: int, dtype) -> tuple:
        """Every slot's view of its region, this rank's block of it, the piece length and the scratch."""
        size = len(self.slots)
        step = max(PIECE_BYTES // dtype.itemsize, 1)
        views = [slot[at:at + count * dtype.itemsize].view(dtype) for slot, at in zip(self.slots, offsets)]
        return (views, count * self.rank // size, count * (self.rank + 1) // size, step,
                self._scratch[:step * dtype.itemsize].view(dtype))

    def expect_done(self, seq: int) -> "DoneMessages":
        """Post the receives of collective ``seq``'s done messages (call when the collective is entered)."""
        return DoneMessages(self, seq % self._tag_limit)

    def reduce_block(self, offset: int, count: int, dtype, average: bool, offsets: tuple | None = None) -> None:
        """Sum this rank's block of the region over every slot (rank order) and write it into every slot.

        ``offsets`` (one per rank) when the ranks' regions lie at different offsets of their slots.
        """
        offsets = (offset,) * len(self.slots) if offsets is None else tuple(offsets)
        key = (offsets, count, dtype)
        plan = self._plans.get(key)
        if plan is None:  # a region is reduced again and again (DDP's buckets): its views are made once
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._plan(offsets, count, np.dtype(dtype))
        views, first, stop, step, scratch = plan
        size = len(views)
        with np.errstate(over="ignore", invalid="ignore"):  # as MPI: a sum that overflows is inf, silently
            for start in range(first, stop, step):
                end = min(start + step, stop)
                total = scratch[:end - start]
                np.add(views[0][start:end], views[1][start:end], out=total)
                for view in views[2:]:
                    np.add(total, view[start:end], out=total)
                if average:
                    total /= size
                for view in views:
                    view[start:end] = total


class DoneMessages:
    """The done step of one shared-memory allreduce: a message to and from every other rank."""

    __slots__ = ("arena", "tag", "inbox", "requests")

    def __init__(self, arena: SharedArena, tag: int):
        self.arena, self.tag = arena, tag
        self.inbox = np.empty(len(arena.slots), dtype=np.uint8)
        self.requests = [arena.comm.Irecv(self.inbox[k:k + 1], source=k, tag=tag) for k in arena._peers]

    def send(self) -> "DoneMessages":
        """This rank wrote its block: tell the others; returns self, to be polled until theirs arrived."""
        self.inbox[self.arena.rank] = 1
        mine = self.inbox[self.arena.rank:self.arena.rank + 1]
        self.requests += [self.arena.comm.Isend(mine, dest=k, tag=self.tag) for k in self.arena._peers]
        return self

    def Test(self) -> bool:  # noqa: N802 - polled like an mpi4py request
        return MPI.Request.Testall(self.requests)

    def cancel(self) -> None:
        """The collective failed before its done step: withdraw the receives."""
        for request in self.requests:
            request.Cancel()
            request.Free()
        self.requests = []


def create_arena(group, nbytes: int) -> SharedArena | None:
    """A :class:`SharedArena` of ``nbytes`` per rank for ``group``, or None; collective over the group.

    None when the group has one rank, spans several nodes, when any rank set ``DISTLAB_SHARED_MEMORY=0``, asked
    for a different size, or could not map the memory (a full ``/dev/shm``): then every rank gets None, so all
    of them keep using MPI.
    """
    keys = group.node_keys
    if group.size < 2 or (keys != keys[0]).any():
        return None
    nbytes = aligned(nbytes)
    wants = group.allgather(np.array([nbytes if shared_memory_enabled() else 0], dtype=np.int64),
                            name="shared arena size")[:, 0]
    if nbytes == 0 or (wants != nbytes).any():
        return None

    def all_gather(mine, what):
        return group.allgather(mine, name=f"shared arena ({what})")

    memory, mapped = map_node_file(all_gather, group.rank == 0, 0, nbytes * group.size, "arena", reserve=True)
    if not mapped.all():
        return None
    ident = np.array([secrets.randbits(62) if group.rank == 0 else 0], dtype=np.int64)
    group.broadcast(ident, src=0, name="shared arena id")
    comm = dup_within(group.comm, f"shared arena of group {group.name!r}", group.timeout)
    return SharedArena(memory, nbytes, group.rank, group.size, int(ident[0]), comm)


def check_headers(table: np.ndarray, header: np.ndarray, rank: int, op: str, seq: int, name) -> None:
    """Raise on every rank when the ranks' arrival headers (``table``, one row each) differ from ``header``."""
    if table.tobytes() == header.tobytes() * len(table):
        return
    rows = {int(k): tuple(int(w) for w in row) for k, row in enumerate(table)}
    groups: dict[tuple, list[int]] = {}
    for k, row in rows.items():
        groups.setdefault(row, []).append(k)
    described = "; ".join(f"ranks {ranks}: region at byte {row[1]}, {row[2]} elements of {_dtype_name(row[3])}"
                          f"{'' if row[0] == rows[0][0] else ' of another arena'}" for row, ranks in groups.items())
    where = f" ({name!r})" if name else ""
    raise CollectiveMismatchError(
        f"rank {rank}{where}: {op} #{seq} in shared memory: the ranks passed different regions: {described}. "
        "Every rank must pass its own view of the same region of the same arena.", seq=seq,
        groups={f"region {row[1]}+{row[2]}": ranks for row, ranks in groups.items()})


def placement_header(arena: SharedArena | None, offset: int | None, array) -> np.ndarray:
    """A placed allreduce's arrival header: the arena, the offset in this rank's slot (-1: not there), the array."""
    return np.array([arena.ident if arena is not None else 0, -1 if offset is None else offset, array.size,
                     _dtype_code(array.dtype)], dtype=np.int64)


def placed_offsets(table: np.ndarray, header: np.ndarray, rank: int, seq: int, name) -> tuple | None:
    """Each rank's offset from the arrival ``table`` of a placed allreduce, or None when a rank has no region.

    The ranks' regions may lie at different offsets of their slots, but must hold the same element count and
    dtype (else :class:`~distlab.errors.CollectiveMismatchError` on every rank); an offset of -1 says that rank's
    array is not in the arena, and then every rank goes through MPI.
    """
    if (table[:, 2:] != header[2:]).any():
        check_headers(table, header, rank, "allreduce", seq, name)  # raises, naming what differs
    if (table[:, 1] < 0).any() or (table[:, 0] != table[0, 0]).any():
        return None
    return tuple(int(at) for at in table[:, 1])


def aligned(nbytes: int, alignment: int = ALIGN) -> int:
    """``nbytes`` rounded up to a whole number of ``alignment`` bytes (default: cache lines)."""
    return -(-int(nbytes) // alignment) * alignment


def layout(specs, alignment: int = ALIGN) -> tuple[list[int], int]:
    """Where each array of ``specs`` ``[(count, dtype)]`` starts in one buffer, each ``alignment``-aligned, and
    the buffer's size in bytes."""
    starts, total = [], 0
    for count, dtype in specs:
        starts.append(total)
        total += aligned(int(count) * np.dtype(dtype).itemsize, alignment)
    return starts, total


def reducible(dtype, reduce_op) -> bool:
    """Whether numpy's add gives what MPI's reduction would (sum, and avg of floats)."""
    if reduce_op is ReduceOp.SUM:
        return dtype.kind in "fciu"
    return reduce_op is ReduceOp.AVG and dtype.kind in "fc"


@functools.lru_cache(maxsize=None)
def _dtype_code(dtype) -> int:
    return zlib.crc32(np.dtype(dtype).str.encode())


def _dtype_name(code: int) -> str:
    names = {_dtype_code(np.dtype(char)): np.dtype(char).name for char in np.typecodes["All"]}
    return names.get(code, f"dtype code {code}")
