"""The public ``RRef`` and the glue between the RPC agent and the active twin's RRef context.

The protocol itself (ids, fork data, owner and user RRefs, the context with G1 and G2) is twinned:
``distlab.reference.rref`` / ``distlab.core._rref``, chosen by ``distlab._backend.load("rref")``. This module
wires the context to the agent: its control messages become agent requests (answered inline on the listener),
RRefs inside arguments and return values are forked through the framing's fork hook, and the ``remote_call`` /
``rref_fetch`` handlers run user functions into OwnerRRefs and serve ``to_here``.

Deletion is deterministic: dropping the last Python reference to a user's ``RRef`` releases it (CPython
reference counting), and graceful shutdown deletes every remaining UserRRef explicitly.
"""
from __future__ import annotations

import functools
import pickle
import sys
import time

from distlab import _backend
from distlab._wire import RPC_KIND_CODES
from distlab.errors import DistTimeoutError, RpcError, RRefError
from distlab.futures import Future

from . import calls, framing, functions, wrappers
from .agent import current_call
from .calls import K_CALL, copy_seen, get_agent
from .functions import async_execution, is_async_execution

__all__ = ["RRef", "remote", "rref_debug_info", "get_context"]

K_REMOTE = RPC_KIND_CODES["remote_call"]
K_FETCH = RPC_KIND_CODES["rref_fetch"]
K_CONTROL = (RPC_KIND_CODES["user_delete"], RPC_KIND_CODES["fork_request"], RPC_KIND_CODES["child_accept"])
K_FORK_REQUEST = RPC_KIND_CODES["fork_request"]

_ctx = None
_agent = None
_impl_module = None


def get_context():
    """The active RRef context (RpcError when RPC is not running)."""
    if _ctx is None:
        raise RpcError("distlab.rpc is not initialized on this worker (call init_rpc first, or it was shut down)")
    return _ctx


def _gid(key):
    return _impl_module.GloballyUniqueId(key[0], key[1])


class RRef:
    """A reference to a value owned by some worker (``RRef(value)`` makes a local one, owned here).

    Methods mirror ``torch.distributed.rpc.RRef``: :meth:`to_here`, :meth:`local_value`, :meth:`owner`,
    :meth:`owner_name`, :meth:`is_owner`, :meth:`confirmed_by_owner`, :meth:`backward`, and the proxies
    :meth:`rpc_sync`, :meth:`rpc_async`, :meth:`remote` (``rref.rpc_sync().method(*args)`` runs ``method`` on the
    owner).
    """

    __slots__ = ("_r", "_deadline", "_type", "_ctx", "__weakref__")

    def __init__(self, value):
        self._ctx = get_context()
        self._r = self._ctx.create_owner_rref(value)
        self._deadline = None
        self._type = None

    @classmethod
    def _wrap(cls, impl, deadline=None):
        obj = cls.__new__(cls)
        obj._r = impl
        obj._deadline = deadline
        obj._type = None
        obj._ctx = _ctx  # the agent's context it belongs to: an RRef does not outlive its agent
        return obj

    def _live(self):
        """This RRef's protocol object; RRefError when another agent runs than the one it was made by (RPC started
        again, on the survivors of a failure, :func:`distlab.rpc.reinit`): its ids and owner are the old world's."""
        if self._ctx is not _ctx and _ctx is not None:
            raise RRefError(f"{self._r!r} belongs to an RPC agent that has stopped (RPC was started again, on the "
                            "survivors of a failure): an RRef does not outlive its agent; make it again")
        return self._r

    def is_owner(self) -> bool:
        """True on the owner."""
        return self._r.is_owner()

    def owner(self):
        """The owner's WorkerInfo."""
        return get_agent().worker_info(self._live().owner())

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows this reference (always True on the owner)."""
        return self._r.confirmed_by_owner()

    def local_value(self):
        """The value, on the owner only (waits for a ``remote`` still running; raises its error)."""
        if not self._r.is_owner():
            raise RRefError(f"local_value() can only be called on the owner; {self._r!r} is owned by worker "
                            f"{self._r.owner()}")
        return self._r.get_value(None)

    def to_here(self, timeout=None):
        """Copy the value here (blocking, bounded by ``timeout`` seconds, default the RPC timeout). Under fault
        tolerance, an owner that died makes it raise :class:`~distlab.errors.ProcessFailedError` naming it."""
        r = self._live()
        if r.is_owner():
            return r.get_value(timeout)
        if not r.confirmed_by_owner() and self._deadline is not None and time.monotonic() > self._deadline:
            r.timed_out = True
        r.check_usable("to_here()")
        # a call wrapper (distributed autograd inside a context) turns the fetch into a call of local_value
        # carrying its metadata (torch: to_here records a send function on the owner, a recv function here)
        wrapped = wrappers.wrap_for(get_agent(), r.owner(), RRef.local_value, (self,), None)
        if wrapped:
            func, args, kwargs, unwrap = wrapped
            return unwrap(get_agent().call_sync(r.owner(), K_CALL, framing.call_payload(func, args, kwargs),
                                                timeout=timeout))
        return get_agent().call_sync(r.owner(), K_FETCH, r.rref_id.key(), timeout=timeout, inline=True)

    def rpc_sync(self, timeout=None):
        """Proxy: ``rref.rpc_sync().m(*a)`` is ``rpc_sync(owner, lambda: value.m(*a))``.

        As in PyTorch, ``m`` must be an attribute of the value's type (fetched from the owner at the first proxy
        call, then kept): otherwise the call raises AttributeError at once, here. Types that define
        ``__getattr__`` are not checked. A method decorated with
        :func:`~distlab.rpc.functions.async_execution` answers when the Future it returns completes.
        """
        return _Proxy(self, calls.rpc_sync, timeout)

    def rpc_async(self, timeout=None):
        """Proxy like :meth:`rpc_sync` returning Futures (the AttributeError is raised at the call too)."""
        return _Proxy(self, calls.rpc_async, timeout)

    def remote(self, timeout=None):
        """Proxy like :meth:`rpc_sync` returning RRefs."""
        return _Proxy(self, remote, timeout)

    def backward(self, dist_autograd_ctx_id=-1, retain_graph=False):
        """Run backward from the value, a scalar :class:`~distlab.autograd.Tensor` (mirrors ``PyRRef::backward``).

        With ``dist_autograd_ctx_id=-1`` (the default) it is a local backward, allowed on the owner only (the
        gradients land in ``.grad``). With a distributed autograd context id it is
        ``distributed_autograd.backward(dist_autograd_ctx_id, [value], retain_graph)`` run on the owner, whichever
        worker calls it (the gradients land in that context). A user RRef needs the context id (RRefError).
        """
        r = self._r
        if r.is_owner():
            _backward_from(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RRefError(f"User RRefs require 'dist_autograd_ctx_id' to be specified: {r!r} is owned by worker "
                            f"{self.owner_name()!r}, where backward runs within a distributed autograd context")
        r.check_usable("backward()")
        # A call of the RRef layer, not of the user: not wrapped by distributed autograd (torch: RRefBackwardReq).
        get_agent().call_sync(r.owner(), K_CALL, framing.call_payload(
            _backward_on_owner, (self, dist_autograd_ctx_id, retain_graph), None))

    def _get_type(self, timeout=None):
        """The type of the value: ``type(local_value())`` on the owner, else asked of the owner once and kept
        (mirrors torch's ``RRef._get_type``; what the proxies check method names against)."""
        if self._type is None:
            r = self._live()
            if r.is_owner():
                self._type = type(self.local_value())
            else:
                r.check_usable("a proxy (rpc_sync(), rpc_async(), remote())")
                self._type = get_agent().call_sync(r.owner(), K_CALL, framing.call_payload(
                    _value_type, (self,), None), timeout=timeout)
        return self._type

    def __reduce__(self):
        hook = framing.fork_hook()
        if hook is None:
            raise pickle.PicklingError("an RRef can only be pickled by distlab.rpc while it is being sent")
        return framing.rref_reduce(hook(self._r))

    def __del__(self):
        r = getattr(self, "_r", None)
        ctx = _ctx
        if r is not None and ctx is not None and ctx is getattr(self, "_ctx", None) and not r.is_owner():
            try:
                ctx.release_user(r)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    def __repr__(self):
        return repr(self._r)


class _Proxy:
    __slots__ = ("_rref", "_fn", "_timeout")

    def __init__(self, rref, fn, timeout):
        self._rref, self._fn, self._timeout = rref, fn, timeout

    def __getattr__(self, name):
        return functools.partial(_invoke_rpc, self._rref, self._fn, name, self._timeout)


def _invoke_rpc(rref, rpc_api, name, timeout, *args, **kwargs):
    """A proxy call (mirrors rref_proxy.py ``_invoke_rpc``): check the method on the value's type, here and now,
    then run it on the owner through ``rpc_api`` (rpc_sync, rpc_async or remote)."""
    value_type = rref._get_type(timeout)
    method = getattr(value_type, name, _MISSING)
    if method is _MISSING:
        if not hasattr(value_type, "__getattr__"):
            raise AttributeError(f"{value_type.__qualname__!r} object has no attribute {name!r} (the value of {rref!r}, "
                                 f"owned by worker {rref.owner_name()!r}, called through an RRef proxy)")
        method = None
    invoke = _invoke_method_async if is_async_execution(method) else _invoke_method
    return rpc_api(rref._live().owner(), invoke, (rref, name, args, kwargs), timeout=timeout)


_MISSING = object()


def _invoke_method(rref, name, args, kwargs):
    return getattr(rref.local_value(), name)(*args, **kwargs)


@async_execution
def _invoke_method_async(rref, name, args, kwargs):
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _value_type(rref):
    return type(rref.local_value())


def _backward_on_owner(rref, context_id, retain_graph):
    _backward_from(rref.local_value(), context_id, retain_graph)


def _backward_from(value, context_id, retain_graph):
    from distlab.autograd import Tensor

    if not isinstance(value, Tensor):
        raise TypeError(f"RRef should contain a tensor for .backward(), it holds a {type(value).__name__}")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        # A context id comes from distlab.distributed_autograd, which imports rpc (never the reverse): when it
        # is not loaded here, no context can exist on this worker.
        distributed_autograd = sys.modules.get("distlab.distributed_autograd")
        if distributed_autograd is None:
            raise RuntimeError(f"RRef.backward: no distributed autograd context {context_id} on this worker "
                               "(distlab.distributed_autograd is not in use here)")
        distributed_autograd.backward(context_id, [value], retain_graph=retain_graph)


# -- agent glue ---------------------------------------------------------------------------------------------------
def _fork_receiver(forks):
    resolved = [None] * len(forks)
    waits = []
    for i, data in enumerate(forks):
        r, fut = _ctx.receive_fork(tuple(data))
        if r is not None:
            resolved[i] = RRef._wrap(r)
            if fut is not None:
                waits.append(fut)
        elif fut.done():
            resolved[i] = RRef._wrap(fut.value())
        else:
            waits.append(fut.then(lambda f, i=i: resolved.__setitem__(i, RRef._wrap(f.value()))))
    return resolved, waits


def _handle_remote(src, payload, meta):
    rid, fid, func, args, kwargs = payload
    owner = _ctx.handle_remote_call(_gid(rid), _gid(fid))
    try:
        func = framing.resolve_ref(func)
        value = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(value, Future) or is_async_execution(func):  # @async_execution: the value comes later
            functions.check_result(func, value, Future).add_done_callback(lambda f: _set_owner_value(owner, f))
            return None
    except BaseException as exc:  # noqa: BLE001 - the error is the RRef's value (to_here re-raises it remotely)
        owner.set_error(exc)
        return None
    owner.set_value(value)
    return None


def _set_owner_value(owner, fut) -> None:
    exc = fut.exception()
    if exc is not None:
        owner.set_error(exc)
    else:
        owner.set_value(fut.value())


def _handle_fetch(src, payload, meta):
    owner_fut = _ctx.get_owner_rref(_gid(payload))
    if owner_fut.done():  # fast path: the OwnerRRef exists and holds its value (or error)
        value_fut = owner_fut.value().get_future()
        if value_fut.done():
            return value_fut.value()
    result = Future(description=f"to_here of {payload}")

    def with_owner(f):
        exc = f.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        f.value().get_future().add_done_callback(
            lambda v: result.set_exception(v.exception()) if v.exception() is not None
            else result.set_result(v.value()))

    owner_fut.add_done_callback(with_owner)
    return result


def _handle_control(src, payload, meta):
    return _ctx.handle(src, current_call().kind, payload)


def attach(agent) -> None:
    """Create this worker's RRef context (active twin) and register the RRef handlers on ``agent``."""
    global _ctx, _agent, _impl_module
    _impl_module = _backend.load("rref")
    _agent = agent

    def send(dst, kind, payload):
        # MPI delivers every message exactly once, so only the fork request, whose acknowledgement drives the
        # protocol (finish_fork_request), waits for one; deletion notices and child accepts are one-way here.
        # The context still retries any control message whose acknowledgement fails (the in-process
        # reordering transport of the tests loses and duplicates them).
        return agent.send(dst, kind, payload, inline=True, noreply=kind != K_FORK_REQUEST)

    _ctx = _impl_module.RRefContext(agent.rank, send)
    agent.fork_hook = _ctx.prepare_child_fork
    agent.fork_receiver = _fork_receiver
    agent.register_handler(K_REMOTE, _handle_remote, _internal=True)
    agent.register_handler(K_FETCH, _handle_fetch, inline=True, _internal=True)
    for kind in K_CONTROL:
        agent.register_handler(kind, _handle_control, inline=True, _internal=True)


def remote(to, func, args=(), kwargs=None, timeout=None):
    """Run ``func(*args, **kwargs)`` on worker ``to``; return an RRef to the result at once.

    If the owner has not acknowledged the creation within ``timeout`` seconds (default the RPC timeout),
    ``to_here`` raises RRefCreationTimeoutError. A registered call wrapper (:mod:`distlab.rpc.wrappers`) may
    rewrite the call first.
    """
    agent = get_agent()
    wrapped = wrappers.registered and wrappers.wrap_for(agent, to, func, args, kwargs, remote=True)
    if wrapped:
        func, args, kwargs, _unwrap = wrapped
    ctx = _ctx
    dst = to if type(to) is int and 0 <= to < agent.size else agent.worker_info(to).id
    func_v, args, kwargs = framing.call_payload(func, args, kwargs)
    fresh = False
    if type(func_v) is tuple:  # a __main__ function: its by-value copy goes to each worker once
        func_v, fresh = framing.main_ref(func_v, agent.copies_seen[dst])
    r, rid, fid = ctx.create_remote(dst)
    timeout = agent.rpc_timeout if timeout is None else timeout
    rref = RRef._wrap(r, time.monotonic() + timeout if timeout and timeout > 0 else None)
    try:
        fut = agent.send(dst, K_REMOTE, (rid.key(), fid.key(), func_v, args, kwargs), timeout=0,
                         inline=getattr(func, "__distlab_rpc_cheap__", False))
    except BaseException as exc:
        _remote_done(ctx, r, rid, exc)
        raise
    fut.add_done_callback(lambda f: _remote_done(ctx, r, rid, f.exception()))
    if fresh:
        fut.add_done_callback(copy_seen(agent, dst, func_v[2]))
    return rref


def _remote_done(ctx, r, rid, exc):
    if not r.is_owner():
        ctx.finish_remote(r, exc)
    elif exc is not None:
        ctx.del_fork_of_owner(rid, rid)
        if not r.has_value():
            r.set_error(exc)


def rref_debug_info() -> dict:
    """Counts of the RRef context: owner RRefs, pending futures, pending users, forks, pending children..."""
    return get_context().debug_info()


def _wait_for(ctx, predicate, timeout, what):
    # Polled with back-off (shutdown only): the contexts keep no condition variable, so the protocol's hot
    # paths pay for no notification.
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not predicate():
        if time.monotonic() > deadline:
            raise DistTimeoutError(f"rpc shutdown on worker {_agent.info.name!r}: {what} after {timeout:g} s; "
                                   f"state {ctx.debug_info()}", op="rpc shutdown", timeout=timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def graceful_delete(agent, timeout: float) -> None:
    """Graceful shutdown, RRef part: wait for pending users and children, delete every confirmed UserRRef,
    drop never-forked owners, wait until no owner remains (mirrors delAllUsersAndUnforkedOwners)."""
    ctx = _ctx
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 1e-3)
        _wait_for(ctx, lambda: not ctx.has_pending(), left, "UserRRefs still await their owners' confirmation")
        ctx.delete_all_users()
        ctx.drop_unforked_owners()
        left = max(deadline - time.monotonic(), 1e-3)
        _wait_for(ctx, lambda: ctx.idle() or ctx.has_pending() or ctx.debug_info()["num_confirmed_users"], left,
                  "OwnerRRefs are still referenced by other workers")
        if ctx.idle():
            return


def detach(agent, check_leaks=True):
    """Forget the context; return its leak error (or None)."""
    global _ctx, _agent
    ctx = _ctx
    _ctx = None
    _agent = None
    if ctx is None or not check_leaks:
        return None
    return ctx.check_leaks()
