"""The NCCL transport: device collectives through one NCCL communicator per group, bootstrapped over MPI.

Set-up mirrors Horovod's ``NCCLOpContext::InitNCCLComm`` (``horovod/common/ops/nccl_operations.cc``): when the
group is made, a bounded barrier checks every rank came (one that never did, rank 0 included, is named there, not
left hanging in ``ncclCommInitRank``, which has no deadline), its rank 0 makes the unique id
(``xp.cuda.nccl.get_unique_id()``), the group's MPI communicator broadcasts it, and every rank makes its
``NcclCommunicator(size, id, rank)``, kept for the group's life: one communicator per group, as Horovod keeps one
per process set. MPI stays the control plane: sequence numbers, arrival, DETAIL fingerprints, timeouts naming
ranks, Join.

A collective is issued when it is called, on the transport's stream, ordered after the caller's stream by an
event (:class:`~._streams.Streams`); an event recorded after it is polled as the operation's request, so a wait
is bounded by the group's timeout and names the ranks that never arrived, like every other wait (on a GPU the
NCCL kernel then still waits for them: the group is broken from then on, and its communicator is aborted, not
destroyed, when the group goes, as Horovod's ``commDestroyOrAbort``). Once it completed, the caller's stream waits
on the transport's last event.

What NCCL is given: broadcast and allgather move bytes (``NCCL_UINT8``), so every dtype goes. Reductions map
distlab's ops to NCCL's: sum, min, max and product as such; ``avg`` as a sum divided by the group size once it
completed (``NCCL_AVG`` since NCCL 2.10 scales each input by ``1/size`` before summing, which rounds differently
from the staged path's divided sum, and cupy builds before it lack the constant); bool as ``uint8`` with max for
sum, max and bor, min for min, product and band (MPI's logical ops on 0/1 bytes, as torch maps them); complex sum
and avg as pairs of floats. What NCCL has no reduction for goes through the staged path instead (the same MPI
calls on every rank, so the group's calls keep one meaning whatever the transport): ``band``/``bor`` of integers,
int16 and uint16, a complex product, and bfloat16 when the NCCL module lacks ``NCCL_BFLOAT16``.

Bits: integer reductions (and min, max, broadcast, allgather) are exact, so equal the staged path's.
Floating-point sums on a GPU follow NCCL's ring or tree order, not MPI's, and may differ in the last bits: compare
them with the tolerance the GPU tests use against numpy (float32 ``rtol=1e-4, atol=1e-5``, float64 ``1e-12``;
not yet measured on NCCL, which no GPU run has reached). On the stand-in, which reduces with MPI, they are the
staged path's bits.

Arrays in host memory (a joined rank's shadow of zeros meeting the others' device collectives) are copied into a
device buffer for the collective and back, so every rank issues the same NCCL call.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..._types import ReduceOp
from ..device import device_array
from ..setup import barrier_within
from ._streams import Streams
from .base import Transport

__all__ = ["NcclTransport", "nccl_module", "nccl_reduction", "Communicator", "make_communicator", "close_communicator",
           "device_buffer", "finish_on_stream", "UNIQUE_ID_BYTES"]

_BY_NAME = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
            "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
            "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16", "complex64": "NCCL_FLOAT32",
            "complex128": "NCCL_FLOAT64", "bool": "NCCL_UINT8"}
UNIQUE_ID_BYTES = 128  # ncclUniqueId (cupy 14 hands it over as 128 bytes)
_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.AVG: "NCCL_SUM", ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX",
        ReduceOp.PRODUCT: "NCCL_PROD"}
_BOOL_OPS = {ReduceOp.SUM: "NCCL_MAX", ReduceOp.MAX: "NCCL_MAX", ReduceOp.BOR: "NCCL_MAX",
             ReduceOp.MIN: "NCCL_MIN", ReduceOp.PRODUCT: "NCCL_MIN", ReduceOp.BAND: "NCCL_MIN"}


def nccl_module(xp):
    """``xp.cuda.nccl`` when it is there and its library loaded (cupy: ``cupy.cuda.nccl.available``), else None."""
    if xp is None:
        return None
    if xp.__name__ == "cupy":
        try:
            import cupy.cuda.nccl as module
        except ImportError:
            return None
    else:
        module = getattr(xp.cuda, "nccl", None)
    return module if module is not None and getattr(module, "available", False) else None


def nccl_reduction(lib, dtype, reduce_op):
    """``(NCCL datatype, NCCL op, NCCL elements per array element)`` of NCCL module ``lib``, or None when NCCL has
    no such reduction (the staged path takes it)."""
    key = "bool" if dtype.kind == "b" else dtype.name
    ops = _BOOL_OPS if dtype.kind == "b" else _OPS
    if key not in _BY_NAME or reduce_op not in ops or dtype.kind == "c" and reduce_op is ReduceOp.PRODUCT:
        return None
    datatype = getattr(lib, _BY_NAME[key], None)
    if datatype is None:  # NCCL_BFLOAT16 missing from an older cupy
        return None
    return datatype, getattr(lib, ops[reduce_op]), 2 if dtype.kind == "c" else 1


class Communicator:
    """The group's NCCL communicator and how many of its collectives are still running (what the group's end
    decides between destroy and abort on). Holds no reference to the group."""

    __slots__ = ("nccl", "running")

    def __init__(self, nccl):
        self.nccl = nccl
        self.running = 0

    def completed(self, streams, stream):
        """Yield what completes the collective just issued on ``stream`` (for ``yield from``), counting it as
        running meanwhile: one abandoned at that wait (a timeout) leaves the communicator to be aborted."""
        self.running += 1
        yield _Completion(streams.record(stream), self.nccl)
        self.running -= 1


def make_communicator(lib, size: int, uid, rank: int) -> Communicator:
    """Rank ``rank`` of the ``size``-rank NCCL communicator of unique id ``uid`` (a uint8 array of its bytes)."""
    return Communicator(lib.NcclCommunicator(size, uid.tobytes(), rank))


def close_communicator(state: Communicator) -> None:
    """Destroy the communicator, or abort it when a collective never completed (a timed-out wait)."""
    if state.running:
        state.nccl.abort()
    else:
        state.nccl.destroy()


def device_buffer(xp, array, stream, copy_in: bool = True):
    """``array`` itself when it is in device memory; for a host array, a device buffer of its shape made on
    ``stream`` (holding its values, copied on ``stream``, when ``copy_in``)."""
    if type(array) is not np.ndarray:
        return array
    with stream:
        buffer = xp.empty(array.shape, dtype=array.dtype)
    if copy_in:
        buffer.set(array, stream=stream)
    return buffer


def finish_on_stream(stream, result, divisor, copies) -> None:
    """On ``stream``, once the collective completed: ``result /= divisor`` unless ``divisor`` is 0 (an average:
    the stand-in runs kernels at once, a GPU queues them), then each ``(device buffer, host array)`` of ``copies``
    copied back unless they are one array."""
    with stream:
        if divisor:
            result /= divisor
        for buffer, array in copies:
            if buffer is not array:
                buffer.get(stream=stream, out=array)


class _Completion:
    """Polled like a request: True once the event recorded after the collective is done (``cudaEventQuery``);
    an asynchronous NCCL error (a peer's failure) is raised instead of waiting on."""

    __slots__ = ("event", "comm")

    def __init__(self, event, comm):
        self.event, self.comm = event, comm

    def Test(self) -> bool:  # noqa: N802 - polled like an mpi4py request
        if self.event.done:
            return True
        self.comm.check_async_error()
        return False


class NcclTransport(Transport):
    """Device collectives of one group through its NCCL communicator (see the module docstring)."""

    name = "nccl"

    def takes(self, what: str, name, *arrays) -> bool:
        """Every array of the four collectives (checked: contiguous, a movable dtype): a rank may meet the others'
        device collective with host memory, and every rank must issue the same NCCL call."""
        return all(device_array(array, what, name, host_too=True) for array in arrays)

    def __init__(self, steps, module, wait):
        super().__init__(steps)
        self._xp = module
        nccl = self._lib = nccl_module(module)
        what = f"nccl transport of group {steps.name!r} set-up"
        barrier_within(steps.comm, what, steps.timeout)  # names any rank that never came, rank 0 included
        uid = np.zeros(UNIQUE_ID_BYTES, np.uint8)
        if steps.rank == 0:
            uid[:] = np.frombuffer(nccl.get_unique_id(), np.uint8)
        wait(steps.comm.Ibcast(uid, root=0), "nccl unique id")
        self._state = make_communicator(nccl, steps.size, uid, steps.rank)
        self._release = weakref.finalize(self, close_communicator, self._state)
        self._streams = Streams(module)
        self._staged = None
        self.fallbacks = 0  # collectives NCCL has no reduction for, sent through the staged path

    def releaser(self):
        """Destroys the NCCL communicator (or aborts it, when a collective never completed)."""
        return self._release

    @property
    def communicator(self):
        """The group's NCCL communicator (cupy's ``NcclCommunicator``, or the stand-in's)."""
        return self._state.nccl

    def allreduce(self, array, reduce_op, mpi_op, async_op: bool, name):
        """In-place allreduce through NCCL (or the staged path for a reduction NCCL lacks)."""
        plan = nccl_reduction(self._lib, array.dtype, reduce_op)
        if plan is None:
            return self._fallback().allreduce(array, reduce_op, mpi_op, async_op, name)
        datatype, op, per_element = plan
        seq = self.steps.enter("allreduce", name, array, reduce_op=reduce_op)

        def issue(comm, buf, stream):
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size * per_element, datatype, op, stream.ptr)

        return self._run("allreduce", seq, name, [(array, True, True)], issue, reduce_op is ReduceOp.AVG,
                         array, async_op)

    def broadcast(self, array, src: int, async_op: bool, name):
        """Broadcast of rank ``src``'s array, as bytes."""
        seq = self.steps.enter("broadcast", name, array, root=src)
        mine = self.steps.rank == src

        def issue(comm, buf, stream):
            comm.bcast(buf.data.ptr, buf.nbytes, self._lib.NCCL_UINT8, src, stream.ptr)

        return self._run("broadcast", seq, name, [(array, mine, not mine)], issue, False, array, async_op)

    def allgather(self, array, out, async_op: bool, name):
        """Gather every rank's ``array`` into ``out`` (shape ``(size,) + array.shape``), as bytes."""
        seq = self.steps.enter("allgather", name, array)

        def issue(comm, send, recv, stream):
            comm.allGather(send.data.ptr, recv.data.ptr, send.nbytes, self._lib.NCCL_UINT8, stream.ptr)

        return self._run("allgather", seq, name, [(array, True, False), (out, False, True)], issue, False, out,
                         async_op)

    def reduce_scatter(self, output, input, reduce_op, mpi_op, async_op: bool, name):  # noqa: A002
        """Reduce ``input`` across ranks; rank ``r`` receives block ``r`` in ``output``."""
        plan = nccl_reduction(self._lib, input.dtype, reduce_op)
        if plan is None:
            if (type(input) is np.ndarray) != (type(output) is np.ndarray):
                raise ValueError(f"reduce_scatter{f' of {name!r}' if name else ''}: NCCL has no {reduce_op.value} "
                                 f"of {input.dtype}, and the staged path it then takes needs input and output "
                                 "both in device memory or both in host memory")
            return self._fallback().reduce_scatter(output, input, reduce_op, mpi_op, async_op, name)
        datatype, op, per_element = plan
        seq = self.steps.enter("reduce_scatter", name, input, reduce_op=reduce_op)

        def issue(comm, send, recv, stream):
            comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size * per_element, datatype, op, stream.ptr)

        return self._run("reduce_scatter", seq, name, [(input, True, False), (output, False, True)], issue,
                         reduce_op is ReduceOp.AVG, output, async_op)

    # -- internals ---------------------------------------------------------------------------------------
    def _fallback(self):
        if self._staged is None:
            from .staged import StagedTransport

            self._staged = StagedTransport(self.steps)
        self.fallbacks += 1
        return self._staged

    def _run(self, op: str, seq: int, name, operands, issue, average: bool, result, async_op: bool):
        """Issue the collective now (``issue(communicator, *device buffers, stream)``) and return its Work.

        ``operands`` are ``(array, copied in, copied out)``: a host array gets a device buffer for the call.
        """
        xp, streams, state, size = self._xp, self._streams, self._state, self.steps.size
        stream = streams.down

        def stages():
            caller = streams.after_caller()
            buffers = [device_buffer(xp, array, stream, down) for array, down, _ in operands]
            issue(state.nccl, *buffers, stream)
            yield from state.completed(streams, stream)
            finish_on_stream(stream, buffers[-1], size if average else 0,
                    [(buffer, array) for (array, _, up), buffer in zip(operands, buffers) if up])
            streams.release_to(caller)
            return result

        return self.steps.run(op, seq, name, operands[0][0].nbytes, stages(), async_op)
