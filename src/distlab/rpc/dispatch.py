"""The RPC agent's request dispatch: handlers by message kind, the thread pool, inline handlers, and replies.

Shared plumbing of :mod:`distlab.rpc` (not twinned). A request runs on the pool (the default) or on the listener
thread itself (handlers registered ``inline``, or requests flagged cheap: they must not block). Before a handler
runs, every RRef in its arguments is received (``fork_receiver``) and confirmed by its owner (G2: user code only
sees confirmed RRefs). A handler returns a value or a :class:`~distlab.futures.Future`; the reply goes out when
the value is known. Errors travel back as a description (type, text, traceback, worker) and, when it pickles,
the exception itself; the caller raises :class:`~distlab.errors.RemoteError`.
"""
from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

from distlab._wire import RPC_KIND_CODES, RPC_USER_KIND_BASE
from distlab.errors import RemoteError
from distlab.futures import Future, collect_all
from distlab.timeline import flow_id

from . import framing
from .framing import FLAG_ERROR, FLAG_INLINE, FLAG_NOREPLY
from .transport import K_RESPONSE, kind_name

__all__ = ["CallInfo", "Dispatcher", "current_call"]

log = logging.getLogger("distlab.rpc")

K_CALL = RPC_KIND_CODES["call"]


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


class Dispatcher:
    """Runs the requests that reach this worker and sends their replies.

    Parameters
    ----------
    info : WorkerInfo
        This worker (named in remote errors).
    transmit : callable
        ``transmit(dst, kind, flags, mid, buffers, meta, forks, body)``: the transport's send.
    record_error : callable
        ``record_error(text)``: log a failure nobody waits for (a one-way request that raised).
    num_threads : int
        Threads of the pool.
    timeline : distlab.timeline.Timeline
        Where handled requests are drawn (lane ``rpc-handler``) when the timeline is enabled.
    worker_name : callable
        ``worker_name(id) -> str`` (for the timeline).
    generation : int
        Which agent of this process this is (the same on every worker): message ids restart with each agent, so
        the timeline's flow ids include it.
    """

    def __init__(self, info, transmit: Callable, record_error: Callable, num_threads: int, timeline,
                 worker_name: Callable, generation: int = 0):
        from distlab.timeline import now_us

        self.info = info
        self._transmit = transmit
        self._record_error = record_error
        self._handlers: dict[int, tuple[Callable, bool]] = {}
        self._kind_labels: dict[int, str | None] = {}  # timeline labels of registered kinds (a handler's name)
        self._generation = generation
        self._reply_hooks: list[Callable] = []
        self.pool = _Pool(max(1, num_threads), f"distlab-rpc-{info.name}")
        self._timeline = timeline
        self._tl_on = timeline.enabled  # checked on the hot path: no timeline cost when disabled
        self._now_us = now_us
        self._worker_name = worker_name
        self.running = True
        #: set by the RRef layer: fork_hook(rref) -> fork data; fork_receiver(forks) -> (resolved, futures)
        self.fork_hook: Callable | None = None
        self.fork_receiver: Callable | None = None
        #: set by the agent: place(dst, mode) -> where device arrays land at dst (a reply follows mode "reply")
        self.place: Callable | None = None

    # -- registry ---------------------------------------------------------------------------------------------
    def register_handler(self, kind: int, fn: Callable, inline: bool, internal: bool) -> None:
        if not isinstance(kind, int) or kind < 0 or kind >= 2 ** 31:
            raise ValueError(f"message kind must be a non-negative int32, got {kind!r}")
        if kind < RPC_USER_KIND_BASE and not internal:
            raise ValueError(f"message kinds below {RPC_USER_KIND_BASE} are reserved for distlab.rpc, got {kind}")
        if kind in self._handlers and not internal:
            raise ValueError(f"a handler for message kind {kind} is already registered")
        self._handlers[kind] = (fn, inline)
        self._kind_labels[kind] = getattr(fn, "__name__", "").removeprefix("_handle_").lstrip("_") or None

    def handles(self, kind: int) -> bool:
        """A handler is registered for requests of ``kind`` (the listener refuses other kinds unread)."""
        return kind in self._handlers

    def add_reply_hook(self, fn: Callable) -> Callable[[], None]:
        self._reply_hooks.append(fn)
        return lambda: self._reply_hooks.remove(fn)

    # -- requests ---------------------------------------------------------------------------------------------
    def on_request(self, src, kind, flags, mid, meta, forks, body, buffers) -> None:
        """Listener thread: run the request inline or hand it to the pool."""
        if self._tl_on:
            self.trace_message(False, self.label(kind), src, "rpc", mid)
        fn, inline = self._handlers[kind]  # the listener refused kinds without a handler (Transport._check_kind)
        if inline or flags & FLAG_INLINE:
            self._run(fn, src, kind, flags, mid, meta, forks, body, buffers, True)
        else:
            self.pool.submit(self._run, fn, src, kind, flags, mid, meta, forks, body, buffers, False)

    def _run(self, fn, src, kind, flags, mid, meta, forks, body, buffers, inline) -> None:
        def execute(resolved):
            payload = framing.loads(body, buffers, resolved, checked=True)  # walked by the codec
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
                    self._timeline.complete(f"handle {kind_name(kind)} <- {self._worker_name(src)}", start,
                                            self._now_us(), lane="rpc-handler", args={"mid": mid})
            if flags & FLAG_NOREPLY:
                return
            if isinstance(result, Future):
                result.add_done_callback(lambda f: self._reply_future(src, mid, flags, f, rmeta))
            else:
                self.reply(src, mid, result, rmeta)

        def fail(exc):
            if not flags & FLAG_NOREPLY:
                self.reply_error(src, mid, flags, exc)
            else:
                self._record_error(f"one-way {kind_name(kind)} from worker {src} failed: {exc!r}")

        self.with_forks(forks, execute, fail, run_in_pool=not inline)

    def with_forks(self, forks, then, fail, run_in_pool) -> None:
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
            collect_all(waits).add_done_callback(lambda _f: self.pool.submit(go))
        else:
            collect_all(waits).add_done_callback(go)

    # -- the timeline's names and flows ------------------------------------------------------------------------
    def label(self, kind: int, payload=None) -> str:
        """A message's name: its kind, a registered kind's handler, a call's function."""
        label = self._kind_labels.get(kind) if kind >= RPC_USER_KIND_BASE else None
        label = label or kind_name(kind)
        if kind == K_CALL and type(payload) is tuple and payload:
            name = getattr(payload[0], "__name__", None) or getattr(payload[0], "name", None)
            label = f"call {name.lstrip('_')}" if isinstance(name, str) else label
        return label

    def trace_message(self, sending: bool, name: str, peer: int, what: str, mid: int) -> None:
        """One end of a message on the ``rpc messages`` lane; both ends compute the same flow id."""
        src, dst = (self.info.id, peer) if sending else (peer, self.info.id)
        flow = flow_id(what, self._generation, src, dst, mid)
        if sending:
            self._timeline.send(name, dst, flow, lane="rpc messages", args={"mid": mid})
        else:
            self._timeline.receive(name, src, flow, lane="rpc messages", args={"mid": mid})

    # -- replies ----------------------------------------------------------------------------------------------
    def _reply_future(self, dst, mid, flags, fut, meta=None) -> None:
        exc = fut.exception()
        if exc is not None:
            self.reply_error(dst, mid, flags, exc)
        else:
            self.reply(dst, mid, fut.value(), meta)

    def reply(self, dst, mid, value, meta=None) -> None:
        """Send ``value`` back as the response to request ``mid`` of worker ``dst``."""
        if not self.running and dst != self.info.id:
            return
        try:
            body, buffers, forks = framing.dumps(value, self.fork_hook,
                                                 self.place(dst, "reply") if self.place else None)
        except BaseException as exc:  # noqa: BLE001 - an unpicklable result becomes the caller's error
            self.reply_error(dst, mid, 0, exc)
            return
        if self._tl_on:
            self.trace_message(True, "response", dst, "rpc response", mid)
        self._transmit(dst, K_RESPONSE, 0, mid, buffers, meta, forks, body)

    def reply_error(self, dst, mid, flags, exc) -> None:
        """Send ``exc`` back as the (error) response to request ``mid`` of worker ``dst``."""
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
            self.trace_message(True, f"error ({type(exc).__name__})", dst, "rpc response", mid)
        self._transmit(dst, K_RESPONSE, FLAG_ERROR, mid, [], None, (), body)

    @staticmethod
    def remote_error(body) -> RemoteError:
        """The RemoteError an error response describes."""
        try:
            exc_type, text, tb, worker, exc_bytes = framing.loads(body, checked=True)  # walked by the codec
        except Exception as exc:  # noqa: BLE001
            return RemoteError(f"malformed error response: {exc}")
        remote_exc = None
        if exc_bytes is not None:
            try:
                remote_exc = framing.loads(exc_bytes)
            except Exception:  # noqa: BLE001 - e.g. its class does not exist here: the text still tells
                remote_exc = None
        return RemoteError(
            f"{exc_type}: {text}\n(raised on RPC worker {worker!r}; remote traceback follows)\n{tb}",
            worker_name=worker, exc_type=exc_type, remote_traceback=tb, remote_exception=remote_exc)
