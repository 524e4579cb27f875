"""Process groups over MPI: the collectives every distlab component communicates with.

A :class:`ProcessGroup` wraps an mpi4py communicator (a ``Dup`` of ``COMM_WORLD`` by default, so distlab's
traffic never matches a user's own MPI calls). Its collectives work in place on the array they are given, as
``torch.distributed``'s do::

    from distlab import comm
    pg = comm.world()
    a = np.full(4, pg.rank, np.float32)
    pg.allreduce(a)                         # a now holds the sum over ranks
    work = pg.allreduce(a, op="avg", async_op=True)
    ...                                     # compute while it runs
    work.wait()

Three promises hold for every call:

* **No hang.** Every wait is bounded by ``DISTLAB_TIMEOUT`` (default 300 s). On timeout the error names the
  operation, its sequence number, the tensor, and the ranks that had not entered it, read through a side channel
  (a shared-memory window where each rank posts the last collective it entered), not guessed.
* **Mismatches are named.** With ``DISTLAB_DEBUG=DETAIL`` every collective's fingerprint (sequence number, op,
  shape, dtype, root) is compared across ranks first; a mismatch raises the same
  :class:`~distlab.errors.CollectiveMismatchError` on every rank, naming who sent what.
* **Arrays are never pickled.** numpy arrays go to MPI as buffers; cupy arrays go to MPI directly when the MPI
  is CUDA-aware and through host memory otherwise (see :mod:`distlab._arrays`).

MPI nonblocking operations only progress inside MPI calls. A caller that overlaps communication with compute
should call :func:`progress` (or ``work.is_completed()``) now and then; the reducer does so from every autograd
hook.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import itertools
import time
import weakref

import numpy as np
from mpi4py import MPI

from . import _backend
from ._arrays import backend_for, cuda_aware
from ._types import ReduceOp
from ._wire import COLLECTIVE_OPS, FINGERPRINT_WORDS
from .errors import CollectiveMismatchError, DistTimeoutError, ProcessGroupBrokenError
from .futures import Future, default_timeout
from .timeline import get_timeline, now_us

__all__ = ["ProcessGroup", "Work", "world", "new_group", "progress", "debug_level", "ReduceOp"]

log = logging.getLogger("distlab.comm")

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
}
_OP_CODES = {name: code for code, name in enumerate(COLLECTIVE_OPS)}
_SPIN_SECONDS = 0.01  # busy-poll this long before backing off (large transfers need every progress call)
_YIELD_EVERY = 3  # oversubscribed: yield the core every 4th poll (a mask: measured best of 1, 4 and 16)


def debug_level() -> str:
    """``DISTLAB_DEBUG``: ``OFF`` (default), ``INFO`` (log each collective) or ``DETAIL`` (check fingerprints)."""
    level = os.environ.get("DISTLAB_DEBUG", "OFF").strip().upper() or "OFF"
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"DISTLAB_DEBUG={level!r}: expected OFF, INFO or DETAIL")
    return level


class Work:
    """Handle on an operation in flight (``torch.distributed.Work``).

    Most operations are one MPI request plus an optional ``finish`` step run once it completes (divide for
    ``avg``, copy a staged device array back). Operations needing several requests in sequence (objects: sizes,
    then payload) pass ``stages``, a generator that yields each request and returns the result.
    ``wait`` and ``is_completed`` push the operation forward.
    """

    __slots__ = ("group", "op", "seq", "name", "nbytes", "peer", "_stages", "_request", "_finish_step", "_done",
                 "_exception", "_result", "_future", "_start_us", "__weakref__")

    def __init__(self, group: "ProcessGroup", op: str, seq: int, name, nbytes: int, request=None, finish=None,
                 result=None, peer=None, stages=None, start_us: float = 0.0):
        self.group = group
        self.op = op
        self.seq = seq
        self.name = name
        self.nbytes = nbytes
        self.peer = peer
        self._stages = stages
        self._request = request
        self._finish_step = finish
        self._done = False
        self._exception: BaseException | None = None
        self._result = result
        self._future: Future | None = None
        self._start_us = start_us
        if stages is not None:
            self._request_done()  # start the first stage

    def _request_done(self) -> None:
        """The current request completed: start the next stage, or run the finish step and complete."""
        try:
            if self._stages is not None:
                try:
                    self._request = self._stages.send(None)
                    return
                except StopIteration as stop:
                    self._result = stop.value
            elif self._finish_step is not None:
                self._finish_step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails the work; wait() raises it
            self._complete(exc)
            return
        self._complete(None)

    def _complete(self, exception) -> None:
        self._done, self._exception, self._request = True, exception, None
        self.group._pending.discard(self)
        if self._start_us:
            self.group._record(self.op, self.name, self.seq, self.nbytes, self._start_us)
        if self._future is not None:
            self._complete_future()

    def _complete_future(self) -> None:
        if self._future.done():
            return
        if self._exception is not None:
            self._future.set_exception(self._exception)
        else:
            self._future.set_result(self._result)

    def _poll(self) -> bool:
        """Test the current request and move on while requests complete. True when done."""
        if self._done:
            return True
        with self.group._lock:
            while not self._done and self._request.Test():
                self._request_done()
        return self._done

    def is_completed(self) -> bool:
        """True once the operation finished (this call also drives it forward)."""
        return self._poll()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes; raise its error, or DistTimeoutError after ``timeout`` s."""
        if not self._done:
            timeout = self.group.timeout if timeout is None else timeout
            deadline = time.monotonic() + timeout
            # Hold the group's lock for the whole wait and poll the MPI request itself: no lock round trip per
            # poll (another thread's progress() simply finds this work done afterwards).
            with self.group._lock:
                while not self._done:
                    request = self._request
                    if not request.Test():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            self.group._raise_timeout(timeout, self.op, self.seq, self.name, self.nbytes, self.peer)
                        self.group._spin(request.Test, remaining, self.op, self.seq, self.name, self.nbytes,
                                         self.peer, timeout)
                    self._request_done()
        if self._exception is not None:
            raise self._exception
        return True

    def result(self):
        """The operation's output (the array it wrote, the gathered list, ...) once it completed."""
        self.wait()
        return self._result

    def exception(self) -> BaseException | None:
        """The error the operation ended with, if any."""
        return self._exception

    def get_future(self) -> Future:
        """A :class:`~distlab.futures.Future` completed with :meth:`result` (waiting on it drives the work)."""
        if self._future is None:
            description = f"{self.op} #{self.seq}" + (f" of {self.name!r}" if self.name else "")
            self._future = Future(driver=self._drive_future, description=description)
            if self._done:
                self._complete_future()
        return self._future

    def _drive_future(self, timeout: float) -> None:
        try:
            self.wait(timeout)
        except DistTimeoutError:
            raise
        except Exception:  # noqa: BLE001 - the error already completed the future
            pass

    def __repr__(self) -> str:
        return f"<Work {self.op} #{self.seq} {'done' if self._done else 'pending'}>"


class ProcessGroup:
    """A group of ranks running collectives together (``torch.distributed.ProcessGroup`` over MPI).

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Intracomm, optional
        The communicator to run over; it is duplicated. Default ``MPI.COMM_WORLD``.
    timeout : float, optional
        Seconds any wait may block; default ``DISTLAB_TIMEOUT`` (300).
    name : str, optional
        Used in error messages and timeline lanes.

    Attributes
    ----------
    rank, size : int
        This process's rank in the group, and the group's size.
    comm : mpi4py.MPI.Intracomm
        The group's own communicator.
    """

    def __init__(self, mpi_comm=None, timeout: float | None = None, name: str | None = None):
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.comm = parent.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.name = name or "world"
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self._seq = 0
        self._next_seq = itertools.count(1).__next__  # atomic under the GIL: no lock on the hot path
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._pending: set[Work] = set()  # async work not yet seen complete (progress() drives it)
        self._timeline = get_timeline()
        self._timeline_on = self._timeline.enabled
        self._detail = debug_level() == "DETAIL"
        self._info = debug_level() == "INFO"
        if self._info:
            _log_to_stderr(self.comm.Get_rank())
        self._fingerprint = _backend.load("fingerprint")
        self._open_arrival_board()
        _groups.add(self)

    # -- the side channel: where each rank is --------------------------------------------------------------
    def _open_arrival_board(self) -> None:
        """Each rank posts ``[last collective seq entered, its op code]`` in a node-shared memory window.

        Reading a peer's slot is a plain memory load, so it works while that peer computes outside MPI (an RMA
        Get would need the peer's MPI progress). Ranks on other nodes are reported as unknown.
        """
        self._node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._board = MPI.Win.Allocate_shared(16, 8, comm=self._node)
        self._my_slot = memoryview(self._board.tomemory()).cast("B").cast("q")  # item stores are cheap
        self._my_slot[0] = self._my_slot[1] = 0
        node_ranks = self._node.Get_group().Translate_ranks(None, self.comm.Get_group())
        self._peer_slots: dict[int, np.ndarray] = {}
        for node_rank, group_rank in enumerate(node_ranks):
            memory, _ = self._board.Shared_query(node_rank)
            self._peer_slots[group_rank] = np.frombuffer(memory, dtype=np.int64)
        self._node.Barrier()  # every slot is zeroed before anyone posts
        self._oversubscribed = self._node.Get_size() > _usable_cores()

    def _arrivals(self) -> dict[int, tuple[int, str] | None]:
        """Every rank's last entered collective ``(seq, op)``, or None when it cannot be read (other node)."""
        status: dict[int, tuple[int, str] | None] = {}
        for rank in range(self.size):
            slot = self._peer_slots.get(rank)
            if slot is None:
                status[rank] = None
            else:
                seq, code = int(slot[0]), int(slot[1])
                status[rank] = (seq, COLLECTIVE_OPS[code] if 0 <= code < len(COLLECTIVE_OPS) else "?")
        return status

    # -- issuing operations ---------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken:
            raise ProcessGroupBrokenError(
                f"process group {self.name!r} cannot be used: {self._broken}. Create a new group or restart.")

    def _enter(self, op: str, name, array=None, root: int = -1, reduce_op: str = "") -> int:
        """Number the collective, post arrival, and (DETAIL) check it matches on every rank."""
        if self._broken:
            self._check_usable()
        seq = self._seq = self._next_seq()
        self._my_slot[1] = _OP_CODES[op]
        self._my_slot[0] = seq
        if self._info:
            log.info("group %s rank %d: %s #%d %s", self.name, self.rank, op, seq, name or "")
        if self._detail:
            shape = None if array is None else array.shape
            dtype = None if array is None else array.dtype
            reduce_name = reduce_op.value if isinstance(reduce_op, ReduceOp) else reduce_op
            self._check_fingerprint(self._fingerprint.make_fingerprint(seq, op, shape, dtype, root, reduce_name),
                                    op, seq, name)
        return seq

    def _check_fingerprint(self, words, op: str, seq: int, name) -> None:
        table = np.empty((self.size, FINGERPRINT_WORDS), dtype=np.int64)

        def stages():
            yield self.comm.Iallgather(words, table)

        Work(self, op, seq, f"{name or op} (DETAIL fingerprint check)", table.nbytes, stages=stages()).wait()
        message = self._fingerprint.find_mismatch(table)
        if message is not None:
            where = f" ({name!r})" if name else ""
            raise CollectiveMismatchError(f"rank {self.rank}{where}: {message}", seq=seq,
                                          groups=self._fingerprint.fingerprint_groups(table))

    def _issue(self, op: str, seq: int, name, nbytes: int, request, finish, result, async_op: bool,
               peer=None, start_us: float = 0.0):
        """Complete a one-request operation: return a Work (async) or wait here and return ``result``.

        The sync path makes no Work object: it is the hot path of small collectives.
        """
        if async_op:
            work = Work(self, op, seq, name, nbytes, request, finish, result, peer, start_us=start_us)
            self._pending.add(work)
            return work
        if not request.Test():
            self._spin(request.Test, self.timeout, op, seq, name, nbytes, peer)
        if finish is not None:
            finish()
        if start_us:
            self._record(op, name, seq, nbytes, start_us)
        return result

    def _staged(self, op: str, seq: int, name, nbytes: int, stages, async_op: bool, peer=None):
        """Run a multi-request operation (``stages`` yields each request and returns the result)."""
        start_us = now_us() if self._timeline.enabled else 0.0
        work = Work(self, op, seq, name, nbytes, peer=peer, stages=stages, start_us=start_us)
        if async_op:
            if not work._done:
                self._pending.add(work)
            return work
        work.wait()
        return work._result

    def _record(self, op: str, name, seq: int, nbytes: int, start_us: float) -> None:
        self._timeline.complete(f"{op} {name}" if name else op, start_us, cat="comm", lane=f"comm {self.name}",
                                args={"seq": seq, "bytes": nbytes, "op": op})

    def _spin(self, test, timeout: float, op: str, seq: int, name, nbytes: int, peer, reported=None) -> None:
        """Poll ``test()`` until True (MPI progresses only inside MPI calls), bounded by ``timeout``.

        Spin first (a large transfer needs every progress call), then back off with short sleeps. When the
        node runs more ranks than it has cores (4 ranks on 2 cores), each poll also yields the core, or a rank
        spinning here would keep its peer from running the other half of the collective (measured: 8.5 ms for
        a 4 KiB allreduce without yielding, 36 us raw). With a core per rank the syscall is pure cost: no yield.
        """
        start = time.monotonic()
        deadline = start + timeout
        spin_until = start + _SPIN_SECONDS
        pause = 0.0
        polls = 0
        oversubscribed = self._oversubscribed
        while not test():
            polls += 1
            if oversubscribed and not polls & _YIELD_EVERY:
                _yield_cpu()
            if polls & 15:
                continue
            now = time.monotonic()
            if now >= deadline:
                self._raise_timeout(timeout if reported is None else reported, op, seq, name, nbytes, peer)
            if now > spin_until:
                pause = min(max(pause * 2, 2e-5), 1e-3)
                time.sleep(pause)

    def _raise_timeout(self, timeout: float, op: str, seq: int, name, nbytes: int, peer) -> None:
        label = f"{op} #{seq}" if seq else op
        if name:
            label += f" of {name!r}"
        label += f" ({nbytes} bytes)" if nbytes else ""
        if peer is not None:
            missing, detail = [peer], f"its peer, rank {peer}, never posted the matching call"
        elif seq:
            missing, detail = self._describe_missing(seq)
        else:
            missing, detail = [], "no rank posted a matching call"
        self._broken = f"{label} timed out and may still be in flight"
        raise DistTimeoutError(
            f"{label} timed out after {timeout:g} s on rank {self.rank} of group {self.name!r} "
            f"(size {self.size}): {detail}. Raise DISTLAB_TIMEOUT to wait longer; DISTLAB_DEBUG=DETAIL checks "
            f"that every rank calls the same collectives.",
            op=op, seq=seq, name=name, missing_ranks=missing, timeout=timeout)

    def _describe_missing(self, seq: int):
        status = self._arrivals()
        missing = [r for r, s in status.items() if s is not None and s[0] < seq]
        unknown = [r for r, s in status.items() if s is None]
        if missing:
            where = "; ".join(f"rank {r} last entered #{status[r][0]} {status[r][1]}" if status[r][0]
                              else f"rank {r} has entered no collective" for r in missing)
            detail = f"ranks {missing} have not entered it ({where})"
        elif unknown:
            detail = f"every rank on this node entered it; ranks {unknown} are on other nodes (status unknown)"
        else:
            detail = ("every rank entered it but the transfer did not complete (a rank may have died, or "
                      "called it with a different size or op)")
        if unknown and missing:
            detail += f"; ranks {unknown} are on other nodes (status unknown)"
        return missing, detail

    # -- array plumbing ---------------------------------------------------------------------------------------
    @staticmethod
    def _mpi_buffer(array, what: str):
        """Return (buffer to give MPI, step copying results back or None), staging device arrays if needed."""
        if type(array) is np.ndarray:  # the hot path: host memory, no staging
            if not array.flags.c_contiguous:
                raise ValueError(f"{what}: the array must be C-contiguous (got strides {array.strides}); "
                                 "pass np.ascontiguousarray(a) and copy the result back")
            return array, None
        backend = backend_for(array)
        if not _is_contiguous(array):
            raise ValueError(f"{what}: the array must be C-contiguous (got strides {array.strides}); "
                             "pass np.ascontiguousarray(a) and copy the result back")
        if not backend.on_device:
            return array, None
        backend.synchronize(array)  # the kernels writing this array must finish before MPI reads it
        if cuda_aware():
            return array, None
        host = backend.to_host(array)
        return host, (lambda: backend.from_host(array, host))

    def _start(self) -> float:
        return now_us() if self._timeline_on else 0.0

    # -- collectives ------------------------------------------------------------------------------------------
    def allreduce(self, array, op="sum", async_op: bool = False, name=None):
        """Reduce ``array`` across ranks in place (``op``: sum, avg, min, max, product, band, bor)."""
        reduce_op = _parse_op(op)
        buf, copy_back = self._mpi_buffer(array, "allreduce")
        if reduce_op in _KIND_CHECKED:
            _check_reducible(array, reduce_op, "allreduce")
        seq = self._enter("allreduce", name, array, reduce_op=reduce_op)
        start = now_us() if self._timeline_on else 0.0
        if array.dtype.kind == "V" and array.dtype.name == "bfloat16":  # our own MPI op (.name alone: 1.8 us)
            request = self.comm.Iallreduce(MPI.IN_PLACE, [buf.view(np.uint16), MPI.UINT16_T],
                                           _bfloat16_op(reduce_op, array.dtype))
        else:
            request = self.comm.Iallreduce(MPI.IN_PLACE, buf, _mpi_op(reduce_op, array.dtype))
        finish = copy_back
        if reduce_op is ReduceOp.AVG:
            finish = _averaging(buf, self.size, copy_back)
        return self._issue("allreduce", seq, name, array.nbytes, request, finish, array, async_op, None, start)

    def broadcast(self, array, src: int = 0, async_op: bool = False, name=None):
        """Overwrite ``array`` on every rank with rank ``src``'s copy."""
        self._check_rank(src, "broadcast src")
        buf, copy_back = self._mpi_buffer(array, "broadcast")
        seq = self._enter("broadcast", name, array, root=src)
        start = self._start()
        request = self.comm.Ibcast(buf, root=src)
        return self._issue("broadcast", seq, name, array.nbytes, request, copy_back, array, async_op, None, start)

    def allgather(self, array, out=None, async_op: bool = False, name=None):
        """Gather every rank's ``array`` into ``out`` of shape ``(size,) + array.shape`` (returned)."""
        send, _ = self._mpi_buffer(array, "allgather")
        if out is None:
            out = _empty_like(array, (self.size,) + tuple(array.shape))
        if tuple(out.shape) != (self.size,) + tuple(array.shape) or out.dtype != array.dtype:
            raise ValueError(f"allgather: out must have shape {(self.size,) + tuple(array.shape)} and dtype "
                             f"{array.dtype}, got {tuple(out.shape)} {out.dtype}")
        recv, copy_back = self._mpi_buffer(out, "allgather")
        seq = self._enter("allgather", name, array)
        start = self._start()
        request = self.comm.Iallgather(send, recv)
        return self._issue("allgather", seq, name, array.nbytes, request, copy_back, out, async_op, None, start)

    def reduce_scatter(self, output, input, op="sum", async_op: bool = False, name=None):  # noqa: A002
        """Reduce ``input`` (``size`` equal blocks) across ranks; rank ``r`` receives block ``r`` in ``output``."""
        reduce_op = _parse_op(op)
        send, _ = self._mpi_buffer(input, "reduce_scatter")
        recv, copy_back = self._mpi_buffer(output, "reduce_scatter")
        _check_reducible(input, reduce_op, "reduce_scatter")
        if input.size != output.size * self.size or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input must hold size*output.size = {output.size * self.size} "
                             f"elements of {output.dtype}, got {input.size} of {input.dtype}")
        seq = self._enter("reduce_scatter", name, input, reduce_op=reduce_op)
        start = self._start()
        request = self.comm.Ireduce_scatter_block(send, recv, _mpi_op(reduce_op, input.dtype))
        finish = _averaging(recv, self.size, copy_back) if reduce_op is ReduceOp.AVG else copy_back
        return self._issue("reduce_scatter", seq, name, input.nbytes, request, finish, output, async_op, None,
                           start)

    def alltoall(self, output, input, async_op: bool = False, name=None):  # noqa: A002
        """Send block ``j`` of ``input`` to rank ``j``; block ``i`` of ``output`` comes from rank ``i``."""
        send, _ = self._mpi_buffer(input, "alltoall")
        recv, copy_back = self._mpi_buffer(output, "alltoall")
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
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        seq = self._enter("allgather_object", name)

        def stages():
            sizes = np.zeros(self.size, dtype=np.int64)
            yield self.comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)
            data = np.empty(int(sizes.sum()), dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            yield self.comm.Iallgatherv(payload, [data, (sizes, offsets), MPI.BYTE])
            return [pickle.loads(data[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

        return self._staged("allgather_object", seq, name, payload.nbytes, stages(), async_op)

    def broadcast_object(self, obj=None, src: int = 0, async_op: bool = False, name=None):
        """Return rank ``src``'s ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
        self._check_rank(src, "broadcast_object src")
        seq = self._enter("broadcast_object", name, root=src)
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8) \
            if self.rank == src else None

        def stages():
            size = np.array([payload.size if payload is not None else 0], dtype=np.int64)
            yield self.comm.Ibcast(size, root=src)
            data = payload if payload is not None else np.empty(int(size[0]), dtype=np.uint8)
            yield self.comm.Ibcast(data, root=src)
            return obj if self.rank == src else pickle.loads(data.tobytes())

        return self._staged("broadcast_object", seq, name, 0, stages(), async_op)

    # -- point to point -------------------------------------------------------------------------------------
    def send(self, array, dst: int, tag: int = 0, async_op: bool = False, name=None):
        """Send ``array`` to rank ``dst``."""
        self._check_usable()
        self._check_rank(dst, "send dst")
        buf, _ = self._mpi_buffer(array, "send")
        start = self._start()
        request = self.comm.Isend(buf, dest=dst, tag=tag)
        return self._issue("send", 0, name, array.nbytes, request, None, None, async_op, dst, start)

    def recv(self, array, src=None, tag: int = 0, async_op: bool = False, name=None):
        """Receive into ``array`` from rank ``src`` (any rank when None); returns the sender's rank."""
        self._check_usable()
        if src is not None:
            self._check_rank(src, "recv src")
        buf, copy_back = self._mpi_buffer(array, "recv")
        status = MPI.Status()

        def stages():
            yield _StatusRequest(self.comm.Irecv(buf, source=MPI.ANY_SOURCE if src is None else src, tag=tag),
                                 status)
            if copy_back:
                copy_back()
            return status.Get_source()

        return self._staged("recv", 0, name, array.nbytes, stages(), async_op, peer=src)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"{what}={rank!r} is not a rank of group {self.name!r} (size {self.size})")

    def new_group(self, ranks, name=None, timeout=None):
        """Make a sub-group of ``ranks`` (every rank of this group must call it); None on non-members."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"new_group: ranks {ranks} must be distinct ranks of group {self.name!r} "
                             f"(size {self.size})")
        self._check_usable()
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        group = ProcessGroup(sub, timeout=self.timeout if timeout is None else timeout,
                             name=name or f"{self.name}{ranks}")
        sub.Free()
        return group

    def destroy(self) -> None:
        """Release the group's communicators (collective: every rank calls it)."""
        _groups.discard(self)
        for resource in ("_board", "_node", "comm"):
            handle = getattr(self, resource, None)
            if handle is not None and handle != MPI.COMM_NULL:
                handle.Free()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} rank {self.rank}/{self.size}>"


class _StatusRequest:
    """An Irecv request whose Test fills a Status (mpi4py's Test takes it as an argument)."""

    __slots__ = ("request", "status")

    def __init__(self, request, status):
        self.request, self.status = request, status

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return self.request.Test(self.status)


def _is_contiguous(array) -> bool:
    flags = getattr(array, "flags", None)
    if flags is not None:
        return bool(flags["C_CONTIGUOUS"]) if not hasattr(flags, "c_contiguous") else bool(flags.c_contiguous)
    return True


def _empty_like(array, shape):
    backend = backend_for(array)
    if not backend.on_device:
        return np.empty(shape, dtype=array.dtype)
    module = __import__(type(array).__module__.split(".")[0])
    return module.empty(shape, dtype=array.dtype)


_KIND_CHECKED = frozenset({ReduceOp.AVG, ReduceOp.BAND, ReduceOp.BOR})


def _check_reducible(array, op: ReduceOp, what: str) -> None:
    if op not in _KIND_CHECKED:
        return
    kind = np.dtype(array.dtype).kind
    if op in (ReduceOp.BAND, ReduceOp.BOR) and kind not in "biu":
        raise TypeError(f"{what}: op {op.value!r} needs an integer or bool array, got {array.dtype}")
    if op is ReduceOp.AVG and kind not in "fc":
        raise TypeError(f"{what}: op 'avg' needs a floating-point array, got {array.dtype} (use 'sum')")


_OP_LOOKUP = {**{m: m for m in ReduceOp}, **{m.value: m for m in ReduceOp}}


def _parse_op(op) -> ReduceOp:
    """``ReduceOp.parse`` with a dictionary fast path (this runs on every collective)."""
    parsed = _OP_LOOKUP.get(op)
    return parsed if parsed is not None else ReduceOp.parse(op)


def _averaging(buf, size: int, copy_back):
    """The finish step of ``avg``: divide the sum by the group size, then copy a staged array back."""
    def finish():
        buf[...] /= size
        if copy_back is not None:
            copy_back()
    return finish


_BF16_OPS: dict = {}


def _bfloat16_op(op: ReduceOp, dtype):
    """An MPI op reducing ml_dtypes.bfloat16 values carried as uint16 (created once per reduce op)."""
    if op in (ReduceOp.BAND, ReduceOp.BOR):
        raise TypeError(f"allreduce: op {op.value!r} needs an integer or bool array, got bfloat16")
    mpi_op = _BF16_OPS.get(op)
    if mpi_op is None:
        combine = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
                   ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]

        def reduce(inbuf, outbuf, _datatype):
            incoming = np.frombuffer(inbuf, dtype=dtype)
            into = np.frombuffer(outbuf, dtype=dtype)
            combine(into, incoming, out=into)

        mpi_op = _BF16_OPS[op] = MPI.Op.Create(reduce, commute=True)
    return mpi_op


def _log_to_stderr(rank: int) -> None:
    """DISTLAB_DEBUG=INFO: show distlab's INFO log on stderr, tagged with the rank (unless logging is set up)."""
    logger = logging.getLogger("distlab")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def _usable_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _yield_cpu() -> None:
    """Give the core to another runnable process (oversubscribed ranks), at the cost of one syscall."""
    os.sched_yield()


def _mpi_op(op: ReduceOp, dtype):
    if dtype.kind != "b":
        return _MPI_OPS[op]
    if dtype.kind == "b":  # MPI defines only logical ops on C bool
        return {ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR, ReduceOp.MIN: MPI.LAND,
                ReduceOp.MAX: MPI.LOR, ReduceOp.PRODUCT: MPI.LAND}.get(op, MPI.LOR)
    return _MPI_OPS[op]


_groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
_world: ProcessGroup | None = None
_world_lock = threading.Lock()


def world() -> ProcessGroup:
    """The default group: every rank of ``COMM_WORLD`` (created on first use; every rank must call it)."""
    global _world
    if _world is None:
        with _world_lock:
            if _world is None:
                _world = ProcessGroup(name="world")
    return _world


def new_group(ranks, name=None, timeout=None):
    """Sub-group of the world group (``torch.distributed.new_group``); every rank calls it, None on non-members."""
    return world().new_group(ranks, name=name, timeout=timeout)


def progress() -> int:
    """Drive every outstanding async operation of every group one step; returns how many are still pending."""
    pending = 0
    for group in list(_groups):
        for work in list(group._pending):
            if not work._poll():
                pending += 1
    return pending
