"""Rooted collectives: ``reduce``, ``gather`` and ``scatter`` of arrays, and of picklable objects.

One rank, the root (``dst`` or ``src``), holds the result or the input; torch.distributed's rooted calls, with
their arguments and their errors. As every call of a group, each one checks everything about its arguments
before it takes its sequence number, so a rank whose call is refused stays in step with its peers:

* the root must pass its list (``gather_list``, ``scatter_list``, ``object_gather_list``,
  ``scatter_object_input_list``) with one entry per rank, every other rank must not (torch's rule);
* the arrays of a list must have the shape and dtype of the rank's own ``array``.

The rank's own array goes to MPI as its buffer (a device array directly when MPI is CUDA-aware, staged through
host memory otherwise: :mod:`distlab.comm.device`); the root's list travels through one contiguous host table
(one copy into or out of each entry), the way MPI's gather and scatter want it.
"""
from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp
from .device import backend_for, displacements, mpi_buffer, pickled
from .reduce_ops import as_bits, averaging, mpi_reduction, parse_op, reduction_buffer
from .steps import Calls, movable

__all__ = ["RootedOperations", "to_host", "pickled"]


class RootedOperations(Calls):
    """The rooted calls of :class:`~distlab.comm.ProcessGroup` (taking the group's
    :class:`~distlab.comm.steps.GroupSteps`, like :class:`~distlab.comm.operations.GroupOperations`)."""

    def reduce(self, array, dst: int = 0, op="sum", async_op: bool = False, name=None):
        """Reduce ``array`` across ranks into rank ``dst``'s ``array``, in place (``op`` as in :meth:`allreduce`).

        The other ranks' arrays are left as they were. Returns ``array`` (a :class:`~distlab.comm.Work` when
        ``async_op``).
        """
        reduce_op = parse_op(op)
        self._steps.check_rank(dst, "reduce dst")
        mpi_op = mpi_reduction(array.dtype, reduce_op, "reduce", name) if hasattr(array, "dtype") else None
        buf, copy_back = mpi_buffer(array, "reduce")
        root = self.rank == dst
        seq = self._steps.enter("reduce", name, array, root=dst, reduce_op=reduce_op)
        start = self._steps.start()
        spec = reduction_buffer(buf)
        request = self.comm.Ireduce(MPI.IN_PLACE if root else spec, spec if root else None, mpi_op, root=dst)
        finish = None
        if root:
            finish = averaging(buf, self.size, copy_back) if reduce_op is ReduceOp.AVG else copy_back
        return self._steps.issue("reduce", seq, name, array.nbytes, request, finish, array, async_op, None, start)

    def gather(self, array, gather_list=None, dst: int = 0, async_op: bool = False, name=None):
        """Gather every rank's ``array`` into rank ``dst``'s ``gather_list`` (one array per rank, in rank order).

        Returns ``gather_list`` on ``dst`` and None elsewhere (a Work when ``async_op``).
        """
        self._steps.check_rank(dst, "gather dst")
        send, _ = movable(array, "gather", name)
        targets = self._root_list(gather_list, array, dst, "gather", "gather_list", "destination", name)
        seq = self._steps.enter("gather", name, array, root=dst)
        start = self._steps.start()
        if targets is None:
            request = self.comm.Igather(send, None, root=dst)
            return self._steps.issue("gather", seq, name, array.nbytes, request, None, None, async_op, None, start)
        table = np.empty((self.size,) + tuple(array.shape), dtype=array.dtype)
        request = self.comm.Igather(send, as_bits(table), root=dst)

        def finish():
            for target, row in zip(targets, table):
                _write(target, row)

        return self._steps.issue("gather", seq, name, array.nbytes, request, finish, gather_list, async_op, None, start)

    def scatter(self, array, scatter_list=None, src: int = 0, async_op: bool = False, name=None):
        """Rank ``src`` sends ``scatter_list[r]`` to rank ``r``, which receives it into ``array`` (in place).

        Returns ``array`` (a Work when ``async_op``).
        """
        self._steps.check_rank(src, "scatter src")
        recv, copy_back = movable(array, "scatter", name)
        sources = self._root_list(scatter_list, array, src, "scatter", "scatter_list", "source", name)
        table = None
        if sources is not None:
            table = np.empty((self.size,) + tuple(array.shape), dtype=array.dtype)
            for row, source in zip(table, sources):
                row[...] = to_host(source)
        seq = self._steps.enter("scatter", name, array, root=src)
        start = self._steps.start()
        request = self.comm.Iscatter(None if table is None else as_bits(table), recv, root=src)
        return self._steps.issue("scatter", seq, name, array.nbytes, request, copy_back, array, async_op, None, start)

    def gather_object(self, obj, object_gather_list=None, dst: int = 0, async_op: bool = False, name=None):
        """Gather any picklable ``obj`` from every rank into rank ``dst``'s ``object_gather_list`` (in place).

        ``object_gather_list`` must be a list of ``size`` entries on ``dst``, and None elsewhere. Returns it on
        ``dst`` and None elsewhere (a Work when ``async_op``).
        """
        self._steps.check_rank(dst, "gather_object dst")
        self._object_list(object_gather_list, dst, "gather_object", "object_gather_list", "destination")
        payload = pickled(obj)
        root = self.rank == dst
        seq = self._steps.enter("gather_object", name, root=dst)

        def stages():
            sizes = np.zeros(self.size, dtype=np.int64)
            yield self.comm.Igather(np.array([payload.size], dtype=np.int64), sizes if root else None, root=dst)
            if not root:
                yield self.comm.Igatherv(payload, None, root=dst)
                return None
            offsets = displacements(sizes)
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
            yield self.comm.Igatherv(payload, [data, (sizes, offsets), MPI.BYTE], root=dst)
            for index, (offset, size) in enumerate(zip(offsets, sizes)):
                object_gather_list[index] = pickle.loads(data[offset:offset + size].tobytes())
            return object_gather_list

        return self._steps.run("gather_object", seq, name, payload.nbytes, stages(), async_op)

    def scatter_object_list(self, scatter_object_output_list, scatter_object_input_list=None, src: int = 0,
                            async_op: bool = False, name=None):
        """Rank ``src`` sends ``scatter_object_input_list[r]`` to rank ``r``, which finds it in
        ``scatter_object_output_list[0]`` (a list of at least one entry, on every rank).

        ``scatter_object_input_list`` is a list of ``size`` picklable objects on ``src``, ignored elsewhere.
        Returns the object received (a Work when ``async_op``).
        """
        self._steps.check_rank(src, "scatter_object_list src")
        if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
            raise ValueError("scatter_object_list: expected argument scatter_object_output_list to be a list of "
                             f"size at least 1, got {scatter_object_output_list!r}")
        root = self.rank == src
        payloads = None
        if root:
            self._object_list(scatter_object_input_list, src, "scatter_object_list", "scatter_object_input_list",
                              "source", forbid_elsewhere=False)
            payloads = [pickled(obj) for obj in scatter_object_input_list]
        seq = self._steps.enter("scatter_object_list", name, root=src)

        def stages():
            size = np.zeros(1, dtype=np.int64)
            sizes = np.array([p.size for p in payloads], dtype=np.int64) if root else None
            yield self.comm.Iscatter(sizes, size, root=src)
            data = np.empty(int(size[0]), dtype=np.uint8)
            if root:
                offsets = displacements(sizes)
                table = np.concatenate(payloads) if payloads else np.empty(0, dtype=np.uint8)
                yield self.comm.Iscatterv([table, (sizes, offsets), MPI.BYTE], data, root=src)
            else:
                yield self.comm.Iscatterv(None, data, root=src)
            scatter_object_output_list[0] = pickle.loads(data.tobytes())
            return scatter_object_output_list[0]

        return self._steps.run("scatter_object_list", seq, name, 0, stages(), async_op)

    # -- argument checks --------------------------------------------------------------------------------------
    def _root_list(self, arrays, array, root: int, what: str, argument: str, role: str, name):
        """Check a rooted call's list of arrays: one per rank on the root (shape and dtype of ``array``), none
        elsewhere (torch's rule). Returns the list on the root, None elsewhere."""
        label = f"{what} of {name!r}" if name else what
        if self.rank != root:
            if arrays:
                raise ValueError(f"{label}: argument ``{argument}`` must NOT be specified on non-{role} ranks "
                                 f"(this is rank {self.rank}; the {role} is rank {root})")
            return None
        if not arrays:
            raise ValueError(f"{label}: argument ``{argument}`` must be specified on the {role} rank "
                             f"(rank {root}): a list of {self.size} arrays")
        if len(arrays) != self.size:
            raise ValueError(f"{label}: ``{argument}`` must hold one array per rank ({self.size}), got "
                             f"{len(arrays)}")
        for index, item in enumerate(arrays):
            backend_for(item)  # a TypeError for anything that is not an array
            if tuple(item.shape) != tuple(array.shape) or item.dtype != array.dtype:
                raise ValueError(f"{label}: ``{argument}[{index}]`` is {item.dtype}{list(item.shape)}; every "
                                 f"entry must match the array, {array.dtype}{list(array.shape)}")
        return list(arrays)

    def _object_list(self, objects, root: int, what: str, argument: str, role: str,
                     forbid_elsewhere: bool = True) -> None:
        """Check a rooted object call's list: a list of ``size`` entries on the root, None elsewhere."""
        if self.rank != root:
            if forbid_elsewhere and objects:
                raise ValueError(f"{what}: argument ``{argument}`` must NOT be specified on non-{role} ranks (this "
                                 f"is rank {self.rank}; the {role} is rank {root})")
            return
        if not isinstance(objects, list) or len(objects) != self.size:
            got = f"a list of {len(objects)}" if isinstance(objects, list) else repr(objects)
            raise ValueError(f"{what}: argument ``{argument}`` must be a list of {self.size} entries (one per rank) "
                             f"on the {role} rank (rank {root}), got {got}")


def to_host(array) -> np.ndarray:
    """A host view (numpy) or copy (device array, once its stream is done) of ``array``."""
    if type(array) is np.ndarray:
        return array
    backend = backend_for(array)
    if backend.on_device:
        backend.synchronize(array)
    return np.asarray(backend.to_host(array))


def _write(target, host: np.ndarray) -> None:
    """Copy ``host`` into ``target`` (a numpy or device array of its shape and dtype)."""
    if type(target) is np.ndarray:
        target[...] = host
        return
    backend = backend_for(target)
    if backend.on_device:
        backend.from_host(target, host)
    else:
        target[...] = host

