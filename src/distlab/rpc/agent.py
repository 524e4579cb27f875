"""The RPC agent: one per process, made by :func:`distlab.rpc.init_rpc` (shared plumbing, not twinned).

It puts together the pieces, one job per module:

- :mod:`distlab.rpc.workers`: names and ids (:class:`WorkerInfo`), the thread-level check;
- :mod:`distlab.rpc.messenger`: MPI sends, the listener's loop (batching);
- :mod:`distlab.rpc.replies`: the replies a blocking caller receives on its own thread (reply slots);
- :mod:`distlab.rpc.dispatch`: handlers by message kind, the agent's threads, replies and remote errors;
- :mod:`distlab.rpc.deadlines`: the timeout thread;
- :mod:`distlab.rpc.framing`: the bytes of a message.

and keeps what belongs to the caller's side: the requests in flight, matched to their responses by message id.
A blocking call (:meth:`RpcAgent.call_sync`) receives its reply on its own thread, on that thread's reply slot;
an asynchronous one (:meth:`RpcAgent.send`) is answered to the listener, which completes its future.

Extension points (for distributed autograd and others): ``send(dst, kind, payload, meta=...)`` attaches any
picklable metadata to a request; ``register_handler(kind, fn, inline=False)`` adds message kinds
(``kind >= distlab._wire.RPC_USER_KIND_BASE``); handlers read the request's metadata through
:func:`current_call`; ``add_send_hook`` / ``add_reply_hook`` / ``add_response_hook`` attach and read metadata on
every request and response (rpc_sync, rpc_async and remote included) without changing the callers.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from typing import Callable

from distlab.errors import DistTimeoutError, ProcessFailedError, RpcError, RpcMessageError
from distlab.futures import Future, default_timeout

from . import framing
from .deadlines import DeadlineWatcher
from .devices import Placement
from .dispatch import CallInfo, Dispatcher, current_call
from .framing import FLAG_ERROR, FLAG_INLINE, FLAG_NOREPLY
from .messenger import CORK_AFTER, K_BATCH, K_RESPONSE, K_STOP, K_WAKE, TAG_BUFFER, TAG_HEADER, Messenger
from .replies import ReplySlots
from .workers import WorkerInfo, WorkerRegistry, check_name, check_thread_level

__all__ = ["WorkerInfo", "CallInfo", "RpcAgent", "current_call", "check_thread_level", "TAG_HEADER", "TAG_BUFFER"]

log = logging.getLogger("distlab.rpc")

_GENERATIONS = itertools.count()  # agents started in this process: message ids restart with each

_SENT = Future(description="a one-way rpc request")  # what send(noreply=True) returns: completed, shared
_SENT.set_result(None)

#: The longest the listener waits for a message's out-of-band buffers (seconds; less when rpc_timeout is less).
BUFFER_TIMEOUT_MAX = 30.0


class RpcAgent:
    """Threads that take turns at listening and running requests, and the requests in flight, over a dedicated
    communicator.

    Parameters
    ----------
    name : str
        This worker's name (unique across the world).
    comm : mpi4py.MPI.Intracomm
        The communicator the agent owns (a ``Dup`` of COMM_WORLD made by ``init_rpc``); freed at shutdown.
    rpc_timeout : float
        Default timeout of requests, in seconds.
    num_threads : int
        Threads running requests that are not marked cheap (besides the thread that listens).
    names : list of str, optional
        Every worker's name by id, when already known (``init_rpc`` learns them while it makes ``comm``);
        otherwise gathered over ``comm``.
    placement : distlab.rpc.devices.Placement, optional
        Where device arrays sent to each worker land (the device maps ``init_rpc`` checked); None: no device
        maps, so device arrays are refused.
    device_count : int, optional
        The devices this worker sees (device arrays received for another are refused).
    """

    def __init__(self, name: str, comm, rpc_timeout: float = 60.0, num_threads: int = 4, names=None,
                 placement=None, device_count=None):
        from distlab.timeline import get_timeline, now_us

        check_thread_level()
        check_name(name)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.rpc_timeout = float(rpc_timeout)
        self._registry = WorkerRegistry(comm.allgather(name) if names is None else names, self.rank)
        self.workers = self._registry.workers
        self.info = self._registry.info
        self._pending: dict[int, tuple] = {}  # mid -> (future, dst, kind, start_us)
        self._mids = itertools.count(1)
        self._send_hooks: list[Callable] = []
        self._response_hooks: list[Callable] = []
        self.errors: list[str] = []
        self._timeline = get_timeline()
        self._tl_on = self._timeline.enabled  # checked on the hot path: no timeline cost when disabled
        self._now_us = now_us
        # The listener waits at most this long for a message's buffers after its header (they are sent right
        # after it, so only a broken or stalled sender makes it wait at all).
        buffer_timeout = min(self.rpc_timeout or default_timeout(), BUFFER_TIMEOUT_MAX)
        handlers: dict = {}  # request kind -> (handler, inline): filled by register_handler, read by the messenger
        self._messenger = Messenger(comm, name, handlers, self._record_error, self._on_malformed, buffer_timeout)
        self._seat = self._messenger.seat
        self._listener = self._messenger.listener
        self._dispatch = Dispatcher(self.info, self._messenger, handlers, self._record_error, num_threads,
                                    self._timeline, self._registry.name_of, next(_GENERATIONS))
        self._messenger.attach(self._dispatch.on_request, self._on_response)
        self._messenger.on_failure = self._on_failure
        self._replies = ReplySlots(self._messenger, self._record_error)
        self._watcher = DeadlineWatcher(name, self._pending.__contains__, self._expire_mid)
        self._messenger.device_count = device_count
        if placement is None:  # no device maps: device arrays are refused, saying what to set
            placement = Placement(self.info.name, [w.name for w in self.workers], {}, {})
        self.placement = placement
        self._places = {mode: [functools.partial(placement.target, dst, mode) for dst in range(self.size)]
                        for mode in ("request", "reply", "either")}
        self._descriptions: dict[tuple, str] = {}
        #: per worker, the digests of the ``__main__`` functions' by-value copies it answered a call with: calls to it
        #: name those functions without their copy (framing.main_ref); forgotten at an error response from it
        self.copies_seen: list[set] = [set() for _ in range(self.size)]
        self._dispatch.places = self._places
        #: how the agent's threads wait for messages: "libmpi" (the core twin calls MPI_Improbe itself, GIL
        #: released) or "mpi4py (...)", saying why (see distlab.reference.rpc_wait)
        self.wait_path = self._messenger.path
        self.running = True

    def start(self) -> None:
        """Start the agent's threads and the timeout watcher. Register the handlers first: a peer may already
        have sent requests (MPI holds them until the listener receives them)."""
        self._dispatch.pool.start()
        self._watcher.start()

    @property
    def _idle(self) -> bool:
        """The listener sleeps between polls (no traffic for a while)."""
        return self._messenger.listener.idle

    # The RRef layer's hooks into the framing (set by distlab.rpc.rref when it attaches).
    @property
    def fork_hook(self):
        return self._dispatch.fork_hook

    @fork_hook.setter
    def fork_hook(self, fn):
        self._dispatch.fork_hook = fn

    @property
    def fork_receiver(self):
        return self._dispatch.fork_receiver

    @fork_receiver.setter
    def fork_receiver(self, fn):
        self._dispatch.fork_receiver = fn

    # -- registry ---------------------------------------------------------------------------------------------
    def register_handler(self, kind: int, fn: Callable, *, inline: bool = False, _internal: bool = False) -> None:
        """Handle requests of ``kind`` with ``fn(src, payload, meta) -> result or Future``.

        ``inline=True`` runs ``fn`` on the listener thread (only for handlers that never block). Kinds below
        ``RPC_USER_KIND_BASE`` are reserved for distlab.rpc.
        """
        self._dispatch.register_handler(kind, fn, inline, _internal)

    def add_send_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``meta = fn(dst, kind, meta)`` for every request this worker sends (calls, remotes, RRef control
        messages, registered kinds), e.g. to attach a distributed-autograd context id. Returns a remover."""
        self._send_hooks.append(fn)
        return lambda: self._send_hooks.remove(fn)

    def add_reply_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``meta = fn(call_info, meta)`` in the handler's thread right after a handler returned, to attach
        metadata to its response (``call_info`` is :func:`current_call`'s value). Returns a remover."""
        return self._dispatch.add_reply_hook(fn)

    def add_response_hook(self, fn: Callable) -> Callable[[], None]:
        """Call ``fn(src, mid, kind, meta)`` on the listener thread when a response carrying metadata arrives,
        before its future is completed. Returns a remover."""
        self._response_hooks.append(fn)
        return lambda: self._response_hooks.remove(fn)

    def worker_info(self, to=None) -> WorkerInfo:
        """Resolve a worker name, id or WorkerInfo (None: this worker)."""
        return self._registry.resolve(to)

    # -- sending ----------------------------------------------------------------------------------------------
    def _encode(self, dst, kind, payload, meta, device_map):
        """A request's parts: ``(dst as an id, meta after the send hooks, body, buffers, forks, a new mid)``."""
        if not self.running:
            raise RpcError("the RPC agent is not running (call distlab.rpc.init_rpc first, or it was shut down)")
        if type(dst) is not int or not 0 <= dst < self.size:
            dst = self._registry.id_of(dst)
        for hook in self._send_hooks:
            meta = hook(dst, kind, meta)
        body, buffers, forks = framing.dumps(payload, self._dispatch.fork_hook, self._places[device_map][dst])
        return dst, meta, body, buffers, forks, next(self._mids)

    def send(self, dst, kind: int, payload, *, meta=None, timeout: float | None = None, inline: bool = False,
             noreply: bool = False, _track_timeout: bool = True, device_map: str = "request") -> Future:
        """Send a request; return a Future completed with the handler's result (or a RemoteError).

        ``timeout`` (default ``rpc_timeout``; 0 or None-like negative means none) fails the future with
        DistTimeoutError. ``noreply`` sends a one-way message and returns a completed future. ``device_map``: the
        map device arrays in ``payload`` follow: ``"request"`` this worker's own map to ``dst`` (a call),
        ``"reply"`` the inverse of ``dst``'s map to this worker, ``"either"`` the own map if set, else the
        inverse (see :class:`distlab.rpc.devices.Placement`).
        """
        dst, meta, body, buffers, forks, mid = self._encode(dst, kind, payload, meta, device_map)
        flags = (FLAG_INLINE if inline else 0) | (FLAG_NOREPLY if noreply else 0)
        if noreply:
            fut = _SENT  # nothing to wait for: one completed future serves every one-way request
        else:
            words = self._descriptions.get((kind, dst))
            if words is None:  # ("rpc call #", " to w1"): made once per kind and destination
                words = self._descriptions[(kind, dst)] = (f"rpc {self._dispatch.label(kind)} #",
                                                           f" to {self.workers[dst].name}")
            fut = Future(description=f"{words[0]}{mid}{words[1]}")
            self._pending[mid] = (fut, dst, kind, self._now_us() if self._tl_on else 0.0)
            timeout = self.rpc_timeout if timeout is None else timeout
            if _track_timeout and timeout and timeout > 0:
                self._watcher.add(time.monotonic() + timeout, mid, timeout)
        if self._tl_on:
            self._dispatch.trace_message(True, self._dispatch.label(kind, payload), dst, "rpc", mid)
        try:
            if dst in self._messenger.failed:
                raise self._messenger.failed[dst]
            self._messenger.transmit(dst, kind, flags, mid, buffers, meta, forks, body,
                                     cork=len(self._pending) > CORK_AFTER)
        except BaseException as exc:
            self._pending.pop(mid, None)
            failure = self._failure_of(exc, dst)
            if failure is None:
                raise
            if noreply:
                raise self._failed_error(mid, dst, kind, failure) from None
            fut.set_exception(self._failed_error(mid, dst, kind, failure))
        if not noreply:
            self._listener.touch()  # its answer comes to the listener: it polls for it
        return fut

    def call_sync(self, dst, kind: int, payload, *, meta=None, timeout: float | None = None, inline=False):
        """Send a request and wait for its result, bounded by ``timeout`` (default ``rpc_timeout``; 0: none).

        The reply comes to this thread's reply slot and this thread receives it: no other thread wakes up for it,
        and nothing is handed between threads. When every slot is taken, the reply comes through the listener.
        """
        if timeout is None:
            timeout = self.rpc_timeout
        if self._seat.listening():
            raise RpcError(
                "a blocking RPC (rpc_sync, to_here) was called on the listener thread of worker "
                f"{self.info.name!r}: functions marked cheap run there and must not wait for other workers "
                "(the worker would listen to nobody meanwhile); drop @cheap or use rpc_async")
        slot = self._replies.slot()  # this thread's, made at its first call
        if slot is None:
            return self._call_through_listener(dst, kind, payload, meta, timeout, inline)
        dst, meta, body, buffers, forks, mid = self._encode(dst, kind, payload, meta, "request")
        start = self._now_us() if self._tl_on else 0.0
        self._pending[mid] = (None, dst, kind, start)  # answered on this thread (wait_idle counts it)
        try:
            if self._tl_on:
                self._dispatch.trace_message(True, self._dispatch.label(kind, payload), dst, "rpc", mid)
            if dst in self._messenger.failed:
                raise self._messenger.failed[dst]
            self._messenger.transmit(dst, kind, FLAG_INLINE if inline else 0, mid, buffers, meta, forks, body,
                                     slot.number)
            deadline = time.monotonic() + timeout if timeout and timeout > 0 else math.inf
            reply = self._replies.await_reply(slot, dst, mid, deadline)
        except RpcMessageError:
            raise
        except Exception as exc:
            failure = self._failure_of(exc, dst)
            if failure is None:
                if isinstance(exc, RpcError) and not self.running:
                    raise self._shut_down(mid, dst, kind) from None
                raise
            raise self._failed_error(mid, dst, kind, failure) from None
        finally:
            self._pending.pop(mid, None)
        if reply is None:
            raise self._timeout_error(mid, dst, kind, timeout)
        flags, rmeta, rforks, rbody, rbuffers = reply
        if rmeta is not None or self._tl_on:
            self._answered(dst, mid, kind, start, flags, rmeta)
        if flags & FLAG_ERROR:
            self.copies_seen[dst].clear()   # perhaps a restarted worker: the next calls carry the copies again
            raise self._dispatch.remote_error(rbody)
        if not rforks:
            if rbody == framing.NONE_BODY:
                return None  # the commonest answer: no unpickler
            return framing.loads(rbody, rbuffers, None, checked=True)  # walked by the codec
        fut = Future(description=f"RRefs in the response to rpc {self._dispatch.label(kind)} #{mid}")
        self._dispatch.with_forks(rforks, lambda resolved: fut.set_result(
            framing.loads(rbody, rbuffers, resolved, checked=True)), fut.set_exception, run_in_pool=False)
        return fut.wait(timeout if timeout and timeout > 0 else None)

    def _call_through_listener(self, dst, kind, payload, meta, timeout, inline):
        """``call_sync`` with the reply through the listener (this thread found no free reply slot)."""
        fut = self.send(dst, kind, payload, meta=meta, inline=inline, _track_timeout=False)
        try:
            return fut.wait(timeout if timeout and timeout > 0 else 1e9)
        except DistTimeoutError:
            if fut.done():
                return fut.value()
            self._expire(fut, timeout)
            return fut.value()

    # -- receiving (listener thread) --------------------------------------------------------------------------
    def _answered(self, src, mid, kind, start, flags, meta) -> None:
        """A response arrived: its metadata to the response hooks, and its span on the timeline."""
        if meta is not None:
            for hook in self._response_hooks:
                hook(src, mid, kind, meta)
        if self._tl_on:
            self._dispatch.trace_message(False, "response", src, "rpc response", mid)
            self._timeline.complete(f"rpc {self._dispatch.label(kind)} -> {self.workers[src].name}", start,
                                    self._now_us(), lane="rpc", args={"mid": mid, "error": bool(flags & FLAG_ERROR)})

    def _on_response(self, src, flags, mid, forks, body, buffers, meta=None) -> None:
        entry = self._pending.pop(mid, None)
        if entry is None or entry[0] is None:
            return  # the request timed out (or was failed at shutdown): drop its late response
        fut = entry[0]
        if meta is not None or self._tl_on:
            self._answered(src, mid, entry[2], entry[3], flags, meta)
        if flags & FLAG_ERROR:
            self.copies_seen[src].clear()   # as in call_sync
            fut.set_exception(self._dispatch.remote_error(body))
            return
        if not forks:  # no RRef to receive first: complete it here (with_forks' path, without its frames)
            try:
                value = None if body == framing.NONE_BODY else framing.loads(body, buffers, None, checked=True)
            except BaseException as exc:  # noqa: BLE001 - the caller gets the error
                fut.set_exception(exc)
            else:
                fut.set_result(value)
            return
        self._dispatch.with_forks(  # the body was walked by the codec (framing.unpack_header)
            forks, lambda resolved: fut.set_result(framing.loads(body, buffers, resolved, checked=True)),
            fut.set_exception, run_in_pool=False)

    def _on_malformed(self, src, exc, slot=0) -> None:
        """A message from ``src`` was refused: log it, and fail whoever waits for it. A malformed response fails
        the request it answers here; a malformed request is answered with the error (to its reply ``slot``), so
        its sender learns why instead of waiting for its timeout."""
        self._record_error(f"refused a message from worker {src}: {exc}")
        if exc.mid is None or exc.kind in (K_STOP, K_WAKE, K_BATCH):
            return
        if exc.kind == K_RESPONSE:
            entry = self._pending.get(exc.mid)
            if entry is not None and entry[0] is not None:
                self._pending.pop(exc.mid, None)
                entry[0].set_exception(exc)
        elif not exc.flags & FLAG_NOREPLY:
            self._dispatch.reply_error(src, exc.mid, exc.flags, exc, slot)

    def _record_error(self, text: str) -> None:
        log.error("distlab.rpc worker %s: %s", self.info.name, text)
        self.errors.append(text)

    # -- failed workers (fault tolerance) ----------------------------------------------------------------------
    def _on_failure(self, exc: ProcessFailedError) -> None:
        """Workers died (:meth:`Messenger.peers_failed`): every request in flight to them fails with a
        ProcessFailedError naming them, and the threads awaiting their replies are woken to raise it."""
        failed = self._messenger.failed
        for mid, (fut, dst, kind, _start) in list(self._pending.items()):
            if fut is not None and dst in failed and self._pending.pop(mid, None) is not None:
                try:
                    fut.set_exception(self._failed_error(mid, dst, kind, failed[dst]))
                except RuntimeError:
                    pass  # completed concurrently
        self._replies.wake()

    def _failure_of(self, exc: BaseException, dst: int):
        """The ProcessFailedError behind ``exc`` (MPI's report of a dead ``dst``, translated), or None."""
        if isinstance(exc, ProcessFailedError):
            return exc
        from distlab.comm import ulfm

        failure = ulfm.process_failure(exc, self.comm, "rpc send", self.comm.Get_name() or "rpc")
        if failure is not None and dst not in self._messenger.failed:
            self._messenger.peers_failed(failure)
        return failure

    def _failed_error(self, mid, dst, kind, cause: ProcessFailedError) -> ProcessFailedError:
        label = self._dispatch.label(kind)
        return self._died(f"rpc {label} #{mid} from worker {self.info.name!r} to worker {self.workers[dst].name!r} "
                          "failed", f"rpc {label}", cause)

    def _died(self, what: str, op: str, cause: ProcessFailedError) -> ProcessFailedError:
        world = f" (world ranks {cause.failed_ranks})" if cause.failed_ranks else ""
        return ProcessFailedError(
            f"{what}: workers {[self.workers[w].name for w in cause.group_ranks]}{world} have died. Start RPC again "
            "on the survivors (distlab.rpc.reinit after distlab.comm.recovery.rebuild; elastic.run does both).",
            failed_ranks=cause.failed_ranks, group_ranks=cause.group_ranks, group=cause.group, op=op,
            revoked=cause.revoked, error_class=cause.error_class)

    # -- timeouts ---------------------------------------------------------------------------------------------
    def _expire_mid(self, mid, timeout) -> None:
        entry = self._pending.get(mid)
        if entry is not None:
            self._expire(entry[0], timeout, mid)

    def _expire(self, fut, timeout, mid=None) -> None:
        if mid is None:
            for key, entry in list(self._pending.items()):
                if entry[0] is fut:
                    mid = key
                    break
        entry = self._pending.pop(mid, None) if mid is not None else None
        if entry is None:
            return
        try:
            fut.set_exception(self._timeout_error(mid, entry[1], entry[2], timeout))
        except RuntimeError:
            pass  # completed concurrently

    def _timeout_error(self, mid, dst, kind, timeout) -> DistTimeoutError:
        return DistTimeoutError(
            f"rpc {self._dispatch.label(kind)} #{mid} from worker {self.info.name!r} to worker "
            f"{self.workers[dst].name!r} got no response within {timeout:g} s",
            op=f"rpc {self._dispatch.label(kind)}", timeout=timeout, missing_ranks=[dst])

    def _shut_down(self, mid, dst, kind) -> RpcError:
        return RpcError(f"rpc {self._dispatch.label(kind)} #{mid} to worker {self.workers[dst].name!r}: the RPC "
                        "agent was shut down before the response arrived")

    # -- shutdown ---------------------------------------------------------------------------------------------
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
        """A non-blocking barrier on the agent's communicator, polled with back-off, bounded by ``timeout``. A dead
        worker fails it: the survivors meet without it (``MPI_Comm_agree``), then raise ProcessFailedError."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        try:
            request = self.comm.Ibarrier()
            while not request.Test():
                if time.monotonic() > deadline:
                    raise DistTimeoutError(
                        f"rpc shutdown on worker {self.info.name!r}: not every worker reached shutdown within "
                        f"{timeout:g} s (workers: {[w.name for w in self.workers]})",
                        op="rpc shutdown barrier", timeout=timeout)
                time.sleep(delay)
                delay = min(delay * 2, 0.005)
        except Exception as exc:
            from distlab.comm import ulfm

            cause = ulfm.process_failure(exc, self.comm, "rpc shutdown", self.comm.Get_name() or "rpc")
            if cause is None:  # not MPI's report of a death (a timeout, another error)
                raise
            ulfm.agree(self.comm, timeout=max(deadline - time.monotonic(), 0.0), group=cause.group)
            raise self._died(f"rpc shutdown on worker {self.info.name!r} cannot end gracefully (RPC is stopped on "
                             "every survivor)", "rpc shutdown", cause) from exc

    def stop(self, graceful: bool = True, timeout: float = 60.0) -> None:
        """Stop listening and the threads; fail unanswered requests. ``graceful`` frees the communicator and
        lets the threads finish the requests they run."""
        if not self.running:
            return
        self.running = False
        self._dispatch.running = False
        self._watcher.stop()
        self._dispatch.pool.running = False  # no thread takes the seat again
        self._messenger.stop()  # the listener and every thread awaiting its reply return
        self._replies.stop()
        stopped = self._messenger.wait_listeners(timeout)
        if not stopped:
            self._record_error("the listener thread did not stop within the timeout")
        for mid, (fut, dst, kind, _start) in list(self._pending.items()):
            if fut is None:
                continue  # a blocking call: its thread raises on its own
            self._pending.pop(mid, None)
            try:
                fut.set_exception(self._shut_down(mid, dst, kind))
            except RuntimeError:
                pass
        self._dispatch.pool.shutdown(wait=graceful, timeout=timeout)
        left = self._messenger.complete_sends(timeout)
        if left:
            self._record_error(f"{left} sends did not complete at shutdown")
        if graceful and stopped:
            self.comm.Free()
