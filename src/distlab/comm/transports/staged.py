"""The staged transport: device arrays through pinned host memory, chunked and pipelined.

What a device collective costs on this path is three copies and MPI: device to host, the host reduction, host to
device. Pageable host memory makes both copies slow and synchronous (GPU.md's machine: 6.2 and 7.9 ms for 64 MiB
against 2.5 and 2.5 pinned), so the transport keeps pinned arenas (``cupy.cuda.alloc_pinned_memory``; plain host
memory on the stand-in), made once and reused: one per operation in flight, so async collectives never share one.

An allreduce (or broadcast) goes in chunks of :data:`CHUNK_BYTES`. Every chunk's copy down is queued at once on
the ``down`` stream, each followed by an event; the host waits for chunk ``k``'s event (polling the MPI requests
already issued, so MPI moves chunk ``k - 1`` meanwhile) and issues chunk ``k``'s nonblocking MPI call; as chunk
``k``'s MPI call completes, its copy up is queued on the ``up`` stream. So chunk ``k + 1`` comes down while MPI
reduces chunk ``k`` and chunk ``k - 1`` goes back up. Every MPI call is issued before the operation's first wait,
in the order of the chunks: ranks whose async operations are waited on in different orders still issue their
collectives in one order, as MPI requires. Each chunk is reduced by the same MPI call as today's unchunked
staging would run on it, and ``avg`` divides the host chunk before it goes up, so the bits are the same.
allgather and reduce_scatter go through the arena in one piece.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ..._types import ReduceOp
from ...autograd._array import device_module
from ..device import device_array
from ..reduce_ops import as_bits, reduction_buffer
from ._streams import Streams
from .base import Transport

__all__ = ["StagedTransport", "CHUNK_BYTES", "CHUNK_BYTES_VAR", "allreduce_call"]

CHUNK_BYTES_VAR = "DISTLAB_STAGED_CHUNK_BYTES"


def _chunk_bytes() -> int:
    value = os.environ.get(CHUNK_BYTES_VAR, "").strip()
    if value and not value.isdigit() or value == "0":
        raise ValueError(f"{CHUNK_BYTES_VAR}={value!r}: expected a positive number of bytes")
    return int(value) if value else 4 << 20


#: Bytes per pipelined chunk (4 MiB: a copy of it takes about 0.16 ms pinned on the H100 GPU.md names).
CHUNK_BYTES = _chunk_bytes()


class _Arena:
    """One pinned host buffer and the events of the copies still reading it."""

    def __init__(self, xp, nbytes: int):
        pinned = getattr(xp.cuda, "alloc_pinned_memory", None)
        self.memory = pinned(nbytes) if pinned is not None else None
        self.host = (np.frombuffer(self.memory, np.uint8, nbytes) if self.memory is not None
                     else np.empty(nbytes, dtype=np.uint8))
        self.pending: list = []  # events of the last copies up out of it: the next copies down wait on them


class StagedTransport(Transport):
    """Device collectives of one group staged through its pinned arenas (see the module docstring)."""

    name = "staged"

    def takes(self, what: str, name, *arrays) -> bool:
        """Device arrays; and host arrays an allreduce or broadcast cuts into chunks, so that a rank meeting the
        others' device collective with a host array (a joined rank's shadow of zeros) issues the same MPI calls."""
        return all(device_array(array, what, name, host_too=what in ("allreduce", "broadcast")
                                and getattr(array, "nbytes", 0) > CHUNK_BYTES) for array in arrays)

    def __init__(self, steps):
        super().__init__(steps)
        self._free: list[_Arena] = []
        self._streams: dict = {}
        self.arenas_made = 0  # how many arenas were ever allocated (the reuse test reads it)

    def _take(self, xp, nbytes: int) -> _Arena:
        for index, arena in enumerate(self._free):
            if arena.host.nbytes >= nbytes:
                return self._free.pop(index)
        if self._free:
            self._free.pop(0)  # too small: replaced by a larger one
        self.arenas_made += 1
        return _Arena(xp, max(nbytes, 64))

    def streams_for(self, xp) -> Streams:
        """The transport's copy streams on device module ``xp``."""
        streams = self._streams.get(xp)
        if streams is None:
            streams = self._streams[xp] = Streams(xp)
        return streams

    def allreduce(self, array, reduce_op, mpi_op, async_op: bool, name):
        """In-place allreduce of a device array, chunked and pipelined through a pinned arena."""
        steps = self.steps
        seq = steps.enter("allreduce", name, array, reduce_op=reduce_op)
        average = steps.size if reduce_op is ReduceOp.AVG else 0
        return steps.run("allreduce", seq, name, array.nbytes,
                             self.pipeline(array, allreduce_call(steps.comm, array.dtype, mpi_op), True, True,
                                            average), async_op)

    def broadcast(self, array, src: int, async_op: bool, name):
        """Broadcast of a device array from rank ``src``, chunked and pipelined through a pinned arena."""
        steps = self.steps
        seq = steps.enter("broadcast", name, array, root=src)
        mine = steps.rank == src
        stages = self.pipeline(array, lambda buf: steps.comm.Ibcast(as_bits(buf), root=src), mine, not mine, 0)
        return steps.run("broadcast", seq, name, array.nbytes, stages, async_op)

    def pipeline(self, array, call, down: bool, up: bool, average: int):
        """The stages of one chunked, pipelined collective of ``array`` through a pinned arena: ``call(host chunk)``
        issues each chunk's MPI request (every one before the first yield); ``down``/``up``: copy in/out;
        ``average``: divide each reduced chunk by it (0: not). Also the hierarchical transport's cross-node step."""
        flat = array.reshape(-1)
        step = max(CHUNK_BYTES // array.dtype.itemsize, 1)
        bounds = [(a, min(a + step, flat.size)) for a in range(0, flat.size, step)]
        xp = device_module(array)
        if xp is None:  # a host array: the same MPI calls on its own memory
            requests = [call(flat[a:b]) for a, b in bounds]
            for k, (a, b) in enumerate(bounds):
                yield requests[k]
                if average:
                    flat[a:b] /= average
            return array
        streams = self.streams_for(xp)
        arena = self._take(xp, array.nbytes)
        host = arena.host[:array.nbytes].view(array.dtype)
        caller = streams.after_caller()
        for event in arena.pending:
            streams.down.wait_event(event)
        ready = []
        if down:
            for a, b in bounds:  # every copy down queued at once (cupy's get waits for its copy unless told not
                flat[a:b].get(stream=streams.down, out=host[a:b], blocking=False)  # to); each chunk's event: landed
                ready.append(streams.record(streams.down))
        requests = []
        for k, (a, b) in enumerate(bounds):
            if down:
                while not ready[k].done:  # chunk k still coming down: let MPI move the chunks already issued
                    MPI.Request.Testall(requests)
            requests.append(call(host[a:b]))
        arena.pending = []
        try:
            for k, (a, b) in enumerate(bounds):
                yield requests[k]
                if average:
                    host[a:b] /= average
                if up:
                    flat[a:b].set(host[a:b], stream=streams.up)
            if up:
                arena.pending.append(streams.record(streams.up))
            streams.release_to(caller)
        finally:
            self._free.append(arena)
        return array

    def allgather(self, array, out, async_op: bool, name):
        """Gather every rank's device ``array`` into the device array ``out`` through one pinned arena."""
        steps = self.steps
        seq = steps.enter("allgather", name, array)
        xp = device_module(array)
        streams = self.streams_for(xp)

        def stages():
            arena = self._take(xp, out.nbytes + array.nbytes)
            try:
                send = arena.host[:array.nbytes].view(array.dtype).reshape(array.shape)
                recv = arena.host[array.nbytes:array.nbytes + out.nbytes].view(out.dtype).reshape(out.shape)
                caller = self._down(streams, arena, array, send)
                yield steps.comm.Iallgather(as_bits(send), as_bits(recv))
                out.set(recv, stream=streams.up)
                self._up(streams, arena, caller)
            finally:
                self._free.append(arena)
            return out

        return steps.run("allgather", seq, name, array.nbytes, stages(), async_op)

    def reduce_scatter(self, output, input, reduce_op, mpi_op, async_op: bool, name):  # noqa: A002
        """Reduce-scatter of device arrays through one pinned arena."""
        steps = self.steps
        seq = steps.enter("reduce_scatter", name, input, reduce_op=reduce_op)
        xp = device_module(input)

        def call(send, recv):
            return steps.comm.Ireduce_scatter_block(reduction_buffer(send), reduction_buffer(recv), mpi_op)

        def host_stages():  # host arrays (a rank meeting the others' device call with host memory): the same call
            yield call(input.reshape(-1), output.reshape(-1))
            if reduce_op is ReduceOp.AVG:
                output[...] /= steps.size
            return output

        def stages():
            streams = self.streams_for(xp)
            arena = self._take(xp, input.nbytes + output.nbytes)
            try:
                send = arena.host[:input.nbytes].view(input.dtype)
                recv = arena.host[input.nbytes:input.nbytes + output.nbytes].view(output.dtype)
                caller = self._down(streams, arena, input.reshape(-1), send)
                yield call(send, recv)
                if reduce_op is ReduceOp.AVG:
                    recv /= steps.size
                output.reshape(-1).set(recv, stream=streams.up)
                self._up(streams, arena, caller)
            finally:
                self._free.append(arena)
            return output

        return steps.run("reduce_scatter", seq, name, input.nbytes, host_stages() if xp is None else stages(),
                             async_op)

    @staticmethod
    def _down(streams: Streams, arena: _Arena, array, host):
        """Copy ``array`` into ``host`` on the down stream after the caller's work; the host waits for it."""
        caller = streams.after_caller()
        for event in arena.pending:
            streams.down.wait_event(event)
        array.get(stream=streams.down, out=host)
        streams.record(streams.down).synchronize()
        return caller

    @staticmethod
    def _up(streams: Streams, arena: _Arena, caller) -> None:
        arena.pending = [streams.record(streams.up)]
        streams.release_to(caller)


def allreduce_call(comm, dtype, mpi_op):
    """``call(host buffer)``: the nonblocking in-place MPI allreduce of one chunk over ``comm`` (bfloat16 as its
    16-bit words, which ``mpi_op`` reduces)."""
    return lambda buf: comm.Iallreduce(MPI.IN_PLACE, reduction_buffer(buf), mpi_op)
