"""Public RPC functions: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``, ``get_worker_info``.

Shared plumbing over :class:`distlab.rpc.agent.RpcAgent`; the RRef protocol state lives in the active twin
(``distlab._backend.load("rref")``), wired to the agent in :mod:`distlab.rpc.rref`.
"""
from __future__ import annotations

import threading

from distlab._wire import RPC_KIND_CODES
from distlab.errors import RpcError
from distlab.futures import Future

from . import framing, wrappers
from .agent import RpcAgent, WorkerInfo, check_thread_level

__all__ = ["init_rpc", "shutdown", "get_worker_info", "rpc_sync", "rpc_async", "remote", "cheap", "get_agent",
           "is_initialized"]

K_CALL = RPC_KIND_CODES["call"]

_state_lock = threading.Lock()
_agent: RpcAgent | None = None


def cheap(fn):
    """Mark ``fn`` as cheap: the callee runs it on its listener thread (no thread-pool hop; it must not block)."""
    fn.__distlab_rpc_cheap__ = True
    return fn


def get_agent() -> RpcAgent:
    """The running agent; RpcError if ``init_rpc`` was not called or ``shutdown`` was."""
    agent = _agent
    if agent is None or not agent.running:
        raise RpcError("distlab.rpc is not initialized on this worker (call init_rpc first, or it was shut down)")
    return agent


def is_initialized() -> bool:
    """True between ``init_rpc`` and ``shutdown``."""
    return _agent is not None and _agent.running


def _handle_call(src, payload, meta):
    func, args, kwargs = payload
    return func(*args, **kwargs) if kwargs else func(*args)


def init_rpc(name, rank=None, world_size=None, rpc_timeout=60.0, num_threads=4):
    """Start this worker's RPC agent (collective over COMM_WORLD: every rank calls it).

    Parameters
    ----------
    name : str
        Unique worker name.
    rank, world_size : int, optional
        Checked against MPI's COMM_WORLD when given.
    rpc_timeout : float
        Default per-call timeout in seconds (``0`` disables it).
    """
    global _agent
    from mpi4py import MPI

    from . import rref as _rref_glue

    with _state_lock:
        if _agent is not None and _agent.running:
            raise RpcError(f"init_rpc was already called on this worker (as {_agent.info.name!r})")
        world = MPI.COMM_WORLD
        if rank is not None and rank != world.Get_rank():
            raise ValueError(f"init_rpc(rank={rank}) but this process is MPI rank {world.Get_rank()}")
        if world_size is not None and world_size != world.Get_size():
            raise ValueError(f"init_rpc(world_size={world_size}) but MPI has {world.Get_size()} ranks")
        check_thread_level()
        agent = RpcAgent(name, world.Dup(), rpc_timeout=rpc_timeout, num_threads=num_threads)
        agent.register_handler(K_CALL, _handle_call, _internal=True)
        _rref_glue.attach(agent)
        _agent = agent  # before the listener starts: handlers may call get_agent() at once
        agent.start()
    return agent.info


def get_worker_info(name=None) -> WorkerInfo:
    """``WorkerInfo(name, id)`` of worker ``name`` (this worker when None)."""
    return get_agent().worker_info(name)


def _call_payload(func, args, kwargs):
    if not callable(func):
        raise TypeError(f"rpc: func must be callable, got {type(func).__name__}")
    return (framing.by_value(func), tuple(args), dict(kwargs) if kwargs else None)


# -- call wrappers (distlab.rpc.wrappers: how distributed autograd rewrites calls made inside a context) -----------
def _wrap(agent, to, func, args, kwargs, remote=False):
    """None, or ``(func, args, kwargs, unwrap)`` when a registered call wrapper rewrote the call."""
    return wrappers._wrappers and wrappers.wrap_call(agent.worker_info(to).id, func, args, kwargs, remote)


def rpc_sync(to, func, args=(), kwargs=None, timeout=None):
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (RemoteError if it raised)."""
    agent = get_agent()
    wrapped = _wrap(agent, to, func, args, kwargs)
    if wrapped:
        inline = getattr(func, "__distlab_rpc_cheap__", False)
        func, args, kwargs, unwrap = wrapped
        return unwrap(agent.call_sync(to, K_CALL, _call_payload(func, args, kwargs), timeout=timeout, inline=inline))
    return agent.call_sync(to, K_CALL, _call_payload(func, args, kwargs), timeout=timeout,
                           inline=getattr(func, "__distlab_rpc_cheap__", False))


def rpc_async(to, func, args=(), kwargs=None, timeout=None) -> Future:
    """Like :func:`rpc_sync` but return a Future at once."""
    agent = get_agent()
    wrapped = _wrap(agent, to, func, args, kwargs)
    if wrapped:
        inline = getattr(func, "__distlab_rpc_cheap__", False)
        func, args, kwargs, unwrap = wrapped
        return agent.send(to, K_CALL, _call_payload(func, args, kwargs), timeout=timeout, inline=inline).then(
            lambda f: unwrap(f.value()))
    return agent.send(to, K_CALL, _call_payload(func, args, kwargs), timeout=timeout,
                      inline=getattr(func, "__distlab_rpc_cheap__", False))


def remote(to, func, args=(), kwargs=None, timeout=None):
    """Run ``func`` on worker ``to`` and return an RRef to its result (see :mod:`distlab.rpc.rref`)."""
    from .rref import remote as _remote

    wrapped = _wrap(get_agent(), to, func, args, kwargs, remote=True)
    if wrapped:
        func, args, kwargs, _unwrap = wrapped
    return _remote(to, func, args, kwargs, timeout)


def shutdown(graceful=True, timeout=None):
    """Stop RPC on this worker. ``graceful`` (collective): wait until every worker has called shutdown, delete
    every UserRRef, wait until no OwnerRRef remains, wait until every worker is done sending, then stop; raises
    RRefLeakError naming leaked RRefs. Every wait is bounded by ``timeout`` (default the RPC timeout)."""
    global _agent
    from . import rref as _rref_glue

    with _state_lock:
        agent = _agent
        if agent is None or not agent.running:
            raise RpcError("shutdown: distlab.rpc is not initialized on this worker")
        timeout = agent.rpc_timeout if timeout is None else timeout
        try:
            if graceful:
                # mirrors torch.distributed.rpc.shutdown: first every worker agrees it is done (no new user
                # work), then UserRRefs are deleted and owners drained, then every worker is done sending.
                agent.wait_idle(timeout)
                agent.barrier(timeout)
                _rref_glue.graceful_delete(agent, timeout)
                agent.wait_idle(timeout)
                agent.barrier(timeout)
        finally:
            agent.stop(graceful=graceful, timeout=timeout)
            leaks = _rref_glue.detach(agent, check_leaks=graceful)
            _agent = None
        if leaks is not None:
            raise leaks
