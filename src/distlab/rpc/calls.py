"""The worker's running agent and the calls made through it: ``get_agent``, ``rpc_sync``, ``rpc_async``, ``cheap``.

Below both :mod:`distlab.rpc.api` (which starts and stops the agent: ``init_rpc``, ``shutdown``) and
:mod:`distlab.rpc.rref` (the RRef layer, whose proxies and fetches call through the agent): both import this
module, and it imports neither, so every call goes one way (api -> rref -> calls -> agent).
"""
from __future__ import annotations

from distlab._wire import RPC_KIND_CODES
from distlab.errors import RpcError
from distlab.futures import Future

from . import wrappers
from .agent import RpcAgent
from .framing import call_payload, main_ref

__all__ = ["get_agent", "is_initialized", "current_agent", "set_agent", "cheap", "rpc_sync", "rpc_async", "K_CALL",
           "copy_seen"]

K_CALL = RPC_KIND_CODES["call"]

_agent: RpcAgent | None = None


def current_agent() -> RpcAgent | None:
    """The agent ``init_rpc`` started on this worker (None before it; perhaps stopped)."""
    return _agent


def set_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` this worker's agent (``init_rpc``), or forget it (None: ``shutdown``)."""
    global _agent
    _agent = agent


def get_agent() -> RpcAgent:
    """The running agent; RpcError if ``init_rpc`` was not called or ``shutdown`` was."""
    agent = _agent
    if agent is None or not agent.running:
        raise RpcError("distlab.rpc is not initialized on this worker (call init_rpc first, or it was shut down)")
    return agent


def is_initialized() -> bool:
    """True between ``init_rpc`` and ``shutdown``."""
    return _agent is not None and _agent.running


def cheap(fn):
    """Mark ``fn`` as cheap: the callee runs it on its listener thread (no thread-pool hop; it must not block)."""
    fn.__distlab_rpc_cheap__ = True
    return fn


def rpc_sync(to, func, args=(), kwargs=None, timeout=None):
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (RemoteError if it raised)."""
    agent = _agent
    if agent is None or not agent.running:
        agent = get_agent()  # raises, saying why
    wrapped = wrappers.registered and wrappers.wrap_for(agent, to, func, args, kwargs)
    if wrapped:
        inline = getattr(func, "__distlab_rpc_cheap__", False)
        func, args, kwargs, unwrap = wrapped
        return unwrap(agent.call_sync(to, K_CALL, call_payload(func, args, kwargs), timeout=timeout, inline=inline))
    to, payload, copy = _request(agent, to, func, args, kwargs)
    result = agent.call_sync(to, K_CALL, payload, timeout=timeout, inline=getattr(func, "__distlab_rpc_cheap__", False))
    if copy is not None:
        agent.copies_seen[to].add(copy)  # it answered: it has the copy
    return result


def rpc_async(to, func, args=(), kwargs=None, timeout=None) -> Future:
    """Like :func:`rpc_sync` but return a Future at once."""
    agent = _agent
    if agent is None or not agent.running:
        agent = get_agent()  # raises, saying why
    wrapped = wrappers.registered and wrappers.wrap_for(agent, to, func, args, kwargs)
    if wrapped:
        inline = getattr(func, "__distlab_rpc_cheap__", False)
        func, args, kwargs, unwrap = wrapped
        return agent.send(to, K_CALL, call_payload(func, args, kwargs), timeout=timeout, inline=inline).then(
            lambda f: unwrap(f.value()))
    to, payload, copy = _request(agent, to, func, args, kwargs)
    fut = agent.send(to, K_CALL, payload, timeout=timeout, inline=getattr(func, "__distlab_rpc_cheap__", False))
    if copy is not None:
        fut.add_done_callback(copy_seen(agent, to, copy))
    return fut


def _request(agent, to, func, args, kwargs) -> tuple:
    """``(to, payload, copy)``: a call's destination and payload (:func:`~distlab.rpc.framing.call_payload`). A
    ``__main__`` function's by-value copy goes to each worker once: left out when worker ``to`` (then an id) has it
    (:func:`~distlab.rpc.framing.main_ref`); ``copy``: the copy's digest when it travels, else None."""
    payload = call_payload(func, args, kwargs)
    if type(payload[0]) is not tuple:
        return to, payload, None
    dst = to if type(to) is int and 0 <= to < agent.size else agent.worker_info(to).id
    ref, fresh = main_ref(payload[0], agent.copies_seen[dst])
    return dst, (ref, payload[1], payload[2]), ref[2] if fresh else None


def copy_seen(agent, dst, digest):
    """A future's callback: once worker ``dst`` answered a request that carried a by-value copy, it has it."""
    def seen(fut):
        if fut.exception() is None:
            agent.copies_seen[dst].add(digest)
    return seen
