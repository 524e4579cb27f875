"""The RPC agent: MPI point-to-point transport, a listener thread, a thread pool, futures matched by message id.

Shared plumbing (not twinned). One agent per process, made by :func:`distlab.rpc.init_rpc`.

How it waits (measured on this 2-core machine, MPICH wheel, 2 ranks; ``benchmarks/bench_rpc.py`` and
../shared/probes/rpc_listener_probe.py): a listener thread blocked in ``MPI_Mprobe`` (GIL released, MPICH's
progress engine polls in C) gave a 36-50 us round trip on an idle machine; ``MPI_Improbe`` polling from Python
with ``sleep(0)``/back-off gave 190-240 us, and spinning on ``Improbe`` from Python made the caller wait for the
GIL (0.7-1.3 ms per round trip under load): the poller re-takes the GIL before the woken caller can. But a
blocking ``Mprobe`` busy-polls inside MPICH, so an idle worker burnt a whole core. Hence the *adaptive* wait
(default; ``DISTLAB_RPC_WAIT=block`` keeps the blocking probe): the listener blocks in ``Mprobe`` while there is
traffic; after ``IDLE_AFTER`` with no message and no answer awaited, the timeout watcher sends it a ``wake``
message, and it switches to polling ``Improbe`` with pauses on an Event (no spinning, back-off up to
``IDLE_SLEEP_MAX``), which a send from this worker or any arriving message ends. And while other threads stream sends (rpc_async,
remote) and nobody blocks in ``call_sync``, the listener polls with 50 us pauses (*streaming* mode): a listener
in ``Mprobe`` holds MPICH's lock while it polls, and each ``MPI_Send`` of the streaming thread waited ~100 us
for it. The caller always waits on a condition variable: only one Python thread ever waits in MPI, and nobody
spin-polls.

Sends: a header message (``TAG_HEADER``) then the out-of-band buffers (``TAG_BUFFER``), under a per-destination
lock so the buffers of two messages never interleave (MPI keeps order per source, tag and communicator). Small
messages use a blocking ``MPI_Send`` (eager: it never waits for the receiver); large ones ``MPI_Isend``, kept
alive until complete, so a listener replying inline never blocks on a peer that is itself blocked sending
(the progress engine completes them while the listener waits in ``Mprobe``).

Batching: small messages the listener itself sends (inline replies, RRef control messages) wait in a
per-destination outbox while more messages are already queued for the listener (``MPI_Improbe``), and leave as
one ``batch`` message (at most ``BATCH_MAX_FRAMES`` messages or ``EAGER_MAX`` bytes, flushed at least every
``BATCH_MAX_FRAMES // 4`` messages handled). A lone request is answered at once.

Extension points (for distributed autograd and others): ``send(dst, kind, payload, meta=...)`` attaches any
picklable metadata to a request; ``register_handler(kind, fn, inline=False)`` adds message kinds
(``kind >= distlab._wire.RPC_USER_KIND_BASE``); handlers read the request's metadata through
:func:`current_call`; ``add_send_hook`` / ``add_reply_hook`` / ``add_response_hook`` attach and read metadata on
every request and response (rpc_sync, rpc_async and remote included) without changing the callers.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import pickle
import threading
import time
import traceback
import queue
import struct
from typing import Any, Callable, NamedTuple

from distlab._wire import RPC_KIND_CODES, RPC_KINDS, RPC_USER_KIND_BASE
from distlab.errors import DistTimeoutError, RemoteError, RpcError, RpcThreadLevelError
from distlab.futures import Future, collect_all
from distlab.timeline import flow_id

from . import framing
from .framing import FLAG_ERROR, FLAG_INLINE, FLAG_NOREPLY

__all__ = ["WorkerInfo", "CallInfo", "RpcAgent", "current_call", "check_thread_level", "TAG_HEADER", "TAG_BUFFER"]

log = logging.getLogger("distlab.rpc")

IDLE_AFTER = 0.05        # adaptive wait: no message and nothing awaited for this long -> idle mode
IDLE_SLEEP_MAX = 0.002   # adaptive wait: longest pause between polls when idle (incoming wake-up latency bound)
STREAM_WINDOW = 0.001    # adaptive wait: another thread sent within this -> poll with pauses (streaming mode)
STREAM_PAUSE = 5e-5      # adaptive wait: pause between polls in streaming mode
TAG_HEADER = 17
TAG_BUFFER = 18
EAGER_MAX = 16 * 1024  # bytes sent with a blocking MPI_Send (below MPICH's eager limits)

K_RESPONSE = RPC_KIND_CODES["response"]
K_STOP = RPC_KIND_CODES["stop"]
K_WAKE = RPC_KIND_CODES["wake"]
K_BATCH = RPC_KIND_CODES["batch"]
BATCH_MAX_FRAMES = 64
_FRAME_LEN = struct.Struct("<I")


class WorkerInfo(NamedTuple):
    """A worker's name and id (its rank in the RPC communicator)."""

    name: str
    id: int


class CallInfo(NamedTuple):
    """The request a handler is running for: source worker id, kind, message id and the caller's metadata."""

    src: int
    kind: int
    mid: int
    meta: Any


_call_local = threading.local()


def current_call() -> CallInfo | None:
    """The request being handled on this thread (None outside a handler)."""
    return getattr(_call_local, "info", None)


def check_thread_level() -> None:
    """Raise RpcThreadLevelError unless MPI runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        raise RpcThreadLevelError(
            "distlab.rpc needs MPI_THREAD_MULTIPLE (its listener thread calls MPI while other threads send), "
            f"but MPI was initialized with {names.get(level, level)}; do not lower mpi4py.rc.thread_level "
            "(or MPI4PY_RC_THREAD_LEVEL), or use an MPI library built with thread support")


_GENERATIONS = itertools.count()  # agents started in this process: message ids restart with each


def _kind_name(kind: int) -> str:
    return RPC_KINDS[kind] if 0 <= kind < len(RPC_KINDS) else f"kind {kind}"


class _Pool:
    """Worker threads fed by a ``queue.SimpleQueue`` (C-implemented): a request handed to the pool costs one
    ``put`` (a ThreadPoolExecutor ``submit`` also builds a future and a work item for every request)."""

    def __init__(self, num_threads: int, name: str):
        self._queue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, *args) -> None:
        self._queue.put((fn, args))

    def _work(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a request's errors are answered by _run; never die
                log.exception("distlab.rpc pool task failed")
            # Drop the task now, not when the next one arrives: its arguments may hold RRefs, whose release
            # (the deletion notice, G1) must not wait for unrelated traffic.
            del item, fn, args

    def shutdown(self, wait: bool = True, timeout: float = 60.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                thread.join(max(deadline - time.monotonic(), 0.0))


class RpcAgent:
    """Listener thread + thread pool + response futures over a dedicated communicator.

    Parameters
    ----------
    name : str
        This worker's name (unique across the world).
    comm : mpi4py.MPI.Intracomm
        The communicator the agent owns (a ``Dup`` of COMM_WORLD made by ``init_rpc``); freed at shutdown.
    rpc_timeout : float
        Default timeout of requests, in seconds.
    num_threads : int
        Threads running requests that are not marked cheap.
    """

    def __init__(self, name: str, comm, rpc_timeout: float = 60.0, num_threads: int = 4):
        from mpi4py import MPI

        self._MPI = MPI
        check_thread_level()
        if not isinstance(name, str) or not name:
            raise ValueError(f"worker name must be a non-empty string, got {name!r}")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.rpc_timeout = float(rpc_timeout)
        names = comm.allgather(name)
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"worker names must be unique; {dup} used by ranks "
                             f"{[i for i, n in enumerate(names) if n in dup]}")
        self.workers = [WorkerInfo(n, i) for i, n in enumerate(names)]
        self.info = self.workers[self.rank]
        self._by_name = {w.name: w for w in self.workers}
        self._pending: dict[int, tuple] = {}  # mid -> (future, dst, kind, start_us)
        self._mids = itertools.count(1)
        self._handlers: dict[int, tuple[Callable, bool]] = {}
        self._kind_labels: dict[int, str | None] = {}  # timeline labels of registered kinds (a handler's name)
        self._generation = next(_GENERATIONS)  # the same on every worker: agents start together (init_rpc)
        self._send_hooks: list[Callable] = []
        self._reply_hooks: list[Callable] = []
        self._response_hooks: list[Callable] = []
        self._send_locks = [threading.Lock() for _ in range(self.size)]
        self._isends: list = []
        self._isend_lock = threading.Lock()
        self._pool = _Pool(max(1, num_threads), f"distlab-rpc-{name}")
        self._deadlines: list = []
        self._deadline_cond = threading.Condition()
        self.errors: list[str] = []
        #: set by the RRef layer: fork_hook(rref) -> fork data; fork_receiver(forks) -> (resolved, futures)
        self.fork_hook: Callable | None = None
        self.fork_receiver: Callable | None = None
        from distlab.timeline import get_timeline, now_us

        self._timeline = get_timeline()
        self._tl_on = self._timeline.enabled  # checked on the hot path: no timeline cost when disabled
        self._now_us = now_us
        self.wait_mode = os.environ.get("DISTLAB_RPC_WAIT", "adaptive").strip().lower()
        if self.wait_mode not in ("adaptive", "block"):
            raise ValueError(f"DISTLAB_RPC_WAIT={self.wait_mode!r} is not one of adaptive, block")
        self._last_activity = time.monotonic()
        self._idle = False             # listener in idle mode (polling with pauses), adaptive wait only
        self._wake = threading.Event()  # set by send() to end an idle pause at once
        self._wake_sent = False         # a K_WAKE to self is in flight
        self._last_send = 0.0           # monotonic time of the last send by a thread other than the listener
        self._sync_threads = set()      # threads blocked in call_sync (they want the lowest latency)
        self._streaming = False         # listener polling with pauses while other threads stream sends
        # Small messages the listener sends (inline replies, control messages) wait in an outbox while more
        # messages are already queued for it, and go out together as one "batch" MPI message.
        self._outbox: dict[int, list] = {}
        self._outbox_bytes: dict[int, int] = {}
        self._listener_ident = None
        self.running = True
        self._listener = threading.Thread(target=self._listen, name=f"distlab-rpc-listener-{name}", daemon=True)
        self._watcher = threading.Thread(target=self._watch_deadlines, name=f"distlab-rpc-timeouts-{name}",
                                         daemon=True)

    def start(self) -> None:
        """Start the listener and the timeout watcher. Register the handlers first: a peer may already have
        sent requests (MPI holds them until the listener receives them)."""
        self._listener.start()
        self._watcher.start()

    # -- registry ---------------------------------------------------------------------------------------------
    def register_handler(self, kind: int, fn: Callable, *, inline: bool = False, _internal: bool = False) -> None:
        """Handle requests of ``kind`` with ``fn(src, payload, meta) -> result or Future``.

        ``inline=True`` runs ``fn`` on the listener thread (only for handlers that never block). Kinds below
        ``RPC_USER_KIND_BASE`` are reserved for distlab.rpc.
        """
        if not isinstance(kind, int) or kind < 0 or kind >= 2 ** 31:
            raise ValueError(f"message kind must be a non-negative int32, got {kind!r}")
        if kind < RPC_USER_KIND_BASE and not _internal:
            raise ValueError(f"message kinds below {RPC_USER_KIND_BASE} are reserved for distlab.rpc, got {kind}")
        if kind in self._handlers and not _internal:
            raise ValueError(f"a handler for message kind {kind} is already registered")
        self._handlers[kind] = (fn, inline)
        self._kind_labels[kind] = getattr(fn, "__name__", "").removeprefix("_handle_").lstrip("_") or None

    def add_send_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``meta = fn(dst, kind, meta)`` for every request this worker sends (calls, remotes, RRef control
        messages, registered kinds), e.g. to attach a distributed-autograd context id. Returns a remover."""
        self._send_hooks.append(fn)
        return lambda: self._send_hooks.remove(fn)

    def add_reply_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``meta = fn(call_info, meta)`` in the handler's thread right after a handler returned, to attach
        metadata to its response (``call_info`` is :func:`current_call`'s value). Returns a remover."""
        self._reply_hooks.append(fn)
        return lambda: self._reply_hooks.remove(fn)

    def add_response_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``fn(src, mid, kind, meta)`` on the listener thread when a response carrying metadata arrives,
        before its future is completed. Returns a remover."""
        self._response_hooks.append(fn)
        return lambda: self._response_hooks.remove(fn)

    def worker_info(self, to=None) -> WorkerInfo:
        """Resolve a worker name, id or WorkerInfo (None: this worker)."""
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            try:
                return self._by_name[to]
            except KeyError:
                raise ValueError(f"unknown worker name {to!r}; workers are {sorted(self._by_name)}") from None
        if isinstance(to, int) and 0 <= to < self.size:
            return self.workers[to]
        raise ValueError(f"unknown worker {to!r}; workers are ids 0..{self.size - 1} or names "
                         f"{sorted(self._by_name)}")

    # -- sending ----------------------------------------------------------------------------------------------
    def send(self, dst, kind: int, payload, *, meta=None, timeout: float | None = None, inline: bool = False,
             noreply: bool = False, _track_timeout: bool = True) -> Future:
        """Send a request; return a Future completed with the handler's result (or a RemoteError).

        ``timeout`` (default ``rpc_timeout``; 0 or None-like negative means none) fails the future with
        DistTimeoutError. ``noreply`` sends a one-way message and returns a completed future.
        """
        if not self.running:
            raise RpcError("the RPC agent is not running (call distlab.rpc.init_rpc first, or it was shut down)")
        dst = dst if type(dst) is int and 0 <= dst < self.size else self.worker_info(dst).id
        for hook in self._send_hooks:
            meta = hook(dst, kind, meta)
        body, buffers, forks = framing.dumps(payload, self.fork_hook)
        mid = next(self._mids)
        fut = Future(description=f"rpc {_kind_name(kind)} #{mid} to {self.workers[dst].name}")
        flags = (FLAG_INLINE if inline else 0) | (FLAG_NOREPLY if noreply else 0)
        if noreply:
            fut.set_result(None)
        else:
            self._pending[mid] = (fut, dst, kind, self._now_us() if self._tl_on else 0.0)
            timeout = self.rpc_timeout if timeout is None else timeout
            if _track_timeout and timeout and timeout > 0:
                self._add_deadline(time.monotonic() + timeout, mid, timeout)
        if self._tl_on:
            self._trace_message(True, self._label(kind, payload), dst, "rpc", mid)
        try:
            self._transmit(dst, kind, flags, mid, buffers, meta, forks, body)
        except BaseException:
            self._pending.pop(mid, None)
            raise
        if threading.get_ident() != self._listener_ident:
            self._last_send = time.monotonic()
        if self._idle:
            self._wake.set()
        return fut

    def call_sync(self, dst, kind: int, payload, *, meta=None, timeout: float | None = None, inline=False):
        """``send`` then wait for the result; the wait is bounded by ``timeout`` (default ``rpc_timeout``)."""
        timeout = self.rpc_timeout if timeout is None else timeout
        if threading.current_thread() is self._listener:
            raise RpcError(
                "a blocking RPC (rpc_sync, to_here) was called on the listener thread of worker "
                f"{self.info.name!r}: functions marked cheap run there and must not wait for other workers "
                "(only the listener could receive the answer); drop @cheap or use rpc_async")
        ident = threading.get_ident()
        self._sync_threads.add(ident)
        if self._streaming:
            self._wake.set()  # the listener goes back to its blocking probe for the lowest latency
        try:
            fut = self.send(dst, kind, payload, meta=meta, inline=inline, _track_timeout=False)
            try:
                return fut.wait(timeout if timeout and timeout > 0 else 1e9)
            except DistTimeoutError:
                if fut.done():
                    return fut.value()
                self._expire(fut, timeout)
                return fut.value()
        finally:
            self._sync_threads.discard(ident)

    def _transmit(self, dst, kind, flags, mid, buffers, meta, forks, body) -> None:
        header = framing.pack_header(kind, flags, mid, buffers, meta, forks, body)
        MPI = self._MPI
        comm = self.comm
        if not buffers and len(header) <= EAGER_MAX:
            if threading.get_ident() == self._listener_ident:
                self._queue_frame(dst, header)
                return
            comm.Send([header, MPI.BYTE], dst, TAG_HEADER)
            return
        requests = []
        with self._send_locks[dst]:
            if len(header) <= EAGER_MAX:
                comm.Send([header, MPI.BYTE], dst, TAG_HEADER)
            else:
                requests.append(comm.Isend([header, MPI.BYTE], dst, TAG_HEADER))
            for buf in buffers:
                requests.append(comm.Isend([buf, MPI.BYTE], dst, TAG_BUFFER))
        with self._isend_lock:
            self._isends.append((requests, header, buffers))
            if len(self._isends) > 8:
                self._isends = [entry for entry in self._isends if not MPI.Request.Testall(entry[0])]

    def _queue_frame(self, dst, header) -> None:
        """Listener thread only: hold a small message for ``dst`` until the listener runs out of work."""
        box = self._outbox.get(dst)
        if box is None:
            box = self._outbox[dst] = []
            self._outbox_bytes[dst] = 0
        box.append(header)
        self._outbox_bytes[dst] += len(header) + _FRAME_LEN.size
        if len(box) >= BATCH_MAX_FRAMES or self._outbox_bytes[dst] > EAGER_MAX - 64:
            self._flush_to(dst)

    def _flush_to(self, dst) -> None:
        box = self._outbox.pop(dst, None)
        self._outbox_bytes.pop(dst, None)
        if not box:
            return
        MPI = self._MPI
        if len(box) == 1:
            data = box[0]
        else:
            body = b"".join(_FRAME_LEN.pack(len(frame)) + frame for frame in box)
            data = framing.pack_header(K_BATCH, 0, 0, [], None, (), body)
        self.comm.Send([data, MPI.BYTE], dst, TAG_HEADER)

    def _flush_outbox(self) -> None:
        for dst in list(self._outbox):
            self._flush_to(dst)

    # -- receiving --------------------------------------------------------------------------------------------
    def _listen(self) -> None:
        MPI = self._MPI
        comm = self.comm
        status = MPI.Status()
        adaptive = self.wait_mode == "adaptive"
        self._listener_ident = threading.get_ident()
        handled = 0
        while True:
            try:
                if self._outbox and handled >= BATCH_MAX_FRAMES // 4:
                    # Bound how long a held message waits while traffic from other workers keeps coming.
                    self._flush_outbox()
                    handled = 0
                if self._outbox:
                    # More work already queued? Handle it first; else send what the outbox holds.
                    message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
                    if message is None:
                        self._flush_outbox()
                        handled = 0
                        continue
                elif adaptive and self._idle:
                    message = self._probe_idle(comm, status)
                elif (adaptive and not self._sync_threads
                      and time.monotonic() - self._last_send < STREAM_WINDOW):
                    message = self._probe_streaming(comm, status)
                else:
                    message = comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
                src = status.Get_source()
                data = bytearray(status.Get_count(MPI.BYTE))
                message.Recv([data, MPI.BYTE])
                try:
                    kind, flags, mid, sizes, meta, forks, body = framing.unpack_header(data)
                except Exception as exc:  # noqa: BLE001 - a malformed message must not kill the listener
                    self._record_error(f"dropped a malformed message from worker {src}: {exc}")
                    continue
                buffers = []
                for size in sizes:
                    buf = bytearray(size)
                    comm.Recv([buf, MPI.BYTE], src, TAG_BUFFER)
                    buffers.append(buf)
                if kind == K_STOP and src == self.rank:
                    self._flush_outbox()
                    return
                if kind == K_WAKE and src == self.rank:
                    # the watcher saw no traffic for IDLE_AFTER: go idle unless something is awaited
                    self._wake_sent = False
                    if not self._pending and time.monotonic() - self._last_activity >= IDLE_AFTER:
                        self._idle = True
                    continue
                self._last_activity = time.monotonic()
                handled += 1
                if kind == K_BATCH:
                    self._on_batch(src, body)
                elif kind == K_RESPONSE:
                    self._on_response(src, flags, mid, forks, body, buffers, meta)
                else:
                    self._on_request(src, kind, flags, mid, meta, forks, body, buffers)
            except Exception:  # noqa: BLE001 - keep listening; record what went wrong
                self._record_error(f"listener error: {traceback.format_exc()}")

    def _on_batch(self, src, data) -> None:
        """Dispatch each small message of a batch, in order."""
        pos, end = 0, len(data)
        while pos < end:
            if pos + _FRAME_LEN.size > end:
                self._record_error(f"dropped a malformed batch from worker {src}: truncated frame length")
                return
            (size,) = _FRAME_LEN.unpack_from(data, pos)
            pos += _FRAME_LEN.size
            if pos + size > end:
                self._record_error(f"dropped a malformed batch from worker {src}: frame of {size} bytes overruns")
                return
            try:
                kind, flags, mid, sizes, meta, forks, body = framing.unpack_header(data[pos:pos + size])
                if sizes or kind in (K_BATCH, K_STOP, K_WAKE):
                    raise ValueError(f"kind {kind} with {len(sizes)} buffers cannot be batched")
            except Exception as exc:  # noqa: BLE001
                self._record_error(f"dropped a malformed message in a batch from worker {src}: {exc}")
            else:
                if kind == K_RESPONSE:
                    self._on_response(src, flags, mid, forks, body, [], meta)
                else:
                    self._on_request(src, kind, flags, mid, meta, forks, body, [])
            pos += size

    def _probe_streaming(self, comm, status):
        """Streaming mode: another thread is sending a stream of requests (rpc_async, remote). A listener
        blocked in ``Mprobe`` holds MPICH's lock while it polls, and every send then waits for it (measured
        ~100 us per MPI_Send under load), so poll with ``Improbe`` and short pauses instead; go back to the
        blocking probe when the stream stops or a caller blocks in ``call_sync``."""
        MPI = self._MPI
        wake = self._wake
        self._streaming = True
        try:
            while True:
                message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
                if message is not None:
                    return message
                if self._sync_threads or time.monotonic() - self._last_send >= STREAM_WINDOW or wake.is_set():
                    wake.clear()
                    return comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
                wake.wait(STREAM_PAUSE)
        finally:
            self._streaming = False

    def _probe_idle(self, comm, status):
        """Idle mode: poll with ``MPI_Improbe``, pausing on an Event (GIL released, no spinning) with
        exponential back-off up to ``IDLE_SLEEP_MAX``; a send from this worker ends the pause at once. Leaves
        idle mode (back to the blocking ``Mprobe``) on the first message or send."""
        MPI = self._MPI
        delay = 0.0
        wake = self._wake
        while True:
            message = comm.Improbe(MPI.ANY_SOURCE, TAG_HEADER, status)
            if message is not None or self._pending or wake.is_set():
                wake.clear()
                self._idle = False
                with self._deadline_cond:  # the watcher resumes its idle checks
                    self._deadline_cond.notify()
                if message is not None:
                    return message
                return comm.Mprobe(MPI.ANY_SOURCE, TAG_HEADER, status)
            delay = min(max(delay * 2.0, 5e-5), IDLE_SLEEP_MAX)
            wake.wait(delay)

    def _record_error(self, text: str) -> None:
        log.error("distlab.rpc worker %s: %s", self.info.name, text)
        self.errors.append(text)

    def _on_response(self, src, flags, mid, forks, body, buffers, meta=None) -> None:
        if self._tl_on:
            self._trace_message(False, "response", src, "rpc response", mid)
        entry = self._pending.pop(mid, None)
        if entry is None:
            return  # the request timed out (or was failed at shutdown): drop its late response
        fut = entry[0]
        if meta is not None:
            for hook in self._response_hooks:
                hook(src, mid, entry[2], meta)
        if self._tl_on:
            self._timeline.complete(f"rpc {_kind_name(entry[2])} -> {self.workers[src].name}", entry[3],
                                    self._now_us(), lane="rpc", args={"mid": mid, "error": bool(flags & FLAG_ERROR)})
        if flags & FLAG_ERROR:
            fut.set_exception(self._remote_error(body, buffers))
            return
        self._with_forks(forks, lambda resolved: fut.set_result(framing.loads(body, buffers, resolved)),
                         fut.set_exception, run_in_pool=False)

    def _with_forks(self, forks, then, fail, run_in_pool) -> None:
        """Receive RRef fork data, wait until each RRef is confirmed, then run ``then(resolved)``."""
        if not forks:
            try:
                then(None)
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
            return
        try:
            resolved, waits = self.fork_receiver(forks)
        except BaseException as exc:  # noqa: BLE001
            fail(exc)
            return
        waits = [w for w in waits if not w.done()]

        def go(_=None):
            try:
                then(resolved)
            except BaseException as exc:  # noqa: BLE001
                fail(exc)

        if not waits:
            go()
        elif run_in_pool:
            collect_all(waits).add_done_callback(lambda _f: self._pool.submit(go))
        else:
            collect_all(waits).add_done_callback(go)

    def _on_request(self, src, kind, flags, mid, meta, forks, body, buffers) -> None:
        if self._tl_on:
            self._trace_message(False, self._label(kind), src, "rpc", mid)
        entry = self._handlers.get(kind)
        if entry is None:
            self._reply_error(src, mid, flags, RpcError(
                f"worker {self.info.name} has no handler for message kind {kind} ({_kind_name(kind)})"))
            return
        fn, inline = entry
        if inline or flags & FLAG_INLINE:
            self._run(fn, src, kind, flags, mid, meta, forks, body, buffers, inline=True)
        else:
            self._pool.submit(self._run, fn, src, kind, flags, mid, meta, forks, body, buffers, False)

    def _run(self, fn, src, kind, flags, mid, meta, forks, body, buffers, inline) -> None:
        def execute(resolved):
            payload = framing.loads(body, buffers, resolved)
            previous = getattr(_call_local, "info", None)
            _call_local.info = info = CallInfo(src, kind, mid, meta)
            start = self._now_us() if self._tl_on else 0.0
            rmeta = None
            try:
                result = fn(src, payload, meta)
                for hook in self._reply_hooks:
                    rmeta = hook(info, rmeta)
            finally:
                _call_local.info = previous
                if self._tl_on:
                    self._timeline.complete(f"handle {_kind_name(kind)} <- {self.workers[src].name}", start,
                                            self._now_us(), lane="rpc-handler", args={"mid": mid})
            if flags & FLAG_NOREPLY:
                return
            if isinstance(result, Future):
                result.add_done_callback(lambda f: self._reply_future(src, mid, flags, f, rmeta))
            else:
                self._reply(src, mid, result, rmeta)

        def fail(exc):
            if not flags & FLAG_NOREPLY:
                self._reply_error(src, mid, flags, exc)
            else:
                self._record_error(f"one-way {_kind_name(kind)} from worker {src} failed: {exc!r}")

        self._with_forks(forks, execute, fail, run_in_pool=not inline)

    def _reply_future(self, dst, mid, flags, fut, meta=None) -> None:
        exc = fut.exception()
        if exc is not None:
            self._reply_error(dst, mid, flags, exc)
        else:
            self._reply(dst, mid, fut.value(), meta)

    def _reply(self, dst, mid, value, meta=None) -> None:
        if not self.running and dst != self.rank:
            return
        try:
            body, buffers, forks = framing.dumps(value, self.fork_hook)
        except BaseException as exc:  # noqa: BLE001 - an unpicklable result becomes the caller's error
            self._reply_error(dst, mid, 0, exc)
            return
        if self._tl_on:
            self._trace_message(True, "response", dst, "rpc response", mid)
        self._transmit(dst, K_RESPONSE, 0, mid, buffers, meta, forks, body)

    def _reply_error(self, dst, mid, flags, exc) -> None:
        if flags & FLAG_NOREPLY:
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
        try:
            exc_bytes = pickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
            exc_bytes = None
        body = pickle.dumps((exc_type, str(exc), tb, self.info.name, exc_bytes), protocol=5)
        if self._tl_on:
            self._trace_message(True, f"error ({type(exc).__name__})", dst, "rpc response", mid)
        self._transmit(dst, K_RESPONSE, FLAG_ERROR, mid, [], None, (), body)

    def _remote_error(self, body, buffers) -> RemoteError:
        try:
            exc_type, text, tb, worker, exc_bytes = pickle.loads(body)
        except Exception as exc:  # noqa: BLE001
            return RemoteError(f"malformed error response: {exc}")
        remote_exc = None
        if exc_bytes is not None:
            try:
                remote_exc = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001
                remote_exc = None
        return RemoteError(
            f"{exc_type}: {text}\n(raised on RPC worker {worker!r}; remote traceback follows)\n{tb}",
            worker_name=worker, exc_type=exc_type, remote_traceback=tb, remote_exception=remote_exc)

    # -- timeouts ---------------------------------------------------------------------------------------------
    def _add_deadline(self, deadline, mid, timeout) -> None:
        with self._deadline_cond:
            heap = self._deadlines
            pending = self._pending
            # Prune answered requests from the top: with the usual single timeout, deadlines come in order, so
            # the heap stays about as large as the number of requests in flight (not calls/s x timeout).
            while heap and heap[0][1] not in pending:
                heapq.heappop(heap)
            first = not heap or deadline < heap[0][0]
            heapq.heappush(heap, (deadline, mid, timeout))
            if first:
                self._deadline_cond.notify()

    def _watch_deadlines(self) -> None:
        cond = self._deadline_cond
        while True:
            with cond:
                while self.running and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    wait = None if not self._deadlines else self._deadlines[0][0] - time.monotonic()
                    if self.wait_mode == "adaptive" and not self._idle:
                        wait = IDLE_AFTER if wait is None else min(wait, IDLE_AFTER)
                    cond.wait(wait)
                    self._maybe_go_idle()
                if not self.running:
                    return
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines))
            for _deadline, mid, timeout in expired:
                entry = self._pending.get(mid)
                if entry is not None:
                    self._expire(entry[0], timeout, mid)

    def _maybe_go_idle(self) -> None:
        """Watcher: after IDLE_AFTER without traffic, break the listener out of its busy-polling ``Mprobe``
        (a K_WAKE message to self) so it can switch to idle polling."""
        if (self.wait_mode != "adaptive" or self._idle or self._wake_sent or self._pending or not self.running
                or time.monotonic() - self._last_activity < IDLE_AFTER):
            return
        self._wake_sent = True
        header = framing.pack_header(K_WAKE, 0, 0, [], None, (), b"")
        try:
            self.comm.Send([header, self._MPI.BYTE], self.rank, TAG_HEADER)
        except Exception:  # noqa: BLE001 - the agent is stopping
            self._wake_sent = False

    def _expire(self, fut, timeout, mid=None) -> None:
        if mid is None:
            for key, entry in list(self._pending.items()):
                if entry[0] is fut:
                    mid = key
                    break
        entry = self._pending.pop(mid, None) if mid is not None else None
        if entry is None:
            return
        dst, kind = entry[1], entry[2]
        try:
            fut.set_exception(DistTimeoutError(
                f"rpc {_kind_name(kind)} #{mid} from worker {self.info.name!r} to worker "
                f"{self.workers[dst].name!r} got no response within {timeout:g} s",
                op=f"rpc {_kind_name(kind)}", timeout=timeout, missing_ranks=[dst]))
        except RuntimeError:
            pass  # completed concurrently

    # -- shutdown ---------------------------------------------------------------------------------------------
    def _label(self, kind: int, payload=None) -> str:
        """A message's name on the timeline: its kind, a registered kind's handler, a call's function."""
        label = self._kind_labels.get(kind) if kind >= RPC_USER_KIND_BASE else None
        label = label or _kind_name(kind)
        if kind == RPC_KIND_CODES["call"] and type(payload) is tuple and payload:
            name = getattr(payload[0], "__name__", None) or getattr(payload[0], "name", None)
            label = f"call {name.lstrip('_')}" if isinstance(name, str) else label
        return label

    def _trace_message(self, sending: bool, name: str, peer: int, what: str, mid: int) -> None:
        """One end of a message on the ``rpc messages`` lane; both ends compute the same flow id."""
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        flow = flow_id(what, self._generation, src, dst, mid)
        if sending:
            self._timeline.send(name, dst, flow, lane="rpc messages", args={"mid": mid})
        else:
            self._timeline.receive(name, src, flow, lane="rpc messages", args={"mid": mid})

    def pending_count(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    def wait_idle(self, timeout: float) -> None:
        """Wait until every request this worker sent has been answered (bounded)."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while self._pending:
            if time.monotonic() > deadline:
                waiting = sorted({self.workers[e[1]].name for e in list(self._pending.values())})
                raise DistTimeoutError(
                    f"rpc shutdown on worker {self.info.name!r}: {len(self._pending)} requests still unanswered "
                    f"after {timeout:g} s (waiting on workers {waiting})", op="rpc shutdown", timeout=timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def barrier(self, timeout: float) -> None:
        """A non-blocking barrier on the agent's communicator, polled with back-off, bounded by ``timeout``."""
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while not request.Test():
            if time.monotonic() > deadline:
                raise DistTimeoutError(
                    f"rpc shutdown on worker {self.info.name!r}: not every worker reached shutdown within "
                    f"{timeout:g} s (workers: {[w.name for w in self.workers]})",
                    op="rpc shutdown barrier", timeout=timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def stop(self, graceful: bool = True, timeout: float = 60.0) -> None:
        """Stop the listener and the pool; fail unanswered requests. ``graceful`` frees the communicator."""
        if not self.running:
            return
        MPI = self._MPI
        self.running = False
        with self._deadline_cond:
            self._deadline_cond.notify_all()
        header = framing.pack_header(K_STOP, 0, 0, [], None, (), b"")
        self.comm.Send([header, MPI.BYTE], self.rank, TAG_HEADER)
        self._listener.join(timeout)
        if self._listener.is_alive():
            self._record_error("the listener thread did not stop within the timeout")
        for mid, (fut, dst, kind, _start) in list(self._pending.items()):
            self._pending.pop(mid, None)
            try:
                fut.set_exception(RpcError(
                    f"rpc {_kind_name(kind)} #{mid} to worker {self.workers[dst].name!r}: the RPC agent was shut "
                    "down before the response arrived"))
            except RuntimeError:
                pass
        self._pool.shutdown(wait=graceful, timeout=timeout)
        deadline = time.monotonic() + timeout
        with self._isend_lock:
            pending = [r for entry in self._isends for r in entry[0]]
            self._isends = []
        while pending and not MPI.Request.Testall(pending):
            if time.monotonic() > deadline:
                self._record_error(f"{len(pending)} sends did not complete at shutdown")
                break
            time.sleep(1e-3)
        if graceful and not self._listener.is_alive():
            self.comm.Free()
