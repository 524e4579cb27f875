"""The RPC agent's request dispatch: handlers by message kind, the thread pool, inline handlers, and replies.

Shared plumbing of :mod:`distlab.rpc` (not twinned). A request runs on the thread that received it: on the seat
(handlers registered ``inline``, and requests flagged cheap: they must not block), or away from it, the thread
leaving the seat to a standby should the handler block (any other request, when it came in a message of its own
and a standby watches); otherwise, on the pool. Before a handler
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

from distlab._wire import RPC_KIND_CODES, RPC_TAG_HEADER, RPC_TAG_REPLY_BASE, RPC_USER_KIND_BASE
from distlab.errors import RemoteError
from distlab.futures import Future, collect_all
from distlab.timeline import flow_id

from . import framing
from .framing import FLAG_ERROR, FLAG_INLINE, FLAG_NOREPLY
from .messenger import K_RESPONSE, kind_name

__all__ = ["CallInfo", "Dispatcher", "current_call", "reply_tag"]

log = logging.getLogger("distlab.rpc")

K_CALL = RPC_KIND_CODES["call"]


def reply_tag(slot: int) -> int:
    """The tag a reply to reply slot ``slot`` goes on (slot 0: the caller's listener)."""
    return RPC_TAG_REPLY_BASE + slot if slot else RPC_TAG_HEADER


class CallInfo(NamedTuple):
    """The request a handler is running for: source worker id, kind, message id and the caller's metadata."""

    src: int
    kind: int
    mid: int
    meta: Any




class _CallLocal(threading.local):
    info = None  # a class-level default: getattr on a thread-local attribute never set formats an AttributeError


_call_local = _CallLocal()
_new_tuple = tuple.__new__
_NONE_REPLY = (framing.NONE_BODY, (), ())


def current_call() -> CallInfo | None:
    """The request being handled on this thread (None outside a handler)."""
    return _call_local.info


class _Threads:
    """The agent's threads: one listens (holds the seat), one stands by, the others run queued requests.

    Threads take turns at listening (see :mod:`distlab.reference.rpc_wait`, "Who listens"): the thread that holds
    the seat runs the listener's loop (``listen()``, the messenger's); a thread with nothing to do stands by
    (``seat.watch``) while no other does, and takes the seat when its holder stays away running a handler; the
    rest wait on a ``queue.SimpleQueue`` (C-implemented: a request handed to them costs one ``put``) for the
    requests the listener could not run itself. A thread that lost the seat while it was away joins them.
    """

    def __init__(self, num_threads: int, name: str, seat, listen: Callable):
        self._queue = queue.SimpleQueue()
        self._seat = seat
        self._listen = listen
        self._roles = threading.Lock()
        self.standby = False   # a thread watches the seat: the listener may run a request itself
        self.running = True
        self._threads = [threading.Thread(target=self._main, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads + 1)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` on a thread of the pool."""
        self._queue.put((fn, args))

    def _main(self) -> None:
        seat = self._seat
        while True:
            if self.running:
                if seat.take():
                    self._listen()  # until this thread lost the seat (it stayed away too long), or the agent stops
                    continue
                if self._stand_by():
                    continue
            item = self._queue.get()
            if item is None:
                return
            if item is _NUDGE:
                continue
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a request's errors are answered by _run; never die
                log.exception("distlab.rpc pool task failed")
            # Drop the task now, not when the next one arrives: its arguments may hold RRefs, whose release
            # (the deletion notice, G1) must not wait for unrelated traffic.
            del item, fn, args

    def _stand_by(self) -> bool:
        """Watch the seat if no other thread does; True when this thread did (it may hold the seat now)."""
        with self._roles:
            if self.standby:
                return False
            self.standby = True
        try:
            took = self._seat.watch(0.5)
        finally:
            with self._roles:
                self.standby = False
        if took:
            self._queue.put(_NUDGE)  # an idle thread becomes the next standby
        return True

    def shutdown(self, wait: bool = True, timeout: float = 60.0) -> None:
        self.running = False
        self._seat.stop()
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                thread.join(max(deadline - time.monotonic(), 0.0))


_NUDGE = object()  # a queue item that makes an idle thread look at the roles again


class Dispatcher:
    """Runs the requests that reach this worker and sends their replies.

    Parameters
    ----------
    info : WorkerInfo
        This worker (named in remote errors).
    messenger : distlab.rpc.messenger.Messenger
        Sends the replies (``transmit``); its seat and listener loop drive the agent's threads.
    handlers : dict
        The registry of request kinds, filled by :meth:`register_handler`: kind -> (handler, inline).
    record_error : callable
        ``record_error(text)``: log a failure nobody waits for (a one-way request that raised).
    num_threads : int
        Threads that run requests (one more thread listens).
    timeline : distlab.timeline.Timeline
        Where handled requests are drawn (lane ``rpc-handler``) when the timeline is enabled.
    worker_name : callable
        ``worker_name(id) -> str`` (for the timeline).
    generation : int
        Which agent of this process this is (the same on every worker): message ids restart with each agent, so
        the timeline's flow ids include it.
    """

    def __init__(self, info, messenger, handlers: dict, record_error: Callable, num_threads: int, timeline,
                 worker_name: Callable, generation: int = 0):
        from distlab.timeline import now_us

        self.info = info
        self._transmit = messenger.transmit
        self._seat = messenger.seat
        self._record_error = record_error
        self._handlers: dict[int, tuple[Callable, bool]] = handlers
        self._kind_labels: dict[int, str | None] = {}  # timeline labels of registered kinds (a handler's name)
        self._generation = generation
        self._reply_hooks: list[Callable] = []
        self.pool = _Threads(max(1, num_threads), f"distlab-rpc-{info.name}", messenger.seat, messenger.listen)
        self._timeline = timeline
        self._tl_on = timeline.enabled  # checked on the hot path: no timeline cost when disabled
        self._now_us = now_us
        self._worker_name = worker_name
        self.running = True
        #: set by the RRef layer: fork_hook(rref) -> fork data; fork_receiver(forks) -> (resolved, futures)
        self.fork_hook: Callable | None = None
        self.fork_receiver: Callable | None = None
        #: set by the agent: places[mode][dst](device) -> where a device array lands at dst (a reply follows
        #: mode "reply"; see distlab.rpc.devices.Placement.target)
        self.places: dict | None = None

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
    def on_request(self, src, kind, flags, mid, meta, forks, body, buffers, slot, here) -> None:
        """Listening thread: run the request here or hand it to the pool.

        Handlers registered ``inline`` and requests flagged cheap run here, on the seat. Any other request runs
        here too when it came in a message of its own (``here``) and a standby watches the seat: this thread
        leaves the seat, runs it, and comes back (or, if the handler stayed away past the takeover, joins the
        pool); no thread hands it to another. Otherwise it goes to the pool.
        """
        if self._tl_on:
            self.trace_message(False, self.label(kind), src, "rpc", mid)
        fn, inline = self._handlers[kind]  # the listener refused kinds without a handler (Messenger._check_kind)
        if inline or flags & FLAG_INLINE:
            seat = None
        elif here and self.pool.standby:
            seat = self._seat
            seat.leave()
        else:
            self.pool.submit(self._run, fn, src, kind, flags, mid, meta, forks, body, buffers, slot, False)
            return
        try:
            if forks:
                self._run(fn, src, kind, flags, mid, meta, forks, body, buffers, slot, seat)
            else:
                self._execute(fn, src, kind, flags, mid, meta, body, buffers, slot, seat, None)
        except BaseException as exc:  # noqa: BLE001 - answered to the caller
            self._fail(src, kind, flags, mid, slot, exc)
        finally:
            if seat is not None:
                seat.come_back()

    def _run(self, fn, src, kind, flags, mid, meta, forks, body, buffers, slot, seat) -> None:
        """Run a request (``seat``: None on the seat, the seat when away from it, False on the pool)."""
        if forks:
            # its RRefs first (G2: user code sees confirmed RRefs only); a wait goes on in the pool, never here
            self.with_forks(forks, lambda resolved: self._execute(fn, src, kind, flags, mid, meta, body, buffers,
                                                                  slot, seat, resolved),
                            lambda exc: self._fail(src, kind, flags, mid, slot, exc), run_in_pool=seat is not None)
            return
        try:
            self._execute(fn, src, kind, flags, mid, meta, body, buffers, slot, seat, None)
        except BaseException as exc:  # noqa: BLE001 - answered to the caller
            self._fail(src, kind, flags, mid, slot, exc)

    def _execute(self, fn, src, kind, flags, mid, meta, body, buffers, slot, seat, resolved) -> None:
        payload = framing.loads(body, buffers, resolved, checked=True)  # walked by the codec
        previous = _call_local.info
        _call_local.info = info = _new_tuple(CallInfo, (src, kind, mid, meta))  # CallInfo(...), no Python frame
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
        if seat:
            seat.come_back()  # back on the seat before replying: the reply may then wait in the outbox
        if flags & FLAG_NOREPLY:
            return
        if isinstance(result, Future):
            result.add_done_callback(lambda f: self._reply_future(src, mid, flags, f, rmeta, slot))
        else:
            self.reply(src, mid, result, rmeta, slot)

    def _fail(self, src, kind, flags, mid, slot, exc) -> None:
        if not flags & FLAG_NOREPLY:
            self.reply_error(src, mid, flags, exc, slot)
        else:
            self._record_error(f"one-way {kind_name(kind)} from worker {src} failed: {exc!r}")

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
            ref = payload[0]  # framing.function_ref: "module:qualname", (name, bytes), or a callable
            name = (ref.rpartition(":")[2].rpartition(".")[2] if type(ref) is str else ref[0] if type(ref) is tuple
                    else getattr(ref, "__name__", None) or getattr(ref, "name", None))
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
    def _reply_future(self, dst, mid, flags, fut, meta=None, slot=0) -> None:
        exc = fut.exception()
        if exc is not None:
            self.reply_error(dst, mid, flags, exc, slot)
        else:
            self.reply(dst, mid, fut.value(), meta, slot)

    def reply(self, dst, mid, value, meta=None, slot=0) -> None:
        """Send ``value`` back as the response to request ``mid`` of worker ``dst`` (to its reply ``slot``)."""
        if not self.running and dst != self.info.id:
            return
        try:
            body, buffers, forks = (framing.dumps(value, self.fork_hook, self.places["reply"][dst])
                                    if value is not None else _NONE_REPLY)  # None: what dumps returns for it
        except BaseException as exc:  # noqa: BLE001 - an unpicklable result becomes the caller's error
            self.reply_error(dst, mid, 0, exc, slot)
            return
        if self._tl_on:
            self.trace_message(True, "response", dst, "rpc response", mid)
        self._transmit(dst, K_RESPONSE, 0, mid, buffers, meta, forks, body, 0,
                       RPC_TAG_REPLY_BASE + slot if slot else RPC_TAG_HEADER)  # reply_tag(slot)

    def reply_error(self, dst, mid, flags, exc, slot=0) -> None:
        """Send ``exc`` back as the (error) response to request ``mid`` of worker ``dst`` (to its reply ``slot``)."""
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
        self._transmit(dst, K_RESPONSE, FLAG_ERROR, mid, [], None, (), body, 0, reply_tag(slot))

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
