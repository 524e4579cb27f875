"""The IPC transport: device collectives through buffers every rank of the node maps.

Each rank owns one slot of ``DISTLAB_IPC_SLOT_BYTES`` (:func:`slot_bytes`), a dedicated allocation (never a
memory-pool sub-allocation, whose IPC handle would name the pool's larger block), which every other rank maps once,
when the group's first device collective runs (:class:`CudaSlots`: ``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``,
handles exchanged over MPI and cached for the group's life). The stand-in (:mod:`distlab.fakegpu`) emulates those
calls (its ``cuda.Memory`` is an anonymous memory file a peer maps by handle), so it runs this very code.
A collective then runs, one slot-sized chunk at a time:

1. **copy in** on the transport's stream, after an event on the caller's stream; the host waits for that copy;
2. **arrive**: a message to every peer carrying ``[seq, chunk, count, dtype, op, root]``, tagged by the
   sequence number on the transport's own communicator; every rank checks every header (a mismatch is a
   :class:`~distlab.errors.CollectiveMismatchError` on every rank); it also says the sender's slot is written;
3. **work**: allreduce: the reducing ranks sum their block over every slot in rank order and write it into
   every slot (``split``: each rank its block; ``leader``: rank 0 alone, when every rank shares one device, so no
   rank ever spins on a device shared with the others; it reads and writes its own array in place of its slot,
   skipping steps 1 and 5); broadcast/allgather: copies out of the peers' slots;
   reduce_scatter: rank ``r`` sums block ``r`` straight into its output; the host waits for the work;
4. **done**: a second message to every peer; once all arrived, every slot holds its result and may be reused;
5. **copy out** (allreduce) into the caller's array; the caller's stream waits on the transport's last event.

**Which path.** Host arrays meet this transport too (Join's counts, a joined rank's shadow of zeros): the ranks
agree, once per collective signature, whether it goes through the slots or the host path
(:mod:`~distlab.comm.transports.agreement`); its first collective's arrival message carries each rank's word.

An allreduce of an array made by :meth:`IpcTransport.shared_arrays` (memory every rank maps, as the slots are;
DDP's device buckets) skips steps 1 and 5 on its rank: its arrival message says where the chunk lies, and the
reducing ranks read and write it there.

Every element is reduced by exactly one rank, in rank order, so every rank gets the same bits. Messages match by
tag, not issue order, and one collective uses the slots at a time (a later one waits its turn, driving the
earlier), so async collectives waited on in any order are safe.
"""
from __future__ import annotations

import os
import time
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from ..._types import ReduceOp
from ...errors import CollectiveMismatchError
from ..device import device_array
from ..setup import bounded_dup, bounded_wait, release_comm
from ..shared import layout, shared_memory_enabled
from ._streams import Streams
from .agreement import PathAgreement
from .base import Transport

__all__ = ["IpcTransport", "CudaSlots", "SLOT_BYTES_VAR", "slot_bytes"]

SLOT_BYTES_VAR = "DISTLAB_IPC_SLOT_BYTES"
_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_ARRIVE, _DONE = 0, 1
_COMMON = 6  # header words every rank must agree on: seq, chunk, count, dtype, op, root; then where its data is,
_DEVICE_WORD = _COMMON + 2  # and whether its arrays are device memory (the path agreement)
_NOWHERE = (-1, -1)
_COMBINE = {ReduceOp.SUM: "add", ReduceOp.AVG: "add", ReduceOp.MIN: "minimum", ReduceOp.MAX: "maximum",
            ReduceOp.PRODUCT: "multiply", ReduceOp.BAND: "bitwise_and", ReduceOp.BOR: "bitwise_or"}
_OPS = {None: 0, **{op: k + 1 for k, op in enumerate(_COMBINE)}}


def slot_bytes(on_gpu: bool) -> int:
    """``DISTLAB_IPC_SLOT_BYTES``, else 64 MiB on a GPU (a 64 MiB allreduce in one chunk), 1 MiB on the stand-in
    (whose slots are host memory, one per rank of every ipc steps)."""
    value = os.environ.get(SLOT_BYTES_VAR, "").strip()
    if value and (not value.isdigit() or int(value) < 64):
        raise ValueError(f"{SLOT_BYTES_VAR}={value!r}: expected a number of bytes, 64 or more")
    return int(value) // 64 * 64 if value else (64 << 20 if on_gpu else 1 << 20)


class CudaSlots:
    """Slots in device memory: a dedicated ``cuda.Memory`` per rank, the peers' opened by IPC handle once (the
    same calls on cupy and on the stand-in). Collective: a rank that cannot allocate its slot or open a peer's,
    or ranks that disagree on the slot size, make every rank raise the same error, naming the ranks."""

    def __init__(self, steps, xp, nbytes: int):
        runtime = xp.cuda.runtime
        self._xp, self._rank = xp, steps.rank
        self.nbytes = nbytes
        # the opened handles: the owner of every peer's memory here, closed once the last memory over them goes
        # (held by no one else, so dropping the slots closes them at once, without waiting for a cyclic GC)
        self._handles = _Handles()
        weakref.finalize(self._handles, _close_handles, runtime, self._handles.pointers)
        self._memories = [None] * steps.size
        failure, mine = None, np.zeros(_HANDLE_BYTES + 8, dtype=np.uint8)  # no handle: no slot
        mine[_HANDLE_BYTES:] = np.array([nbytes], dtype=np.int64).view(np.uint8)
        try:
            self._memories[steps.rank] = xp.cuda.Memory(nbytes)
            mine[:_HANDLE_BYTES] = np.frombuffer(runtime.ipcGetMemHandle(self._memories[steps.rank].ptr), np.uint8)
        except (RuntimeError, MemoryError, OSError) as exc:  # cupy's CUDARuntimeError and OutOfMemoryError
            failure = f"allocating its {nbytes}-byte slot: {type(exc).__name__}: {exc}"
        table = _gather(steps, mine, "handles")
        sizes = table[:, _HANDLE_BYTES:].copy().view(np.int64)[:, 0]
        if np.any(sizes != nbytes):
            described = "; ".join(f"ranks {np.flatnonzero(sizes == size).tolist()}: {size} bytes"
                                  for size in dict.fromkeys(sizes.tolist()))
            raise RuntimeError(f"ipc transport of group {steps.name!r}: the ranks' slot sizes differ "
                               f"({SLOT_BYTES_VAR}): {described}")
        for k in range(steps.size):
            if k == steps.rank or failure is not None or not table[k, :_HANDLE_BYTES].any():
                continue
            try:
                ptr = runtime.ipcOpenMemHandle(table[k, :_HANDLE_BYTES].tobytes())  # lazy peer access
            except (RuntimeError, OSError) as exc:
                failure = f"opening rank {k}'s slot: {type(exc).__name__}: {exc}"
                continue
            self._handles.pointers.append(ptr)
            self._memories[k] = xp.cuda.UnownedMemory(ptr, nbytes, self._handles)
        failed = np.flatnonzero(_gather(steps, np.array([failure is not None], dtype=np.int8), "mapping")[:, 0])
        if failed.size:
            raise RuntimeError(f"ipc transport of group {steps.name!r}: ranks {failed.tolist()} could not map the "
                               f"slots" + (f" (this rank failed {failure})" if failure else ""))

    def view(self, rank: int, count: int, dtype, offset: int = 0):
        """``count`` elements of ``dtype`` at byte ``offset`` of ``rank``'s slot, as a device array."""
        pointer = self._xp.cuda.MemoryPointer(self._memories[rank], offset)
        return self._xp.ndarray((count,), dtype=dtype, memptr=pointer)

    def offset_of(self, array) -> int:
        """Where device ``array`` starts in this rank's own slot, in bytes, or -1 when it is not all inside it."""
        base, start = self._memories[self._rank].ptr, array.data.ptr
        return start - base if base <= start and start + array.nbytes <= base + self.nbytes else -1


class _Handles:
    """The IPC handles one rank opened (device pointers), closed by a finalizer when the last memory goes."""

    __slots__ = ("pointers", "__weakref__")

    def __init__(self):
        self.pointers: list[int] = []


def _close_handles(runtime, pointers) -> None:
    for ptr in pointers:
        runtime.ipcCloseMemHandle(ptr)


def _gather(steps, mine: np.ndarray, what: str) -> np.ndarray:
    """Set-up allgather straight on the group's communicator (not through the transport being set up)."""
    table = np.empty((steps.size,) + mine.shape, dtype=mine.dtype)
    bounded_wait(steps.comm.Iallgather(mine, table), f"ipc transport of group {steps.name!r} set-up ({what})",
                 steps.comm, steps.timeout, time.monotonic() + steps.timeout)
    return table


class _Turn:
    """Polled like a request: True once the transport's previous collective finished (driving it meanwhile)."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def Test(self) -> bool:  # noqa: N802 - polled like an mpi4py request
        return self.work is None or self.work.advance()  # its stages ended: the slots are free


class _Messages:
    """One step's messages: a header to every peer, one from every peer, on the transport's communicator."""

    __slots__ = ("requests", "inbox")

    def __init__(self, comm, rank: int, peers, header: np.ndarray, tag: int):
        self.inbox = np.empty((comm.Get_size(), header.size), dtype=np.int64)
        self.inbox[rank] = header
        self.requests = [comm.Irecv(self.inbox[k], source=k, tag=tag) for k in peers]
        self.requests += [comm.Isend(header, dest=k, tag=tag) for k in peers]

    def Test(self) -> bool:  # noqa: N802
        return MPI.Request.Testall(self.requests)


class IpcTransport(Transport):
    """Device collectives of one single-node group through mapped slots (see the module docstring).

    It takes host arrays too, where the ranks agreed that it should (:mod:`~distlab.comm.transports.agreement`): a
    rank may meet the others' device collective with host arrays (a joined rank's shadow of zeros), and every rank
    must run the same protocol; a host array is copied in and out of the slot.
    """

    name = "ipc"

    def takes(self, what: str, name, *arrays) -> bool:
        """The arrays of the four collectives (checked: contiguous, a movable dtype): device memory always; host
        memory when the ranks agreed its collective's signature is device memory somewhere, or have not agreed it
        yet (this collective agrees it: :mod:`~distlab.comm.transports.agreement`)."""
        device = False
        for array in arrays:
            if not device_array(array, what, name, host_too=True):
                return False  # not an array a transport takes: the plain path refuses it
            device = device or type(array) is not np.ndarray
        return device or self._agreement.slots((what, name, tuple(arrays[0].shape), arrays[0].dtype))

    def __init__(self, steps, mode: str, module):
        super().__init__(steps)
        self.mode = mode  # "leader" or "split"
        self._held: list = []  # the slots, once mapped; released with the group (destroyed or dropped)
        self._release = weakref.finalize(self, self._held.clear)
        self._comm = None
        self._streams = None
        self._last = None  # the Work of the collective that used the slots last
        self._module = module  # the device module the slots belong to
        self._peers = [k for k in range(steps.size) if k != steps.rank]
        self._shared: list = []  # weak references to the memory of shared_arrays, in the (collective) order made
        self._agreement = PathAgreement(steps)  # which collectives take the slots, agreed by the ranks

    def releaser(self):
        """Drops the mapped slots (the peers' handles close once no array over them is left)."""
        return self._release

    @property
    def _slots(self):
        return self._held[0] if self._held else None

    def shared_arrays(self, specs):
        """Collective: zeroed device arrays every rank of the node maps, one per ``(count, dtype)`` of ``specs``
        (DDP's buckets, as its host buckets go in a shared-memory arena): an allreduce of such an array reads and
        writes it where it is, with no copy in or out on its rank (torch's symmetric memory, without the
        separate allocator). Returns ``(memory, arrays)``, keeping ``memory`` as long as the arrays; or None on
        every rank when the ranks ask for different sizes or none, or any rank set ``DISTLAB_SHARED_MEMORY=0``."""
        starts, total = layout(specs, 256)  # cupy's allocations are 256-byte aligned too
        wanted = total if shared_memory_enabled() else 0  # DISTLAB_SHARED_MEMORY=0 on any rank: none anywhere
        sizes = _gather(self.steps, np.array([wanted], np.int64), "shared arrays")[:, 0]
        if not total or np.any(sizes != total):
            return None
        memory = CudaSlots(self.steps, self._module, total)
        self._shared.append(weakref.ref(memory))
        arrays = [memory.view(self.steps.rank, int(count), dtype, start)
                  for start, (count, dtype) in zip(starts, specs)]
        for array in arrays:
            array.fill(0)
        return memory, arrays

    def _place(self, chunk) -> tuple[int, int]:
        """``(index in shared_arrays' order, byte offset)`` of a device chunk living in shared arrays' memory,
        which the peers read and write where it is; ``(-1, -1)`` for any other array."""
        if type(chunk) is not np.ndarray:
            for index, ref in enumerate(self._shared):
                memory = ref()
                offset = memory.offset_of(chunk) if memory is not None else -1
                if offset >= 0:
                    return index, offset
        return -1, -1

    def _view_of(self, rank: int, place, count: int, dtype):
        """The chunk rank ``rank`` said (its header's ``place``) is where it is, or its slot."""
        if place[0] < 0:
            return self._slots.view(rank, count, dtype)
        memory = self._shared[place[0]]()
        if memory is None:
            raise RuntimeError(f"ipc transport of group {self.steps.name!r}: rank {rank} passed an array in shared "
                               f"arrays this rank no longer holds (made #{place[0]}); keep them alike on every rank")
        return memory.view(rank, count, dtype, int(place[1]))

    def _ready(self, xp) -> None:
        """The group's first device collective: map the slots (collective; every rank gets here in step)."""
        if self._comm is not None:
            return
        steps = self.steps
        on_gpu = xp.__name__ == "cupy"
        self._held[:] = [CudaSlots(steps, xp, slot_bytes(on_gpu))]
        self._comm = bounded_dup(steps.comm, f"ipc transport of group {steps.name!r}", steps.timeout)
        self._tag_limit = (int(self._comm.Get_attr(MPI.TAG_UB)) + 1) // 2
        weakref.finalize(self, release_comm, self._comm)
        self._streams = Streams(xp)

    def _run(self, op, name, array, per_chunk, chunks, header, async_op, result, reduce_op=None, root=-1,
             device=True):
        """Enter collective ``op`` and run ``per_chunk(k)``'s steps for each of ``chunks``; return ``result``.
        ``device``: whether this rank's arrays are device memory (what its arrival message says)."""
        steps = self.steps
        seq = steps.enter(op, name, array, root=root, reduce_op=reduce_op or "")
        tag = seq % self._tag_limit * 2
        turn = _Turn(self._last)
        streams = self._streams
        key = (op, name, tuple(array.shape), array.dtype)
        agree = self._agreement.first(key)  # a record(words) when this collective agrees its signature's path

        def stages():
            nonlocal agree
            yield turn
            caller = streams.after_caller()
            for k in range(chunks):
                copy_in, work, copy_out, place = per_chunk(k)
                with streams.down:
                    copy_in()
                streams.record(streams.down).synchronize()  # the chunk's data is in place (its producers done)
                mine = np.array([seq, k, *header, _OPS[reduce_op], root, *place, device], dtype=np.int64)
                arrived = _Messages(self._comm, steps.rank, self._peers, mine, tag + _ARRIVE)
                yield arrived
                _check(arrived.inbox[:, :_COMMON], mine[:_COMMON], steps.rank, op, seq, name)
                if agree is not None:
                    agree(arrived.inbox[:, _DEVICE_WORD])
                    agree = None
                with streams.down:
                    work(arrived.inbox[:, _COMMON:_DEVICE_WORD])
                streams.record(streams.down).synchronize()
                yield _Messages(self._comm, steps.rank, self._peers, mine[:2], tag + _DONE)
                with streams.down:
                    copy_out()
            streams.release_to(caller)
            return result

        self._last = work = steps.run(op, seq, name, array.nbytes, stages(), True)
        if agree is not None:
            self._agreement.started(key, work)
        return work if async_op else work.result()

    def allreduce(self, array, reduce_op, mpi_op, async_op: bool, name):
        """In-place allreduce of a device array through the slots."""
        steps, flat = self.steps, array.reshape(-1)
        step, chunks = self._chunking(array, flat.size, 1)
        combine = getattr(self._module, _COMBINE[reduce_op])
        average = reduce_op is ReduceOp.AVG
        # the leader reduces straight in its own array, which it reads and writes in place of its slot: two copies
        # of the array (in and out) fewer on the one device, the same operations in the same order (same bits); so
        # does every rank whose array lives in shared arrays' memory, which the others map (DDP's buckets)
        direct = self.mode == "leader" and steps.rank == 0 and type(array) is not np.ndarray

        def per_chunk(k):
            a, b = k * step, min((k + 1) * step, flat.size)
            place = self._place(flat[a:b])
            in_place = direct or place[0] >= 0
            own = flat[a:b] if in_place else self._slots.view(steps.rank, b - a, array.dtype)
            first, stop = _block(b - a, steps.rank, steps.size, self.mode)

            def copy_in():
                if not in_place:
                    _put(own, flat[a:b])

            def work(places):
                if first == stop:
                    return
                views = [own if r == steps.rank else self._view_of(r, places[r], b - a, array.dtype)
                         for r in range(steps.size)]
                total = views[0][first:stop]
                for view in views[1:]:
                    combine(total, view[first:stop], out=total)
                if average:
                    total /= steps.size
                for view in views[1:]:
                    view[first:stop] = total

            def copy_out():
                if not in_place:
                    _put(flat[a:b], own)

            return copy_in, work, copy_out, place

        return self._run("allreduce", name, array, per_chunk, chunks, (flat.size, _dtype_code(array.dtype)),
                         async_op, array, reduce_op, device=_on_device(array))

    def broadcast(self, array, src: int, async_op: bool, name):
        """Broadcast of a device array from rank ``src`` through its slot."""
        steps, flat = self.steps, array.reshape(-1)
        step, chunks = self._chunking(array, flat.size, 1)

        def per_chunk(k):
            a, b = k * step, min((k + 1) * step, flat.size)
            source = self._slots.view(src, b - a, array.dtype)

            def copy_in():
                if steps.rank == src:
                    _put(source, flat[a:b])

            def work(_places):
                if steps.rank != src:
                    _put(flat[a:b], source)

            return copy_in, work, _nothing, _NOWHERE

        return self._run("broadcast", name, array, per_chunk, chunks, (flat.size, _dtype_code(array.dtype)),
                         async_op, array, root=src, device=_on_device(array))

    def allgather(self, array, out, async_op: bool, name):
        """Gather every rank's device ``array`` into ``out`` (shape ``(size,) + array.shape``) through the slots."""
        steps, flat = self.steps, array.reshape(-1)
        rows = out.reshape(steps.size, -1)
        step, chunks = self._chunking(array, flat.size, 1)

        def per_chunk(k):
            a, b = k * step, min((k + 1) * step, flat.size)
            views = [self._slots.view(r, b - a, array.dtype) for r in range(steps.size)]

            def copy_in():
                _put(views[steps.rank], flat[a:b])

            def work(_places):
                for r, view in enumerate(views):
                    _put(rows[r, a:b], view)

            return copy_in, work, _nothing, _NOWHERE

        return self._run("allgather", name, array, per_chunk, chunks, (flat.size, _dtype_code(array.dtype)),
                         async_op, out, device=_on_device(array, out))

    def reduce_scatter(self, output, input, reduce_op, mpi_op, async_op: bool, name):  # noqa: A002
        """Reduce ``input`` across ranks; rank ``r`` sums block ``r`` of every slot into ``output``."""
        steps, size = self.steps, self.steps.size
        blocks, out = input.reshape(size, -1), output.reshape(-1)
        step, chunks = self._chunking(input, out.size, size)
        combine = getattr(self._module, _COMBINE[reduce_op])

        def per_chunk(k):
            a, b = k * step, min((k + 1) * step, out.size)
            n = b - a
            views = [self._slots.view(r, size * n, input.dtype).reshape(size, n) for r in range(size)]

            def copy_in():
                for q in range(size):
                    _put(views[steps.rank][q], blocks[q, a:b])

            def work(_places):  # a fresh array for the sum: this rank's block of every slot is an input, its own too
                total = combine(views[0][steps.rank], views[1][steps.rank])
                for view in views[2:]:
                    combine(total, view[steps.rank], out=total)
                if reduce_op is ReduceOp.AVG:
                    total /= size
                _put(out[a:b], total)

            return copy_in, work, _nothing, _NOWHERE

        return self._run("reduce_scatter", name, input, per_chunk, chunks, (out.size, _dtype_code(input.dtype)),
                         async_op, output, reduce_op, device=_on_device(input, output))

    def _chunking(self, array, count: int, copies: int) -> tuple[int, int]:
        """Map the slots if need be; elements per chunk (``copies`` of them fit one slot), number of chunks."""
        self._ready(self._module)
        step = max(self._slots.nbytes // (array.dtype.itemsize * copies), 1)
        return step, max(-(-count // step), 1)


def _put(target, source) -> None:
    """Copy ``source`` into ``target``: device or host on either side (a host side is the one copy it costs)."""
    if type(target) is np.ndarray and type(source) is not np.ndarray:
        source.get(out=target)
    else:
        target[...] = source


def _nothing() -> None:
    return None


def _on_device(*arrays) -> bool:
    """Whether any of ``arrays`` is device memory (what this rank's arrival message says)."""
    return any(type(array) is not np.ndarray for array in arrays)


def _block(count: int, rank: int, size: int, mode: str) -> tuple[int, int]:
    """The elements ``rank`` reduces: all of them for the leader (rank 0), its ``1/size`` share when split."""
    if mode == "leader":
        return (0, count) if rank == 0 else (0, 0)
    return count * rank // size, count * (rank + 1) // size


def _dtype_code(dtype) -> int:
    return zlib.crc32(np.dtype(dtype).str.encode() + np.dtype(dtype).name.encode())


def _check(table: np.ndarray, mine: np.ndarray, rank: int, op: str, seq: int, name) -> None:
    """Every rank read the same headers: raise the same error on each when they differ."""
    if table.tobytes() == mine.tobytes() * len(table):
        return
    groups: dict[tuple, list[int]] = {}
    for k, row in enumerate(table):
        groups.setdefault(tuple(int(w) for w in row[2:]), []).append(k)
    described = "; ".join(f"ranks {ranks}: {words[0]} elements (dtype code {words[1]}, op code {words[2]}, "
                          f"root {words[3]})" for words, ranks in groups.items())
    where = f" ({name!r})" if name else ""
    raise CollectiveMismatchError(f"rank {rank}{where}: {op} #{seq} through the ipc transport: the ranks passed "
                                  f"different arrays: {described}", seq=seq,
                                  groups={str(words): ranks for words, ranks in groups.items()})
