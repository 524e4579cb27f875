"""The calls of a process group: collectives on arrays and objects, and point to point.

Each call checks everything about its arguments (dtype and op, shapes, ranks, tags) *before* it takes its
sequence number (:meth:`GroupSteps.enter <distlab.comm.steps.GroupSteps.enter>`): a rank whose call is refused
stays in step with its peers, and its group stays usable. Arrays go to MPI as their own buffers (device arrays
staged through host memory unless MPI is CUDA-aware, see :mod:`distlab.comm.device`), or to the group's device
transport when it takes them (the four collectives of :class:`~distlab.comm.transports.Transport`); only the
``_object`` calls pickle.
"""
from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp
from ..errors import CollectiveMismatchError
from ..timeline import now_us
from . import shared
from .device import check_buffer, displacements, empty_like, mpi_buffer, pickled
from .reduce_ops import averaging, is_bfloat16, mpi_reduction, parse_op, reduction_buffer
from .pieces import SPLIT_FROM_BYTES, in_turn, start_pieces
from .steps import Calls, check_tag, movable
from .ulfm import as_failure
from .work import StatusRequest

__all__ = ["GroupOperations"]


class GroupOperations(Calls):
    """The collective and point-to-point calls of :class:`~distlab.comm.ProcessGroup`; each checks its arguments,
    then takes the group's steps (:class:`~distlab.comm.steps.GroupSteps`), or hands device arrays to its
    transport."""

    def _refused(self, op: str, exc) -> None:
        """MPI refused to start ``op`` with ``exc``: under fault tolerance, when a process of the group is already
        known dead (Open MPI 5 may report it as the operation is posted, before any wait), ProcessFailedError
        naming it and ``op``, as the operation's wait would have raised; else ``exc`` itself."""
        failure = as_failure(exc, self.comm, op, self._steps.name)
        if failure is exc:
            raise exc
        raise failure from exc

    # -- collectives ------------------------------------------------------------------------------------------
    def allreduce(self, array, op="sum", async_op: bool = False, name=None):
        """Reduce ``array`` across ranks in place (``op``: sum, avg, min, max, product, band, bor)."""
        reduce_op = parse_op(op)
        mpi_op = mpi_reduction(array.dtype, reduce_op, "allreduce", name) if hasattr(array, "dtype") else None
        if self._transport is not None and self._transport.takes("allreduce", name, array):
            return self._transport.allreduce(array, reduce_op, mpi_op, async_op, name)
        if (self._arenas and getattr(array, "nbytes", 0) >= shared.SHARED_MIN_BYTES
                and shared.reducible(array.dtype, reduce_op)):
            for arena_ref in self._arenas:
                arena = arena_ref()
                offset = None if arena is None else arena.locate(array)
                if offset is not None:
                    return self._shared_allreduce(arena, offset, array, reduce_op, async_op, name)
        buf, copy_back = mpi_buffer(array, "allreduce")
        # Across nodes a large allreduce goes in pieces all in flight (see distlab.comm.pieces; 0: whole)
        piece = self._pieces.bytes_for(self, array.nbytes) if array.nbytes >= SPLIT_FROM_BYTES else 0
        steps = self._steps
        seq = steps.enter("allreduce", name, array, reduce_op=reduce_op)
        start = now_us() if steps.timeline_on else 0.0
        finish = copy_back
        if reduce_op is ReduceOp.AVG:
            finish = averaging(buf, self.size, copy_back)
        try:
            if piece:
                requests = start_pieces(self.comm, buf, piece, mpi_op,
                                        MPI.UINT16_T if is_bfloat16(array.dtype) else None)
                return steps.run("allreduce", seq, name, array.nbytes, in_turn(requests, finish, array), async_op)
            request = self.comm.Iallreduce(MPI.IN_PLACE, reduction_buffer(buf), mpi_op)  # bfloat16: our op
        except MPI.Exception as exc:
            self._refused("allreduce", exc)
        return steps.issue("allreduce", seq, name, array.nbytes, request, finish, array, async_op, None, start)

    def _shared_allreduce(self, arena, offset: int, array, reduce_op, async_op: bool, name):
        """``allreduce`` of an array living in a shared-memory arena: arrive, reduce a block, done (see
        :mod:`distlab.comm.shared`)."""
        header = arena.header(offset, array)
        table = np.empty((self.size, header.size), dtype=np.int64)
        seq = self._steps.enter("shared_allreduce", name, array, reduce_op=reduce_op)
        done = arena.expect_done(seq)

        def stages():
            yield self.comm.Iallgather(header, table)
            try:
                shared.check_headers(table, header, self.rank, "allreduce", seq, name)
            except CollectiveMismatchError:
                done.cancel()
                raise
            arena.reduce_block(offset, array.size, array.dtype, reduce_op is ReduceOp.AVG)
            yield done.send()
            return array

        return self._steps.run("allreduce", seq, name, array.nbytes, stages(), async_op)

    def allreduce_placed(self, array, arena=None, offset=None, op="sum", name=None):
        """Reduce ``array`` in place, reduced in shared memory when every rank's lies in ``arena`` (blocking).

        For arrays placed by their owner rather than handed out alike (distlab.collectives): rank ``r``'s
        ``array`` starts at byte ``offset`` of its own slot of ``arena`` (a :func:`~distlab.comm.shared.
        create_arena` arena of this group, not registered with it), the offsets may differ from rank to rank, and
        a rank whose array lies elsewhere passes ``offset=None``; then every rank goes through MPI. Every rank
        calls it with the same element count and dtype, and ``op`` one of sum or avg (see ``shared.reducible``).
        """
        reduce_op = parse_op(op)
        mpi_reduction(array.dtype, reduce_op, "allreduce", name)
        header = shared.placement_header(arena, offset, array)
        table = self.allgather(header, name=f"{name} placement" if name else "allreduce placement")
        offsets = shared.placed_offsets(table, header, self.rank, self._steps.seq, name)
        if offsets is None:
            return self.allreduce(array, op=reduce_op.value, name=name)
        seq = self._steps.enter("shared_allreduce", name, array, reduce_op=reduce_op)
        done = arena.expect_done(seq)

        def stages():
            arena.reduce_block(offset, array.size, array.dtype, reduce_op is ReduceOp.AVG, offsets)
            yield done.send()
            return array

        return self._steps.run("allreduce", seq, name, array.nbytes, stages(), False)

    def broadcast(self, array, src: int = 0, async_op: bool = False, name=None):
        """Overwrite ``array`` on every rank with rank ``src``'s copy."""
        self._steps.check_rank(src, "broadcast src")
        if self._transport is not None and self._transport.takes("broadcast", name, array):
            return self._transport.broadcast(array, src, async_op, name)
        buf, copy_back = movable(array, "broadcast", name)
        seq = self._steps.enter("broadcast", name, array, root=src)
        start = self._steps.start()
        try:
            request = self.comm.Ibcast(buf, root=src)
        except MPI.Exception as exc:
            self._refused("broadcast", exc)
        return self._steps.issue("broadcast", seq, name, array.nbytes, request, copy_back, array, async_op, None, start)

    def allgather(self, array, out=None, async_op: bool = False, name=None):
        """Gather every rank's ``array`` into ``out`` of shape ``(size,) + array.shape`` (returned)."""
        transport = self._transport
        if transport is None:
            send, _ = movable(array, "allgather", name)
        else:  # checked alike, staged for MPI only if the transport does not take the arrays
            movable(array, "allgather", name, stage=False)
        if out is None:
            out = empty_like(array, (self.size,) + tuple(array.shape))
        if tuple(out.shape) != (self.size,) + tuple(array.shape) or out.dtype != array.dtype:
            raise ValueError(f"allgather: out must have shape {(self.size,) + tuple(array.shape)} and dtype "
                             f"{array.dtype}, got {tuple(out.shape)} {out.dtype}")
        if transport is not None:
            if transport.takes("allgather", name, array, out):
                return transport.allgather(array, out, async_op, name)
            send, _ = movable(array, "allgather", name)
        recv, copy_back = movable(out, "allgather", name)
        seq = self._steps.enter("allgather", name, array)
        start = self._steps.start()
        try:
            request = self.comm.Iallgather(send, recv)
        except MPI.Exception as exc:
            self._refused("allgather", exc)
        return self._steps.issue("allgather", seq, name, array.nbytes, request, copy_back, out, async_op, None, start)

    def reduce_scatter(self, output, input, op="sum", async_op: bool = False, name=None):  # noqa: A002
        """Reduce ``input`` (``size`` equal blocks) across ranks; rank ``r`` receives block ``r`` in ``output``."""
        reduce_op = parse_op(op)
        mpi_op = mpi_reduction(input.dtype, reduce_op, "reduce_scatter", name) if hasattr(input, "dtype") else None
        transport = self._transport
        if transport is None:
            send, _ = mpi_buffer(input, "reduce_scatter")
            recv, copy_back = mpi_buffer(output, "reduce_scatter")
        else:  # checked alike, staged for MPI only if the transport does not take the arrays
            check_buffer(input, "reduce_scatter")
            check_buffer(output, "reduce_scatter")
        if input.size != output.size * self.size or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input must hold size*output.size = {output.size * self.size} "
                             f"elements of {output.dtype}, got {input.size} of {input.dtype}")
        if transport is not None:
            if transport.takes("reduce_scatter", name, input, output):
                return transport.reduce_scatter(output, input, reduce_op, mpi_op, async_op, name)
            send, _ = mpi_buffer(input, "reduce_scatter")
            recv, copy_back = mpi_buffer(output, "reduce_scatter")
        finish = averaging(output if copy_back is None else recv, self.size, copy_back) \
            if reduce_op is ReduceOp.AVG else copy_back  # the array (staged: its host copy), not its bfloat16 bits
        send, recv = reduction_buffer(send), reduction_buffer(recv)
        seq = self._steps.enter("reduce_scatter", name, input, reduce_op=reduce_op)
        start = self._steps.start()
        try:
            request = self.comm.Ireduce_scatter_block(send, recv, mpi_op)
        except MPI.Exception as exc:
            self._refused("reduce_scatter", exc)
        return self._steps.issue("reduce_scatter", seq, name, input.nbytes, request, finish, output, async_op, None,
                                 start)

    def alltoall(self, output, input, async_op: bool = False, name=None):  # noqa: A002
        """Send block ``j`` of ``input`` to rank ``j``; block ``i`` of ``output`` comes from rank ``i``."""
        send, _ = movable(input, "alltoall", name)
        recv, copy_back = movable(output, "alltoall", name)
        if input.size != output.size or input.dtype != output.dtype or input.size % self.size:
            raise ValueError(f"alltoall: input and output need the same size and dtype, divisible by {self.size}")
        seq = self._steps.enter("alltoall", name, input)
        start = self._steps.start()
        try:
            request = self.comm.Ialltoall(send, recv)
        except MPI.Exception as exc:
            self._refused("alltoall", exc)
        return self._steps.issue("alltoall", seq, name, input.nbytes, request, copy_back, output, async_op, None, start)

    def barrier(self, async_op: bool = False, name=None):
        """Wait until every rank of the group reached this barrier."""
        seq = self._steps.enter("barrier", name)
        start = self._steps.start()
        try:
            request = self.comm.Ibarrier()
        except MPI.Exception as exc:
            self._refused("barrier", exc)
        return self._steps.issue("barrier", seq, name, 0, request, None, None, async_op, None, start)

    def allgather_object(self, obj, async_op: bool = False, name=None):
        """Gather any picklable object from every rank; returns the list in rank order."""
        payload = pickled(obj)
        seq = self._steps.enter("allgather_object", name)

        def stages():
            sizes = np.zeros(self.size, dtype=np.int64)
            yield self.comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
            offsets = displacements(sizes)
            yield self.comm.Iallgatherv(payload, [data, (sizes, offsets), MPI.BYTE])
            return [pickle.loads(data[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

        return self._steps.run("allgather_object", seq, name, payload.nbytes, stages(), async_op)

    def broadcast_object(self, obj=None, src: int = 0, async_op: bool = False, name=None):
        """Return rank ``src``'s ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        self._steps.check_rank(src, "broadcast_object src")
        payload = pickled(obj) if self.rank == src else None
        seq = self._steps.enter("broadcast_object", name, root=src)

        def stages():
            size = np.array([payload.size if payload is not None else 0], dtype=np.int64)
            yield self.comm.Ibcast(size, root=src)
            data = payload if payload is not None else np.empty(int(size[0]), dtype=np.uint8)
            yield self.comm.Ibcast(data, root=src)
            return obj if self.rank == src else pickle.loads(data.tobytes())

        return self._steps.run("broadcast_object", seq, name, 0, stages(), async_op)

    # -- point to point -------------------------------------------------------------------------------------
    def send(self, array, dst: int, tag: int = 0, async_op: bool = False, name=None):
        """Send ``array`` to rank ``dst`` (``tag`` below 32760: the top tags are distlab's own)."""
        self._steps.check_usable()
        self._steps.check_rank(dst, "send dst")
        check_tag(tag, "send")
        buf, _ = movable(array, "send", name)
        start = self._steps.start()
        try:
            request = self.comm.Isend(buf, dest=dst, tag=tag)
        except MPI.Exception as exc:
            self._refused("send", exc)
        return self._steps.issue("send", 0, name, array.nbytes, request, None, None, async_op, dst, start)

    def recv(self, array, src=None, tag: int = 0, async_op: bool = False, name=None):
        """Receive into ``array`` from rank ``src`` (any rank when None); returns the sender's rank."""
        self._steps.check_usable()
        if src is not None:
            self._steps.check_rank(src, "recv src")
        check_tag(tag, "recv")
        buf, copy_back = movable(array, "recv", name)
        status = MPI.Status()

        def stages():
            yield StatusRequest(self.comm.Irecv(buf, source=MPI.ANY_SOURCE if src is None else src, tag=tag),
                                status)
            if copy_back:
                copy_back()
            return status.Get_source()

        return self._steps.run("recv", 0, name, array.nbytes, stages(), async_op, peer=src)
