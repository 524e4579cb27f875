"""The engine of distlab.collectives: the submission table and the background cycle thread.

The cycle thread runs the controller's negotiation (the active twin of :mod:`distlab.reference.negotiation`) every
``DISTLAB_CYCLE_TIME`` ms over the engine's own process group, then runs the agreed responses
(:mod:`distlab.collectives._execute`).
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from .. import _backend
from .._common.negotiation import dtype_code
from .._types import ReduceOp
from .._wire import CPU_DEVICE_ID, JOIN_TENSOR_NAME, REDUCE_OP_CODES, RequestType
from ..errors import DistlabError, DuplicateNameError, NotInitializedError, StallShutdownError
from ..futures import Future
from ..timeline import get_timeline, now_us
from ._execute import execute
from ._settings import settings

__all__ = ["Handle", "OP_CODES"]

#: The reduce ops a negotiated allreduce supports, with their wire codes (distlab._wire.REDUCE_OP_CODES).
OP_CODES = {op: REDUCE_OP_CODES[op.value] for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX,
                                                    ReduceOp.PRODUCT)}


class Handle:
    """An in-flight collective: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("name", "kind", "future")

    def __init__(self, name: str, kind: str, future: Future):
        self.name = name
        self.kind = kind
        self.future = future

    def __repr__(self) -> str:
        return f"<collectives.Handle {self.kind} {self.name!r} {'done' if self.future.done() else 'pending'}>"


class _Entry:
    __slots__ = ("name", "kind", "array", "op", "root", "pre", "post", "future")

    def __init__(self, name, kind, array, op, root, pre, post, future):
        self.name, self.kind, self.array, self.op, self.root = name, kind, array, op, root
        self.pre, self.post, self.future = pre, post, future


class _MPITransport:
    """The controller's three calls over the engine's own ProcessGroup (every wait bounded by its timeout)."""

    def __init__(self, group):
        self.group = group

    def allreduce_bits(self, words, op):
        self.group.allreduce(words, op=op, name="negotiation bits")

    def gather(self, payload):
        gathered = self.group.allgather_object(bytes(payload), name="negotiation requests")
        return gathered if self.group.rank == 0 else None

    def broadcast(self, payload):
        return self.group.broadcast_object(payload, src=0, name="negotiation responses")


class _Engine:
    def __init__(self):
        from mpi4py import MPI

        from .. import comm

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise DistlabError("distlab.collectives runs its cycle in a background thread and needs "
                               f"MPI_THREAD_MULTIPLE, but MPI provides thread level {MPI.Query_thread()}")
        self.settings = settings()
        self.group = comm.ProcessGroup(name="collectives")
        self.rank, self.size = self.group.rank, self.group.size
        self.module = _backend.load("negotiation")
        self.timeline = get_timeline()
        s = self.settings
        self.controller = self.module.Controller(
            self.rank, self.size, cache_capacity=s["cache_capacity"], fusion_threshold=s["fusion_threshold"],
            stall_check_time=s["stall_check_time"], stall_shutdown_time=s["stall_shutdown_time"],
            timeline=self.timeline if self.timeline.enabled else None)
        self.transport = _MPITransport(self.group)
        self.table: dict[str, _Entry] = {}
        self.lock = threading.Lock()
        self.counters = {kind: itertools.count() for kind in ("allreduce", "allgather", "broadcast", "barrier")}
        self.fusion_buffer = np.empty(0, dtype=np.uint8)
        self.error: BaseException | None = None
        self.agreed_stop = False
        self.stop = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="distlab-collectives-cycle", daemon=True)
        self.thread.start()

    # -- submission (user thread) -----------------------------------------------------------------------------
    def submit(self, kind, array, name, op=None, root=0, pre=1.0, post=1.0) -> Handle:
        if self.error is not None:
            raise NotInitializedError(f"distlab.collectives stopped: {self.error}") from self.error
        if self.stop.is_set():
            raise NotInitializedError("distlab.collectives is shutting down; call init() again to use it")
        request_type = {"allreduce": RequestType.ALLREDUCE, "allgather": RequestType.ALLGATHER,
                        "broadcast": RequestType.BROADCAST, "barrier": RequestType.BARRIER,
                        "join": RequestType.JOIN}[kind]
        if name is None:
            name = JOIN_TENSOR_NAME if kind == "join" else f"{kind}.noname.{next(self.counters[kind])}"
        name = str(name)
        if array is not None:
            array = np.array(array, copy=True, order="C")   # the caller may reuse its array at once
            tensor_type, shape = dtype_code(array.dtype), array.shape
        else:
            tensor_type, shape = 0, ()
        op_code = OP_CODES[op] if op is not None else 0
        if op is ReduceOp.AVG and array is not None and array.dtype.kind not in "fc":
            raise TypeError(f"allreduce of {name!r}: op=Average needs a floating-point array, got {array.dtype}; "
                            "use op=Sum")
        future = Future(description=f"{kind} of {name!r}")
        entry = _Entry(name, kind, array, op, root, float(pre), float(post), future)
        request = self.module.Request(name, request_type, tensor_type, shape, request_rank=self.rank,
                                      root_rank=root, device=CPU_DEVICE_ID, reduce_op=op_code,
                                      prescale_factor=pre, postscale_factor=post)
        with self.lock:
            if name in self.table:
                raise DuplicateNameError(
                    f"a collective named {name!r} is already in flight on rank {self.rank}; wait for it "
                    "(synchronize) before submitting the name again, or use a different name")
            self.table[name] = entry
        self.controller.enqueue(request)
        return Handle(name, kind, future)

    # -- the cycle (background thread) ------------------------------------------------------------------------
    def _loop(self):
        cycle = self.settings["cycle_time_ms"] / 1000.0
        try:
            while True:
                start = time.perf_counter()
                t0 = now_us() if self.timeline.enabled else 0.0
                before = self.controller.counters if self.timeline.enabled else None
                response_list = self.controller.compute_response_list(self.transport, self.stop.is_set())
                if self.timeline.enabled:
                    self._trace_cycle(t0, before, response_list)
                for response in response_list.responses:
                    execute(self, response)
                if response_list.shutdown:
                    self.agreed_stop = True      # every rank leaves the loop in this same cycle
                    break
                remaining = cycle - (time.perf_counter() - start)
                if remaining > 0:
                    time.sleep(remaining)
        except BaseException as exc:  # noqa: BLE001 - every pending handle must learn about it
            self.error = exc
        finally:
            reason = self.error
            if reason is None:
                reports = self.controller.stall.reports
                if not self.stop.is_set() and reports:
                    reason = StallShutdownError(reports[-1])
                elif not self.stop.is_set():
                    reason = NotInitializedError(
                        "distlab.collectives stopped: another rank called shutdown(), or rank 0's stall inspector "
                        "shut the job down (DISTLAB_STALL_SHUTDOWN_TIME; see rank 0's stall report)")
                else:
                    reason = NotInitializedError("distlab.collectives was shut down with this collective pending")
                self.error = reason
            self._fail_all(reason)
            self.stopped.set()

    def _fail_all(self, exc):
        with self.lock:
            entries, self.table = list(self.table.values()), {}
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc)

    def _trace_cycle(self, t0, before, response_list):
        after = self.controller.counters
        path = "fast" if after["fast_path"] > before["fast_path"] else (
            "slow" if after["slow_path"] > before["slow_path"] else "idle")
        if path == "idle" and not response_list.responses:
            return
        self.timeline.complete(f"negotiate ({path} path)", t0, lane="negotiation", cat="collectives",
                               args={"hits": after["hits"] - before["hits"],
                                     "misses": after["misses"] - before["misses"],
                                     "invalid": after["invalid"] - before["invalid"],
                                     "requeued": after["requeued"] - before["requeued"],
                                     "responses": len(response_list.responses)})
        self.timeline.counter("response cache", {"hits": after["hits"], "misses": after["misses"]})

    def _take(self, names):
        with self.lock:
            return [self.table.pop(n, None) for n in names]

    def close(self, timeout):
        self.stop.set()
        if not self.stopped.wait(timeout):
            raise DistlabError(f"distlab.collectives did not shut down within {timeout:g} s: another rank may "
                               "not have called shutdown() and is not cycling")
        self.thread.join(timeout)
        if self.agreed_stop:
            # Freeing communicators is collective: only when every rank stopped in the same cycle.
            self.group.destroy()
