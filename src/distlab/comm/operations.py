"""The calls of a process group: collectives on arrays and objects, and point to point.

Each call checks everything about its arguments (dtype and op, shapes, ranks, tags) *before* it takes its
sequence number (``_enter``): a rank whose call is refused stays in step with its peers, and its group stays
usable. Arrays go to MPI as their own buffers (device arrays staged through host memory unless MPI is
CUDA-aware, see :mod:`distlab.comm.device`); only the ``_object`` calls pickle.
"""
from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp
from .._wire import COMM_RESERVED_TAGS
from ..errors import CollectiveMismatchError
from ..timeline import now_us
from . import shared
from .device import check_buffer, displacements, empty_like, mpi_buffer, pickled
from .reduce_ops import averaging, check_movable, is_bfloat16, mpi_reduction, parse_op, reduction_buffer
from .pieces import SPLIT_FROM_BYTES, in_turn, piece_bytes, start_pieces
from .steps import GroupSteps
from .work import StatusRequest

__all__ = ["GroupOperations"]


class GroupOperations(GroupSteps):
    """The collective and point-to-point calls of :class:`~distlab.comm.ProcessGroup`; each checks its arguments,
    then takes the steps of its base class (:class:`~distlab.comm.steps.GroupSteps`)."""

    # -- collectives ------------------------------------------------------------------------------------------
    def allreduce(self, array, op="sum", async_op: bool = False, name=None):
        """Reduce ``array`` across ranks in place (``op``: sum, avg, min, max, product, band, bor)."""
        reduce_op = parse_op(op)
        mpi_op = mpi_reduction(array.dtype, reduce_op, "allreduce", name) if hasattr(array, "dtype") else None
        if self._transport is not None and self._transport.takes(array, "allreduce", name):
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
        piece = piece_bytes(self, array.nbytes) if array.nbytes >= SPLIT_FROM_BYTES else 0
        seq = self._enter("allreduce", name, array, reduce_op=reduce_op)
        start = now_us() if self._timeline_on else 0.0
        finish = copy_back
        if reduce_op is ReduceOp.AVG:
            finish = averaging(buf, self.size, copy_back)
        if piece:
            requests = start_pieces(self.comm, buf, piece, mpi_op, MPI.UINT16_T if is_bfloat16(array.dtype) else None)
            return self._staged("allreduce", seq, name, array.nbytes, in_turn(requests, finish, array), async_op)
        request = self.comm.Iallreduce(MPI.IN_PLACE, reduction_buffer(buf), mpi_op)  # bfloat16: our op, on its bits
        return self._issue("allreduce", seq, name, array.nbytes, request, finish, array, async_op, None, start)

    def _shared_allreduce(self, arena, offset: int, array, reduce_op, async_op: bool, name):
        """``allreduce`` of an array living in a shared-memory arena: arrive, reduce a block, done (see
        :mod:`distlab.comm.shared`)."""
        header = arena.header(offset, array)
        table = np.empty((self.size, header.size), dtype=np.int64)
        seq = self._enter("shared_allreduce", name, array, reduce_op=reduce_op)
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

        return self._staged("allreduce", seq, name, array.nbytes, stages(), async_op)

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
        offsets = shared.placed_offsets(table, header, self.rank, self._seq, name)
        if offsets is None:
            return self.allreduce(array, op=reduce_op.value, name=name)
        seq = self._enter("shared_allreduce", name, array, reduce_op=reduce_op)
        done = arena.expect_done(seq)

        def stages():
            arena.reduce_block(offset, array.size, array.dtype, reduce_op is ReduceOp.AVG, offsets)
            yield done.send()
            return array

        return self._staged("allreduce", seq, name, array.nbytes, stages(), False)

    def broadcast(self, array, src: int = 0, async_op: bool = False, name=None):
        """Overwrite ``array`` on every rank with rank ``src``'s copy."""
        self._check_rank(src, "broadcast src")
        if self._transport is not None and self._transport.takes(array, "broadcast", name):
            return self._transport.broadcast(array, src, async_op, name)
        buf, copy_back = self._movable(array, "broadcast", name)
        seq = self._enter("broadcast", name, array, root=src)
        start = self._start()
        request = self.comm.Ibcast(buf, root=src)
        return self._issue("broadcast", seq, name, array.nbytes, request, copy_back, array, async_op, None, start)

    def allgather(self, array, out=None, async_op: bool = False, name=None):
        """Gather every rank's ``array`` into ``out`` of shape ``(size,) + array.shape`` (returned)."""
        transport = self._transport
        if transport is None:
            send, _ = self._movable(array, "allgather", name)
        else:  # checked alike, staged for MPI only if the transport does not take the arrays
            self._movable(array, "allgather", name, stage=False)
        if out is None:
            out = empty_like(array, (self.size,) + tuple(array.shape))
        if tuple(out.shape) != (self.size,) + tuple(array.shape) or out.dtype != array.dtype:
            raise ValueError(f"allgather: out must have shape {(self.size,) + tuple(array.shape)} and dtype "
                             f"{array.dtype}, got {tuple(out.shape)} {out.dtype}")
        if transport is not None:
            if transport.takes(array, "allgather", name) and transport.takes(out, "allgather", name):
                return transport.allgather(array, out, async_op, name)
            send, _ = self._movable(array, "allgather", name)
        recv, copy_back = self._movable(out, "allgather", name)
        seq = self._enter("allgather", name, array)
        start = self._start()
        request = self.comm.Iallgather(send, recv)
        return self._issue("allgather", seq, name, array.nbytes, request, copy_back, out, async_op, None, start)

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
            if transport.takes(input, "reduce_scatter", name) and transport.takes(output, "reduce_scatter", name):
                return transport.reduce_scatter(output, input, reduce_op, mpi_op, async_op, name)
            send, _ = mpi_buffer(input, "reduce_scatter")
            recv, copy_back = mpi_buffer(output, "reduce_scatter")
        finish = averaging(output if copy_back is None else recv, self.size, copy_back) \
            if reduce_op is ReduceOp.AVG else copy_back  # the array (staged: its host copy), not its bfloat16 bits
        send, recv = reduction_buffer(send), reduction_buffer(recv)
        seq = self._enter("reduce_scatter", name, input, reduce_op=reduce_op)
        start = self._start()
        request = self.comm.Ireduce_scatter_block(send, recv, mpi_op)
        return self._issue("reduce_scatter", seq, name, input.nbytes, request, finish, output, async_op, None,
                           start)

    def alltoall(self, output, input, async_op: bool = False, name=None):  # noqa: A002
        """Send block ``j`` of ``input`` to rank ``j``; block ``i`` of ``output`` comes from rank ``i``."""
        send, _ = self._movable(input, "alltoall", name)
        recv, copy_back = self._movable(output, "alltoall", name)
        if input.size != output.size or input.dtype != output.dtype or input.size % self.size:
            raise ValueError(f"alltoall: input and output need the same size and dtype, divisible by {self.size}")
        seq = self._enter("alltoall", name, input)
        start = self._start()
        request = self.comm.Ialltoall(send, recv)
        return self._issue("alltoall", seq, name, input.nbytes, request, copy_back, output, async_op, None, start)

    def barrier(self, async_op: bool = False, name=None):
        """Wait until every rank of the group reached this barrier."""
        seq = self._enter("barrier", name)
        start = self._start()
        return self._issue("barrier", seq, name, 0, self.comm.Ibarrier(), None, None, async_op, None, start)

    def allgather_object(self, obj, async_op: bool = False, name=None):
        """Gather any picklable object from every rank; returns the list in rank order."""
        payload = pickled(obj)
        seq = self._enter("allgather_object", name)

        def stages():
            sizes = np.zeros(self.size, dtype=np.int64)
            yield self.comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
            offsets = displacements(sizes)
            yield self.comm.Iallgatherv(payload, [data, (sizes, offsets), MPI.BYTE])
            return [pickle.loads(data[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

        return self._staged("allgather_object", seq, name, payload.nbytes, stages(), async_op)

    def broadcast_object(self, obj=None, src: int = 0, async_op: bool = False, name=None):
        """Return rank ``src``'s ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        self._check_rank(src, "broadcast_object src")
        payload = pickled(obj) if self.rank == src else None
        seq = self._enter("broadcast_object", name, root=src)

        def stages():
            size = np.array([payload.size if payload is not None else 0], dtype=np.int64)
            yield self.comm.Ibcast(size, root=src)
            data = payload if payload is not None else np.empty(int(size[0]), dtype=np.uint8)
            yield self.comm.Ibcast(data, root=src)
            return obj if self.rank == src else pickle.loads(data.tobytes())

        return self._staged("broadcast_object", seq, name, 0, stages(), async_op)

    # -- point to point -------------------------------------------------------------------------------------
    def send(self, array, dst: int, tag: int = 0, async_op: bool = False, name=None):
        """Send ``array`` to rank ``dst`` (``tag`` below 32760: the top tags are distlab's own)."""
        self._check_usable()
        self._check_rank(dst, "send dst")
        _check_tag(tag, "send")
        buf, _ = self._movable(array, "send", name)
        start = self._start()
        request = self.comm.Isend(buf, dest=dst, tag=tag)
        return self._issue("send", 0, name, array.nbytes, request, None, None, async_op, dst, start)

    def recv(self, array, src=None, tag: int = 0, async_op: bool = False, name=None):
        """Receive into ``array`` from rank ``src`` (any rank when None); returns the sender's rank."""
        self._check_usable()
        if src is not None:
            self._check_rank(src, "recv src")
        _check_tag(tag, "recv")
        buf, copy_back = self._movable(array, "recv", name)
        status = MPI.Status()

        def stages():
            yield StatusRequest(self.comm.Irecv(buf, source=MPI.ANY_SOURCE if src is None else src, tag=tag),
                                status)
            if copy_back:
                copy_back()
            return status.Get_source()

        return self._staged("recv", 0, name, array.nbytes, stages(), async_op, peer=src)

    # -- argument checks --------------------------------------------------------------------------------------
    @staticmethod
    def _movable(array, what: str, name, stage: bool = True):
        """``mpi_buffer`` after the dtype check; ml_dtypes arrays travel as their bits. Without ``stage``, only
        the checks (``check_buffer``), for a call whose transport may yet take the array: ``(None, None)``."""
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

    def _check_rank(self, rank: int, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"{what}={rank!r} is not a rank of group {self.name!r} (size {self.size})")


def _check_tag(tag, what: str) -> None:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < COMM_RESERVED_TAGS.start:
        raise ValueError(f"{what}: tag={tag!r} must be an int in [0, {COMM_RESERVED_TAGS.start - 1}] (tags "
                         f"{COMM_RESERVED_TAGS.start}-{COMM_RESERVED_TAGS.stop - 1} are reserved by distlab)")
