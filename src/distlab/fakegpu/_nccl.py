"""``cupy.cuda.nccl`` for the stand-in: NCCL communicators whose collectives reduce with MPI.

The names and argument orders are cupy's (``cupy_backends/cuda/libs/nccl.pyx``): :func:`get_unique_id`,
``NcclCommunicator(ndev, commId, rank)``, ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)`` with raw
device pointers and a raw stream pointer, ``bcast``, ``broadcast``, ``allGather``, ``reduceScatter``, ``reduce``,
``destroy``, ``abort``, ``check_async_error``, the ``NCCL_*`` constants and :class:`NcclError`. Pointers are
resolved through the addresses stand-in arrays handed out (``a.data.ptr``); one that names no live array is an
``NCCL_ERROR_INVALID_ARGUMENT``, as NCCL refuses an invalid device pointer.

The rendezvous is NCCL's bootstrap (``bootstrap.cc``: the unique id carries the root's listening address; each
rank connects to the root, which answers once all ``ndev`` have) over ``COMM_WORLD``: the id carries its
creator's world rank and a random token; every other member sends ``[token, rank, world rank, ndev]`` to the
creator (tag ``NCCL_BOOTSTRAP_TAG`` of ``distlab._wire``), the creator gathers them inside its own ``NcclCommunicator`` call and answers
each with the table of world ranks (``NCCL_BOOTSTRAP_REPLY_TAG``), and the members build their communicator with
``MPI.COMM_WORLD.Create_group``. Requests and answers carry the token, so ids rendezvousing at once (two groups)
never mix: one that arrives for another id waits in a mailbox for it. Every wait is bounded by
``DISTLAB_TIMEOUT``: the creator's error names the ranks that never came (and it tells the members that came),
a member's names the creator when no answer came at all. Unlike NCCL, whose root answers from a thread, the
creator must itself be a member (it answers during its own set-up), as every caller here arranges (rank 0 makes
the id, as Horovod does).

A collective is issued at once as MPI's nonblocking counterpart on the communicator's own MPI communicator and
queued on the stream it was given (:func:`distlab.fakegpu._queue.enqueue`): an event recorded after it is done once
MPI completed it, which is how a caller waits for a GPU's NCCL kernel. Because MPI reduces, every rank gets the
same bits, and the same bits as MPI's allreduce of the same arrays; a GPU's NCCL sums in its own ring or tree
order. The version reported is 2.28.9 (the ``nvidia-nccl-cu13`` wheel the GPU check ran); ``NCCL_AVG`` is not
defined, as in a cupy built before it (callers divide a sum), and bfloat16 needs ``ml_dtypes``, as bfloat16
arrays themselves do.
"""
from __future__ import annotations

import operator
import secrets
import time
import weakref

import numpy as np

from .._types import ReduceOp as _ReduceOp
from .._wire import NCCL_BOOTSTRAP_REPLY_TAG as _REPLY_TAG, NCCL_BOOTSTRAP_TAG as _REQUEST_TAG
from . import _queue, cuda as _cuda
from ._ndarray import resolve_pointer as _resolve_pointer

__all__ = ["available", "NcclError", "NcclCommunicator", "get_unique_id", "get_version", "get_build_version",
           "NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_INT8", "NCCL_CHAR", "NCCL_UINT8",
           "NCCL_INT32", "NCCL_INT", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64", "NCCL_FLOAT16", "NCCL_HALF",
           "NCCL_FLOAT32", "NCCL_FLOAT", "NCCL_FLOAT64", "NCCL_DOUBLE", "NCCL_BFLOAT16", "_UNIQUE_ID_BYTES"]

available = True
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
_UNIQUE_ID_BYTES = 128

_VERSION = 22809
_MAGIC = b"dlNC"
_INVALID_ARGUMENT, _INVALID_USAGE, _REMOTE_ERROR = 4, 5, 6
#: ncclGetErrorString's words for each result
_STRINGS = {1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            3: "internal error - please report this issue to the NCCL developers",
            4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
            5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
            6: "remote process exited or there was a network error"}
_ERRORS = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR", 3: "NCCL_ERROR_INTERNAL_ERROR",
           4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR"}
_DTYPES = {NCCL_INT8: "int8", NCCL_UINT8: "uint8", NCCL_INT32: "int32", NCCL_UINT32: "uint32",
           NCCL_INT64: "int64", NCCL_UINT64: "uint64", NCCL_FLOAT16: "float16", NCCL_FLOAT32: "float32",
           NCCL_FLOAT64: "float64", NCCL_BFLOAT16: "bfloat16"}
_OPS = {NCCL_SUM: _ReduceOp.SUM, NCCL_PROD: _ReduceOp.PRODUCT, NCCL_MAX: _ReduceOp.MAX, NCCL_MIN: _ReduceOp.MIN}
_OK, _TIMED_OUT, _CLASH = 0, 1, 2
_mailbox: dict[int, list] = {}  # token -> bootstrap messages that came while another id was being served
_orphans: list = []  # collectives of aborted communicators (MPI may still use their buffers)


class _LazyMPI:
    """``mpi4py.MPI``, imported on first use: importing the stand-in does not initialise MPI."""

    def __getattr__(self, name):
        from mpi4py import MPI as module

        return getattr(module, name)


_MPI = _LazyMPI()


class NcclError(RuntimeError):
    """An NCCL call failed: ``NcclError(status)`` as cupy's, ``"NCCL_ERROR_...: "`` and NCCL's own words
    (``ncclGetErrorString``); the stand-in's refusals add the cause in parentheses (:func:`_error`)."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"{_ERRORS.get(status, status)}: {_STRINGS.get(status, 'unknown result')}")

    def __reduce__(self):
        return _rebuilt, (self.status, str(self))


def _error(status: int, detail: str) -> NcclError:
    """cupy's ``NcclError(status)``, its message followed by the cause the stand-in knows."""
    error = NcclError(status)
    error.args = (f"{error.args[0]} ({detail})",)
    return error


def _rebuilt(status: int, message: str) -> NcclError:
    error = NcclError(status)
    error.args = (message,)
    return error


def get_version() -> int:
    """The NCCL version code (major * 10000 + minor * 100 + patch) the stand-in answers as."""
    return _VERSION


def get_build_version() -> int:
    return _VERSION


def get_unique_id() -> bytes:
    """A new unique id: 128 bytes (cupy 14 hands them over as ``bytes``, earlier cupy as a tuple of ints) carrying
    this process's world rank and a random token."""
    raw = _MAGIC + np.array([_MPI.COMM_WORLD.Get_rank(), secrets.randbits(62)], dtype="<i8").tobytes()
    return raw.ljust(_UNIQUE_ID_BYTES, b"\0")


class NcclCommunicator:
    """One rank of an NCCL communicator of ``ndev`` ranks made from ``commId`` (see the module docstring)."""

    def __init__(self, ndev: int, commId: bytes, rank: int):  # noqa: N803 - cupy's argument name
        if not isinstance(commId, bytes):  # cupy's typed argument, its message
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != _UNIQUE_ID_BYTES or commId[:4] != _MAGIC:
            raise _error(_INVALID_ARGUMENT, "commId is not a unique id from get_unique_id()")
        if not 0 <= rank < ndev:
            raise _error(_INVALID_ARGUMENT, f"rank {rank} is not in [0, {ndev})")
        owner, token = (int(w) for w in np.frombuffer(commId[4:20], dtype="<i8"))
        self._ndev, self._rank, self._token = int(ndev), int(rank), token
        from distlab.comm.setup import free_deferred, release_comm

        free_deferred()
        table = _rendezvous(owner, token, self._ndev, self._rank)
        world = _MPI.COMM_WORLD.Get_group()
        members = world.Incl(table)
        try:
            self._mpi = _MPI.COMM_WORLD.Create_group(members, token % 32768)
        finally:
            members.Free()
            world.Free()
        self._running: list = []
        self._aborted = False
        self._device = _cuda.runtime.getDevice()
        self._finalizer = weakref.finalize(self, release_comm, self._mpi)

    # -- what cupy's communicator answers ------------------------------------------------------------------
    @property
    def comm(self) -> int:
        """A handle; 0 once destroyed or aborted (as cupy's)."""
        return id(self) if self._finalizer.alive else 0

    def rank_id(self) -> int:
        self._live()
        return self._rank

    def size(self) -> int:
        self._live()
        return self._ndev

    def device_id(self) -> int:
        """The device current when the communicator was made."""
        self._live()
        return self._device

    def destroy(self) -> None:
        """Free the communicator once its collectives completed (``ncclCommDestroy`` finalizes first)."""
        if self._finalizer.alive:
            _queue.wait_for(self._still_running(), "NcclCommunicator.destroy")
            self._finalizer()

    def abort(self) -> None:
        """Free the communicator now, abandoning collectives still running (``ncclCommAbort``)."""
        if self._finalizer.alive:
            self._aborted = True
            _orphans.extend(self._still_running())
            self._finalizer()

    def check_async_error(self) -> None:
        if self._aborted:
            raise _error(_REMOTE_ERROR, "the communicator was aborted")

    # -- collectives ---------------------------------------------------------------------------------------
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int):  # noqa: N802
        _integers(sendbuf, recvbuf, count, datatype, op, stream)
        send, recv, dtype = self._buffers(sendbuf, count, recvbuf, count, datatype)
        if recv is not None:
            source = _MPI.IN_PLACE if sendbuf == recvbuf else send
            self._queue(stream, self._mpi.Iallreduce(source, recv, _mpi_op(op, dtype)))

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,  # noqa: N802
                      stream: int):
        _integers(sendbuf, recvbuf, recvcount, datatype, op, stream)
        send, recv, dtype = self._buffers(sendbuf, recvcount * self._ndev, recvbuf, recvcount, datatype, False)
        if recv is not None:
            self._queue(stream, self._mpi.Ireduce_scatter_block(send, recv, _mpi_op(op, dtype)))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int):
        """Reduce into rank ``root``'s ``recvbuf`` (read only there, as NCCL's)."""
        _integers(sendbuf, recvbuf, count, datatype, op, root, stream)
        if not 0 <= root < self._ndev:
            raise _error(_INVALID_ARGUMENT, f"root {root} is not in [0, {self._ndev})")
        mine = self._rank == root
        send, recv, dtype = self._buffers(sendbuf, count, recvbuf, count if mine else 0, datatype)
        if not count:
            return
        if not mine:
            send = _typed(_memory(sendbuf, count, dtype, "sendbuff"))
            self._queue(stream, self._mpi.Ireduce(send, None, _mpi_op(op, dtype), root=root))
            return
        source = _MPI.IN_PLACE if sendbuf == recvbuf else send
        self._queue(stream, self._mpi.Ireduce(source, recv, _mpi_op(op, dtype), root=root))

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int):  # noqa: N802
        _integers(sendbuf, recvbuf, count, datatype, stream)
        send, recv, _ = self._buffers(sendbuf, count, recvbuf, count * self._ndev, datatype, False)
        if recv is not None:
            self._queue(stream, self._mpi.Iallgather(send, recv))

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int):
        _integers(sendbuff, recvbuff, count, datatype, root, stream)
        if not 0 <= root < self._ndev:
            raise _error(_INVALID_ARGUMENT, f"root {root} is not in [0, {self._ndev})")
        send, recv, _ = self._buffers(sendbuff, count if self._rank == root else 0, recvbuff, count, datatype)
        if recv is not None:
            if send is not None and sendbuff != recvbuff:
                recv[...] = send  # the root's copy: a kernel, run at once
            self._queue(stream, self._mpi.Ibcast(recv, root=root))

    # -- internals ---------------------------------------------------------------------------------------
    def _live(self) -> None:
        if not self._finalizer.alive:
            raise _error(_INVALID_ARGUMENT, "the communicator was destroyed")

    def _still_running(self) -> list:
        self._running = [work for work in self._running if not work.Test()]
        return self._running

    def _buffers(self, sendptr: int, sendcount: int, recvptr: int, recvcount: int, datatype: int,
                 same_ok: bool = True):
        """The typed views of the memory behind both pointers (a copy of the send side when they overlap
        without being the same buffer, or at all unless ``same_ok``: the in-place reduce-scatter and all-gather of
        NCCL, whose receive buffer holds the send buffer at the rank's offset, are no in-place call MPI has, and MPI
        refuses aliased buffers); ``recv`` is None for an empty collective."""
        self._live()
        if datatype not in _DTYPES:
            raise _error(_INVALID_ARGUMENT, f"datatype {datatype} is not an NCCL datatype")
        dtype = _dtype(datatype)
        if not recvcount:
            return None, None, dtype
        recv = _memory(recvptr, recvcount, dtype, "recvbuff")
        send = None
        if sendcount:
            send = _memory(sendptr, sendcount, dtype, "sendbuff")
            end, recv_end = sendptr + send.nbytes, recvptr + recv.nbytes
            if (sendptr != recvptr or not same_ok) and sendptr < recv_end and recvptr < end:
                send = send.copy()
        return _typed(send), _typed(recv), dtype

    def _queue(self, stream: int, request) -> None:
        self._running = self._still_running() + [request]
        _queue.enqueue(stream, request)


def _integers(*values) -> None:
    """cupy's collectives take C integers (``intptr_t sendbuf``, ``size_t count``, ``intptr_t stream``): anything
    else (a ``MemoryPointer``, a ``Stream``) is refused with Python's TypeError, as Cython's conversion refuses it."""
    for value in values:
        operator.index(value)


def _memory(ptr: int, count: int, dtype: np.dtype, what: str) -> np.ndarray:
    try:
        return _resolve_pointer(ptr, count * dtype.itemsize, what).view(dtype)
    except ValueError as exc:  # NCCL checks its pointers: ncclInvalidArgument, not a crash
        raise _error(_INVALID_ARGUMENT, str(exc)) from None


def _dtype(datatype: int) -> np.dtype:
    if datatype == NCCL_BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[datatype])


def _typed(view):
    """What MPI is handed: the array itself, bfloat16 as its 16-bit words."""
    if view is None or view.dtype.kind != "V":
        return view
    return [view.view(np.uint16), _MPI.UINT16_T]


def _mpi_op(op: int, dtype: np.dtype):
    if op not in _OPS:
        raise _error(_INVALID_ARGUMENT, f"op {op} is not an NCCL reduction the stand-in has (sum, prod, max, "
                                           "min)")
    from distlab.comm.reduce_ops import mpi_reduction

    return mpi_reduction(dtype, _OPS[op], "NcclCommunicator")


# -- the bootstrap ---------------------------------------------------------------------------------------------
def _rendezvous(owner: int, token: int, ndev: int, rank: int) -> list[int]:
    """Every member's world rank, by communicator rank (see the module docstring)."""
    me = _MPI.COMM_WORLD.Get_rank()
    if ndev == 1 and owner == me:
        return [me]
    from distlab.futures import default_timeout

    timeout = default_timeout()
    deadline = time.monotonic() + timeout
    if owner == me:
        return _serve(token, ndev, rank, me, deadline, timeout)
    request = np.array([token, rank, me, ndev], dtype=np.int64)
    sent = _MPI.COMM_WORLD.Isend(request, dest=owner, tag=_REQUEST_TAG)
    reply = _next(_REPLY_TAG, owner, token, deadline + min(timeout, 1.0))
    if reply is None:
        _orphans.append((sent, request))  # never matched: MPI may still read it
        raise _timed_out(f"NcclCommunicator rank {rank} of {ndev}: the id's creator (world rank {owner}) did not "
                         f"answer within {timeout:g} s", [], timeout)
    sent.Wait()
    status, words = int(reply[1]), [int(w) for w in reply[3:3 + int(reply[2])]]
    if status == _TIMED_OUT:
        raise _timed_out(f"NcclCommunicator rank {rank} of {ndev}: ranks {words} never joined within "
                         f"{timeout:g} s (the creator, world rank {owner}, gave up)", words, timeout)
    if status == _CLASH:
        raise _error(_INVALID_USAGE, f"the members disagree: ranks {words} were claimed twice or with a "
                                        "different ndev")
    return words


def _serve(token: int, ndev: int, rank: int, me: int, deadline: float, timeout: float) -> list[int]:
    """The creator: gather the other members' requests, answer each with the table (or the failure)."""
    table = {rank: me}
    clashes: list[int] = []
    came = []
    while len(table) + len(clashes) < ndev:
        words = _next(_REQUEST_TAG, _MPI.ANY_SOURCE, token, deadline)
        if words is None:
            missing = [k for k in range(ndev) if k not in table]
            _answer(came, token, _TIMED_OUT, missing)
            raise _timed_out(f"NcclCommunicator rank {rank} of {ndev} (the id's creator): ranks {missing} never "
                             f"joined within {timeout:g} s", missing, timeout)
        member, world, size = (int(w) for w in words[1:4])
        came.append(world)
        if member in table or size != ndev or not 0 <= member < ndev:
            clashes.append(member)
        else:
            table[member] = world
    if clashes:
        _answer(came, token, _CLASH, clashes)
        raise _error(_INVALID_USAGE, f"the members disagree: ranks {clashes} were claimed twice or with a "
                                        f"different ndev than {ndev}")
    ordered = [table[k] for k in range(ndev)]
    _answer(came, token, _OK, ordered)
    return ordered


def _answer(members: list[int], token: int, status: int, words: list[int]) -> None:
    reply = np.array([token, status, len(words), *words], dtype=np.int64)
    _MPI.Request.Waitall([_MPI.COMM_WORLD.Isend(reply, dest=w, tag=_REPLY_TAG) for w in members])


def _next(tag: int, source: int, token: int, deadline: float):
    """The next bootstrap message for ``token`` (from the mailbox, else from MPI), or None past ``deadline``;
    messages for other tokens are kept for them."""
    pause = 0.0
    while True:
        kept = _mailbox.get(token)
        if kept:
            return kept.pop(0)
        status = _MPI.Status()
        message = _MPI.COMM_WORLD.Improbe(source=source, tag=tag, status=status)
        if message is not None:
            words = np.empty(status.Get_count(_MPI.INT64_T), dtype=np.int64)
            message.Recv(words)
            if int(words[0]) == token:
                return words
            _mailbox.setdefault(int(words[0]), []).append(words)
            continue
        if time.monotonic() > deadline:
            return None
        pause = min(max(pause * 2, 2e-5), 1e-3)
        time.sleep(pause)


def _timed_out(message: str, missing: list[int], timeout: float):
    from distlab.errors import DistTimeoutError

    return DistTimeoutError(message + ". Raise DISTLAB_TIMEOUT to wait longer; every member must make its "
                            "communicator.", op="NcclCommunicator", seq=0, missing_ranks=missing, timeout=timeout)
