"""Horovod-style negotiated collectives: submit named arrays in any order, a background thread agrees on what to run.

Every rank submits named collectives asynchronously (``allreduce_async``, ``allgather_async``, ...), in any
order. A background thread runs a *cycle* every ``DISTLAB_CYCLE_TIME`` ms: the controller (the active twin of
:mod:`distlab.reference.negotiation`) finds which named tensors every rank has submitted, through the coordinator
the first time and through the response cache's one bit-vector allreduce once the pattern repeats, fuses small
allreduces into one fusion buffer, and the thread runs the collectives in the same order on every rank.

Example::

    from distlab import collectives as hvd
    hvd.init()
    handles = [hvd.allreduce_async(g, name=f"grad.{i}") for i, g in enumerate(grads)]
    grads = [hvd.synchronize(h) for h in handles]
    hvd.shutdown()

Settings (environment, read by :func:`init`; Horovod's defaults):

``DISTLAB_CACHE_CAPACITY`` (1024; 0 disables the response cache), ``DISTLAB_FUSION_THRESHOLD`` (bytes,
128 MiB), ``DISTLAB_CYCLE_TIME`` (ms, 1), ``DISTLAB_STALL_CHECK_TIME`` (s, 60; 0 disables),
``DISTLAB_STALL_SHUTDOWN_TIME`` (s, 0 = never), and ``DISTLAB_TIMEOUT`` for every wait.

The cycle thread talks over its own :class:`distlab.comm.ProcessGroup` (a duplicate of COMM_WORLD), so it never
interleaves with the program's own collectives.
"""
from __future__ import annotations

import atexit
import itertools
import os
import threading
import time

import numpy as np

from . import _backend
from ._negotiation_shared import (
    CPU_DEVICE_ID,
    DTYPE_NAMES,
    JOIN_TENSOR_NAME,
    REDUCE_OPS,
    CollectiveError,
    DuplicateNameError,
    NotInitializedError,
    RequestType,
    ResponseType,
    StallShutdownError,
    dtype_code,
)
from ._types import ReduceOp
from .errors import DistlabError, DistTimeoutError
from .futures import Future, default_timeout
from .timeline import get_timeline, now_us

__all__ = [
    "Average", "Sum", "Min", "Max", "Product",
    "init", "shutdown", "is_initialized", "rank", "size",
    "allreduce", "allreduce_async", "allgather", "allgather_async", "broadcast", "broadcast_async",
    "barrier", "join", "poll", "synchronize", "Handle", "stats", "stall_reports", "settings",
    "CollectiveError", "DuplicateNameError", "NotInitializedError", "StallShutdownError",
]

Average = ReduceOp.AVG
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_OP_CODES = {ReduceOp.SUM: 1, ReduceOp.AVG: 2, ReduceOp.MIN: 3, ReduceOp.MAX: 4, ReduceOp.PRODUCT: 5}


def _env_number(name: str, default, kind=float, minimum=0.0, unit=""):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {'whole ' if kind is int else ''}number{unit}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}{unit}")
    return value


def settings() -> dict:
    """The settings :func:`init` would use now, read from the environment (validated)."""
    return {
        "cache_capacity": _env_number("DISTLAB_CACHE_CAPACITY", 1024, int, 0),
        "fusion_threshold": _env_number("DISTLAB_FUSION_THRESHOLD", 128 * 1024 * 1024, int, 0, " bytes"),
        "cycle_time_ms": _env_number("DISTLAB_CYCLE_TIME", 1.0, float, 0.0, " ms"),
        "stall_check_time": _env_number("DISTLAB_STALL_CHECK_TIME", 60.0, float, 0.0, " s"),
        "stall_shutdown_time": _env_number("DISTLAB_STALL_SHUTDOWN_TIME", 0.0, float, 0.0, " s"),
    }


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

        from . import comm

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
        op_code = _OP_CODES[op] if op is not None else 0
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
                    self._execute(response)
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

    def _execute(self, response):
        kind = response.response_type
        t0 = now_us() if self.timeline.enabled else 0.0
        if kind == ResponseType.ERROR:
            error = CollectiveError(f"{response.error_message} (raised on every rank)", names=response.tensor_names)
            for entry in self._take(response.tensor_names):
                if entry is not None:
                    entry.future.set_exception(error)
            return
        if kind == ResponseType.JOIN:
            for entry in self._take([JOIN_TENSOR_NAME]):
                if entry is not None:
                    entry.future.set_result(response.last_joined_rank)
            return
        entries = self._take(response.tensor_names)
        try:
            if kind in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
                results = self._allreduce(response, entries)
            elif entries[0] is None and kind in (ResponseType.ALLGATHER, ResponseType.BROADCAST):
                raise DistlabError(f"rank {self.rank} has no {response.tensor_names[0]!r} to take part in a "
                                   "negotiated allgather/broadcast (it has joined?)")
            elif kind == ResponseType.ALLGATHER:
                results = [self._allgather(response, entries[0])]
            elif kind == ResponseType.BROADCAST:
                entry = entries[0]
                self.group.broadcast(entry.array, src=entry.root, name=entry.name)
                results = [entry.array]
            elif kind == ResponseType.BARRIER:
                results = [None]
            else:
                raise DistlabError(f"unsupported response type {kind}")
        except BaseException as exc:
            for entry in entries:
                if entry is not None and not entry.future.done():
                    entry.future.set_exception(exc)
            raise
        if self.timeline.enabled:
            label = response.tensor_names[0] + (f" +{len(response.tensor_names) - 1}"
                                                if len(response.tensor_names) > 1 else "")
            self.timeline.complete(f"{('allreduce', 'allgather', 'broadcast', 'join', 'adasum', 'alltoall', 'barrier', 'reducescatter')[kind]} {label}",
                                   t0, lane="collectives", cat="collectives",
                                   args={"tensors": list(response.tensor_names), "fused": len(response.tensor_names)})
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.future.set_result(result)

    def _allreduce(self, response, entries):
        dtype = np.dtype(DTYPE_NAMES[response.tensor_type])
        op = ReduceOp.parse(REDUCE_OPS[response.reduce_op] or "sum")
        mpi_op = "sum" if op is ReduceOp.AVG else op.value
        sizes = response.tensor_sizes
        total = int(sum(sizes))
        fused = len(entries) > 1
        t0 = now_us() if self.timeline.enabled else 0.0
        if fused:
            nbytes = total * dtype.itemsize
            if self.fusion_buffer.nbytes < nbytes:
                self.fusion_buffer = np.empty(nbytes, dtype=np.uint8)
            buf = self.fusion_buffer[:nbytes].view(dtype)
        offset = 0
        for entry, count in zip(entries, sizes):
            if entry is None:   # this rank joined: contribute the op's identity (zeros for sum and average)
                part = buf[offset:offset + count] if fused else np.empty(count, dtype)
                part[...] = _identity(op, dtype)
                if not fused:
                    buf = part
            else:
                flat = entry.array.reshape(-1)
                if response.prescale_factor != 1.0:
                    np.multiply(flat, response.prescale_factor, out=flat, casting="unsafe")
                if fused:
                    buf[offset:offset + count] = flat
                else:
                    buf = flat
            offset += count
        if fused and self.timeline.enabled:
            self.timeline.complete("fuse", t0, lane="collectives", cat="collectives",
                                   args={"tensors": len(entries), "bytes": total * dtype.itemsize})
        self.group.allreduce(buf, op=mpi_op, name=response.tensor_names[0] if not fused else
                             f"fused x{len(entries)}")
        scale = response.postscale_factor / (self.size if op is ReduceOp.AVG else 1)
        if scale != 1.0:
            np.multiply(buf, scale, out=buf, casting="unsafe")
        results = []
        offset = 0
        for entry, count in zip(entries, sizes):
            if entry is None:
                results.append(None)
            elif fused:
                results.append(buf[offset:offset + count].reshape(entry.array.shape).copy())
            else:
                results.append(entry.array)
            offset += count
        return results

    def _allgather(self, response, entry):
        sizes = [int(s) for s in response.tensor_sizes]
        array = entry.array
        rest = array.shape[1:]
        padded = np.zeros((max(sizes),) + rest, dtype=array.dtype)
        padded[:array.shape[0]] = array
        gathered = self.group.allgather(padded, name=entry.name)
        return np.concatenate([gathered[r][:sizes[r]] for r in range(self.size)], axis=0)

    def close(self, timeout):
        self.stop.set()
        if not self.stopped.wait(timeout):
            raise DistlabError(f"distlab.collectives did not shut down within {timeout:g} s: another rank may "
                               "not have called shutdown() and is not cycling")
        self.thread.join(timeout)
        if self.agreed_stop:
            # Freeing communicators is collective: only when every rank stopped in the same cycle.
            self.group.destroy()


def _identity(op, dtype):
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return 0
    if op is ReduceOp.PRODUCT:
        return 1
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:   # bool
        return op is ReduceOp.MIN
    return info.max if op is ReduceOp.MIN else info.min


_engine: _Engine | None = None
_engine_lock = threading.Lock()
_atexit_registered = False


def init() -> None:
    """Start the negotiation engine (collective: every rank calls it). Calling it again is a no-op."""
    global _engine, _atexit_registered
    with _engine_lock:
        if _engine is None or _engine.stopped.is_set():
            _engine = _Engine()
        if not _atexit_registered:
            # A program that ends without shutdown() must not leave the cycle thread inside MPI at finalize.
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True


def _shutdown_at_exit() -> None:
    try:
        shutdown(timeout=10.0)
    except Exception:  # noqa: BLE001 - exiting anyway; another rank may already be gone
        pass


def shutdown(timeout: float | None = None) -> None:
    """Stop the engine on every rank (collective); pending handles fail with NotInitializedError."""
    global _engine
    with _engine_lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.close(default_timeout() if timeout is None else timeout)


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown` (and while the engine runs)."""
    return _engine is not None and not _engine.stopped.is_set()


def _get() -> _Engine:
    engine = _engine
    if engine is None:
        raise NotInitializedError("distlab.collectives is not initialized: call collectives.init() on every rank "
                                  "first (or again after shutdown())")
    return engine


def rank() -> int:
    """This rank."""
    return _get().rank


def size() -> int:
    """The number of ranks."""
    return _get().size


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    """Submit an allreduce of ``array``; returns a Handle whose result is the reduced copy.

    ``op`` is Average (the sum divided by the number of ranks; a joined rank counts, contributing zeros), Sum,
    Min, Max or Product. ``prescale_factor`` multiplies the input, ``postscale_factor`` the result.
    """
    op = ReduceOp.parse(op)
    if op not in _OP_CODES:
        raise ValueError(f"allreduce op must be Average, Sum, Min, Max or Product, got {op}")
    return _get().submit("allreduce", array, name, op=op, pre=prescale_factor, post=postscale_factor)


def allreduce(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0):
    """Blocking :func:`allreduce_async` + :func:`synchronize`."""
    return synchronize(allreduce_async(array, name, op, prescale_factor, postscale_factor))


def allgather_async(array, name=None) -> Handle:
    """Submit an allgather: the result concatenates every rank's array along axis 0 (first dims may differ)."""
    return _get().submit("allgather", array, name)


def allgather(array, name=None):
    """Blocking :func:`allgather_async` + :func:`synchronize`."""
    return synchronize(allgather_async(array, name))


def broadcast_async(array, root_rank, name=None) -> Handle:
    """Submit a broadcast of ``root_rank``'s array; the result is a copy of it on every rank."""
    engine = _get()
    if not 0 <= int(root_rank) < engine.size:
        raise ValueError(f"broadcast root_rank {root_rank} is not a rank (size {engine.size})")
    return engine.submit("broadcast", array, name, root=int(root_rank))


def broadcast(array, root_rank, name=None):
    """Blocking :func:`broadcast_async` + :func:`synchronize`."""
    return synchronize(broadcast_async(array, root_rank, name))


def barrier(timeout: float | None = None) -> None:
    """Wait until every rank has reached a barrier (negotiated like any collective)."""
    synchronize(_get().submit("barrier", None, None), timeout)


def join(timeout: float | None = None) -> int:
    """Declare that this rank has no more data; wait for every rank to join; return the last rank that joined.

    Until then this rank takes part in the other ranks' allreduces with zeros; allgather and broadcast are
    refused while any rank has joined.
    """
    return synchronize(_get().submit("join", None, JOIN_TENSOR_NAME), timeout)


def poll(handle: Handle) -> bool:
    """True when the collective has finished (successfully or not)."""
    return handle.future.done()


def synchronize(handle: Handle, timeout: float | None = None):
    """Wait for ``handle`` (default timeout ``DISTLAB_TIMEOUT``) and return its result, or raise its error.

    A timeout raises :class:`~distlab.errors.DistTimeoutError`; on rank 0, once the stall inspector has checked,
    it names the ranks that have not submitted the tensor (``missing_ranks``).
    """
    timeout = default_timeout() if timeout is None else timeout
    try:
        return handle.future.wait(timeout)
    except DistTimeoutError:
        engine = _engine
        missing = []
        if engine is not None:
            missing = list(engine.controller.stall.last_stalled.get(handle.name, []))
            where = f"rank {engine.rank}"
        else:
            where = "this rank"
        if missing:
            detail = f"ranks {missing} have not submitted it (stall inspector)"
        else:
            detail = ("the ranks that have not submitted it are named by rank 0's stall report after "
                      "DISTLAB_STALL_CHECK_TIME")
        raise DistTimeoutError(
            f"{handle.kind} of {handle.name!r} did not complete within {timeout:g} s on {where}: {detail}. "
            "Every rank must submit the same names; a rank without more data should call join().",
            op=handle.kind, name=handle.name, missing_ranks=missing, timeout=timeout) from None


def stats() -> dict:
    """The controller's counters: cycles, fast_path, slow_path, idle, hits, misses, invalid, requeued, ..."""
    engine = _get()
    out = dict(engine.controller.counters)
    out["cache_entries"] = len(engine.controller.cache)
    out["impl"] = _backend.active_impl()
    return out


def stall_reports() -> list:
    """Stall reports produced so far (on rank 0, where the stall inspector checks)."""
    return list(_get().controller.stall.reports)
