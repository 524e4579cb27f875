"""The hierarchical transport: the allreduce Horovod runs with ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` (NCCL inside
each node, host MPI across nodes), for ranks on several nodes where NCCL has no network between them.

Mirrors ``NCCLHierarchicalAllreduce::Execute`` (``horovod/common/ops/nccl_operations.cc``). Every node holds the
same number of ranks ``L`` (Horovod's homogeneity; :func:`~distlab.comm.transports.choose` refuses a group whose
nodes differ, naming them). An allreduce of ``N`` elements splits them into ``L`` shards of ``N // L`` and a
remainder of ``N % L``:

1. an NCCL reduce-scatter inside the node leaves local rank ``k`` the node's reduction of shard ``k`` (in place,
   at its offset ``k * (N // L)``); the remainder goes to the node's last local rank by an NCCL reduce. That rank's
   shard and the remainder are contiguous, so it holds ``N // L + N % L`` elements; a count smaller than ``L``
   goes wholly through it;
2. each local rank allreduces what it holds across the nodes with host MPI, among the ranks of the same local rank
   (Horovod's cross communicator), through the staged transport's pinned arenas, chunked and pipelined;
3. an NCCL all-gather inside the node gives every local rank every shard, and an NCCL broadcast from the last
   local rank the remainder.

The remainder is handled as Horovod does rather than by padding: padding would need a device buffer of the padded
size and two more copies per call; the reduce and broadcast of fewer than ``L`` elements cost one small NCCL call
each. ``avg`` is a sum divided by the group size once the all-gather completed, as the other transports. A sum is
grouped by node first; on the stand-in, whose NCCL reduces with MPI, the conformance suite finds the staged
path's bits for every dtype on 2 nodes of 2 ranks (this MPI's allreduce of 4 ranks pairs them the same way; another
MPI may group floating-point sums differently, and a GPU's NCCL does).

Each phase waits for the one before, so the phases of collectives in flight are issued in one order on every
rank: the reduce-scatters when the collectives are called (on their own NCCL communicator and stream), each
cross-node call and each all-gather (on a second NCCL communicator and stream) only after every earlier
collective of the group issued its own, driving the earlier ones forward (ranks that wait on async work in
different orders still agree). Each communicator thus sees its calls in one order on every rank, and on a stream
of its own no rank queues one communicator's kernel behind the other's (which could wait on each other across
ranks); whether a GPU runs the two communicators' kernels side by side, as this needs while async allreduces
overlap, no GPU run has shown yet. The wait is bounded by the group's timeout and names the missing ranks, like
every wait.

The other collectives (broadcast, allgather, reduce_scatter), and the reductions NCCL lacks (see :mod:`.nccl`),
go through the staged path over the whole group: host MPI, which reaches every node.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..._types import ReduceOp
from ..device import device_array
from ..setup import barrier_within, release_comm
from ._streams import Streams
from .base import Transport
from .nccl import (UNIQUE_ID_BYTES, Communicator, close_communicator, device_buffer, finish_on_stream,
                   make_communicator, nccl_module, nccl_reduction)
from .staged import StagedTransport, allreduce_call

__all__ = ["HierarchicalTransport"]

_DONE = 3


class _Op:
    """One allreduce in flight: how far it got (1: its cross-node calls issued, 2: its all-gather issued)."""

    __slots__ = ("phase", "work")

    def __init__(self):
        self.phase = 0
        self.work = None


class _Turn:
    """Polled like a request: True once every earlier allreduce of the transport reached ``phase`` (polling
    them moves them forward)."""

    __slots__ = ("ops", "op", "phase")

    def __init__(self, ops: list, op: _Op, phase: int):
        self.ops, self.op, self.phase = ops, op, phase

    def Test(self) -> bool:  # noqa: N802 - polled like an mpi4py request
        for other in list(self.ops):
            if other is self.op:
                return True
            if other.phase < self.phase and other.work is not None:
                other.work.is_completed()  # polls it: moves it forward
            if other.phase < self.phase and not (other.work is not None and other.work.is_completed()):
                return False
        return True


def _release(scatter: Communicator, gather: Communicator, cross) -> None:
    close_communicator(scatter)
    close_communicator(gather)
    release_comm(cross)


class HierarchicalTransport(Transport):
    """Allreduce of one group's device arrays through NCCL inside each node and host MPI across them."""

    name = "hierarchical"

    def takes(self, what: str, name, *arrays) -> bool:
        """Every array of an allreduce (every local rank must issue the same NCCL calls, a joined rank's host
        zeros too); the other collectives as the staged path takes them."""
        if what == "allreduce":
            return all(device_array(array, what, name, host_too=True) for array in arrays)
        return self._staged.takes(what, name, *arrays)

    def __init__(self, steps, module, wait):
        super().__init__(steps)
        self._xp = module
        lib = self._lib = nccl_module(module)
        keys = [int(key) for key in steps.node_keys]
        local = [k for k, key in enumerate(keys) if key == keys[steps.rank]]
        self.local_rank, self.local_size = local.index(steps.rank), len(local)
        ids = np.zeros((2, UNIQUE_ID_BYTES), np.uint8)
        if self.local_rank == 0:  # each node's first rank makes its node's two ids
            ids[:] = [np.frombuffer(lib.get_unique_id(), np.uint8) for _ in range(2)]
        table = np.empty((steps.size, 2, UNIQUE_ID_BYTES), np.uint8)
        barrier_within(steps.comm, f"hierarchical transport of group {steps.name!r} set-up", steps.timeout)
        wait(steps.comm.Iallgather(ids, table), "hierarchical NCCL unique ids")  # every rank came: completes now
        self._scatter, self._gather = (make_communicator(lib, self.local_size, table[local[0], k], self.local_rank)
                                       for k in range(2))
        self._cross = steps.comm.Split(self.local_rank, steps.rank)  # every rank passed the barrier above
        self._release = weakref.finalize(self, _release, self._scatter, self._gather, self._cross)
        self._streams = Streams(module)
        self._staged = StagedTransport(steps)
        self._ops: list[_Op] = []
        self.fallbacks = 0  # allreduces NCCL has no reduction for, sent through the staged path

    def releaser(self):
        """Destroys (or aborts) the node's two NCCL communicators and frees the cross-node communicator."""
        return self._release

    @property
    def communicators(self) -> tuple:
        """The node's two NCCL communicators (reduce-scatter and reduce; all-gather and broadcast) and the MPI
        communicator of the ranks of this local rank across the nodes."""
        return self._scatter.nccl, self._gather.nccl, self._cross

    def allreduce(self, array, reduce_op, mpi_op, async_op: bool, name):
        """In-place allreduce: reduce-scatter in the node, MPI across the nodes, all-gather in the node."""
        plan = nccl_reduction(self._lib, array.dtype, reduce_op)
        if plan is None:
            self.fallbacks += 1
            return self._staged.allreduce(array, reduce_op, mpi_op, async_op, name)
        steps = self.steps
        seq = steps.enter("allreduce", name, array, reduce_op=reduce_op)
        op = _Op()
        self._ops.append(op)
        stages = self._stages(op, array, plan, allreduce_call(self._cross, array.dtype, mpi_op),
                              reduce_op is ReduceOp.AVG)
        work = op.work = steps.run("allreduce", seq, name, array.nbytes, stages, True)
        return work if async_op else work.result()

    def broadcast(self, array, src: int, async_op: bool, name):
        return self._staged.broadcast(array, src, async_op, name)

    def allgather(self, array, out, async_op: bool, name):
        return self._staged.allgather(array, out, async_op, name)

    def reduce_scatter(self, output, input, reduce_op, mpi_op, async_op: bool, name):  # noqa: A002
        return self._staged.reduce_scatter(output, input, reduce_op, mpi_op, async_op, name)

    def _stages(self, op: _Op, array, plan, cross_call, average: bool):
        """The allreduce's phases (see the module docstring); yields what each waits on."""
        xp, streams, size = self._xp, self._streams, self.steps.size
        datatype, nccl_op, per_element = plan
        scatter, gather, last = self._scatter, self._gather, self.local_size - 1
        stream, later = streams.down, streams.up  # the node's reductions; its all-gathers (see the docstring)
        try:
            caller = streams.after_caller()
            buffer = device_buffer(xp, array, stream)  # a joined rank's host zeros: a device buffer for NCCL
            flat, ptr, itemsize = buffer.reshape(-1), buffer.data.ptr, buffer.itemsize
            shard, rest = divmod(flat.size, self.local_size)
            mine = ptr + shard * itemsize * self.local_rank
            remainder = ptr + shard * itemsize * self.local_size
            with stream:
                if shard:
                    scatter.nccl.reduceScatter(ptr, mine, shard * per_element, datatype, nccl_op, stream.ptr)
                if rest:
                    scatter.nccl.reduce(remainder, remainder, rest * per_element, datatype, nccl_op, last,
                                        stream.ptr)
            yield from scatter.completed(streams, stream)
            yield _Turn(self._ops, op, 1)
            start = shard * self.local_rank
            count = shard + (rest if self.local_rank == last else 0)
            if count and self._cross.Get_size() > 1:
                pipeline = self._staged.pipeline(flat[start:start + count], cross_call, True, True, 0)
                request = next(pipeline)  # every chunk's MPI call is issued by now
                op.phase = 1
                while True:
                    yield request
                    try:
                        request = pipeline.send(None)
                    except StopIteration:
                        break
                later.wait_event(streams.record(self._staged.streams_for(xp).up))
            op.phase = 1
            yield _Turn(self._ops, op, 2)
            with later:
                if shard:
                    gather.nccl.allGather(mine, ptr, shard * per_element, datatype, later.ptr)
                if rest:
                    gather.nccl.bcast(remainder, rest * per_element, datatype, last, later.ptr)
            op.phase = 2
            yield from gather.completed(streams, later)
            finish_on_stream(later, buffer, size if average else 0, [(buffer, array)])
            streams.release_to(caller)
            return array
        finally:
            op.phase = _DONE
            self._ops.remove(op)
