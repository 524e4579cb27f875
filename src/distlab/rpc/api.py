"""Public RPC functions: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``, ``get_worker_info``.

Shared plumbing over :class:`distlab.rpc.agent.RpcAgent`; the RRef protocol state lives in the active twin
(``distlab._backend.load("rref")``), wired to the agent in :mod:`distlab.rpc.rref`. This module starts and stops
both (``init_rpc``, ``shutdown``); the running agent and the calls through it (``get_agent``, ``rpc_sync``,
``rpc_async``) are :mod:`distlab.rpc.calls`, below this module and the RRef layer alike.
"""
from __future__ import annotations

import atexit
import threading

from distlab.errors import RpcError
from distlab.futures import Future, default_timeout

from . import calls, functions, rref
from . import devices as _devices
from .agent import RpcAgent, WorkerInfo, check_thread_level
from .calls import K_CALL, cheap, get_agent, is_initialized, rpc_async, rpc_sync
from .devices import RpcBackendOptions
from .framing import resolve_ref
from .workers import check_name, join_workers

__all__ = ["init_rpc", "shutdown", "reinit", "get_worker_info", "get_worker_infos", "get_rpc_timeout", "rpc_sync",
           "rpc_async", "remote", "cheap", "get_agent", "is_initialized"]

_state_lock = threading.Lock()
_atexit_registered = False
_started: dict = {}  # what init_rpc was given last (name, rpc_timeout, num_threads, options): reinit starts it again


def _job_world():
    """The communicator of the job's world: ``COMM_WORLD``, or the survivors' after a failure
    (:func:`distlab.comm.recovery.rebuild` shrank it)."""
    from mpi4py import MPI

    from distlab.comm import recovery

    return recovery.parent() or MPI.COMM_WORLD


def _handle_call(src, payload, meta):
    func, args, kwargs = payload
    if type(func) is str or type(func) is tuple:
        func = resolve_ref(func)  # a function sent by name
    result = func(*args, **kwargs) if kwargs else func(*args)
    # a Future answers later, with @async_execution only (is_async_execution, without its frame per call)
    if isinstance(result, Future) or hasattr(func, "_wrapped_async_rpc_function"):
        return functions.check_result(func, result, Future)
    return result


def init_rpc(name, rank=None, world_size=None, rpc_timeout=None, num_threads=4, rpc_backend_options=None):
    """Start this worker's RPC agent (collective over the job's world: every rank calls it; after a failure, over
    the survivors the world was rebuilt on, see :func:`reinit`).

    Parameters
    ----------
    name : str
        Unique worker name.
    rank, world_size : int, optional
        Checked against the job's world when given.
    rpc_timeout : float, optional
        Default timeout of every RPC and RRef wait, in seconds; ``None`` (the default) takes ``DISTLAB_TIMEOUT``
        (300 s unless set), the bound on every wait in distlab; ``0`` disables it. ``init_rpc`` itself waits at
        most this long (``DISTLAB_TIMEOUT`` when disabled) for every rank to call it, then raises
        :class:`~distlab.errors.DistTimeoutError` naming the ranks that did not.
    num_threads : int
        Threads running the requests this worker receives.
    rpc_backend_options : RpcBackendOptions, optional
        PyTorch's ``rpc_backend_options``: device maps (where this worker's device arrays land on each callee),
        devices, and (when set there) ``rpc_timeout`` and ``num_worker_threads``, which take precedence. Every
        worker checks every worker's device maps; an inconsistent one is an RpcDeviceError on every worker.
    """
    global _atexit_registered
    with _state_lock:
        running = calls.current_agent()
        if running is not None and running.running:
            raise RpcError(f"init_rpc was already called on this worker (as {running.info.name!r})")
        world = _job_world()
        if rank is not None and rank != world.Get_rank():
            raise ValueError(f"init_rpc(rank={rank}) but this process is MPI rank {world.Get_rank()}")
        if world_size is not None and world_size != world.Get_size():
            raise ValueError(f"init_rpc(world_size={world_size}) but MPI has {world.Get_size()} ranks")
        _started.update(name=name, rpc_timeout=rpc_timeout, num_threads=num_threads,
                        rpc_backend_options=rpc_backend_options)
        options = rpc_backend_options
        if options is not None and not isinstance(options, RpcBackendOptions):
            raise TypeError(f"rpc_backend_options must be a distlab.rpc.RpcBackendOptions, got {options!r}")
        if options is not None and options.rpc_timeout is not None:
            rpc_timeout = options.rpc_timeout
        if options is not None and options.num_worker_threads is not None:
            num_threads = options.num_worker_threads
        rpc_timeout = _check_timeout(rpc_timeout)
        check_thread_level()
        check_name(name)
        comm, names = join_workers(world, name, rpc_timeout or default_timeout())
        try:
            placement, device_count = _devices.exchange(comm, name, names, options)
        except BaseException:
            comm.Free()
            raise
        agent = RpcAgent(name, comm, rpc_timeout=rpc_timeout, num_threads=num_threads, names=names,
                         placement=placement, device_count=device_count)
        agent.register_handler(K_CALL, _handle_call, _internal=True)
        rref.attach(agent)
        calls.set_agent(agent)  # before the listener starts: handlers may call get_agent() at once
        agent.start()
        if not _atexit_registered:
            atexit.register(_stop_at_exit)
            _atexit_registered = True
    return agent.info


def _check_timeout(seconds) -> float:
    """An RPC timeout in seconds, 0 for none; ``inf`` (DISTLAB_TIMEOUT's "no deadline") is 0 too; None for
    ``DISTLAB_TIMEOUT``.

    Here, and only in ``distlab.rpc``, 0 means "no timeout", as it does in PyTorch RPC (``rpc_timeout=0``,
    ``rpc_sync(..., timeout=0)``); everywhere else (:func:`distlab.futures.check_timeout`: process groups,
    ``Work.wait``, futures, collectives) 0 is refused as ambiguous, since c10d reads it as "the default".
    """
    if seconds is None:
        seconds = default_timeout()
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"an RPC timeout is a number of seconds >= 0 (0: none), got {seconds!r}")
    return 0.0 if seconds == float("inf") else float(seconds)


def _stop_at_exit() -> None:
    """atexit: a program that ends without ``shutdown()`` (an uncaught error, or simply forgotten) must not
    leave the listener thread inside MPI when mpi4py finalizes MPI, which then crashed (segmentation fault).
    Registered after mpi4py initialised MPI, so it runs first. Non-graceful: the other workers may be gone."""
    agent = calls.current_agent()
    if agent is None or not agent.running:
        return
    try:
        agent.stop(graceful=False, timeout=5.0)
        rref.detach(agent, check_leaks=False)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def get_worker_info(worker_name=None) -> WorkerInfo:
    """``WorkerInfo(name, id)`` of the worker named ``worker_name`` (this worker when None); as PyTorch's, it also
    takes an id or a WorkerInfo. ValueError for an unknown worker."""
    return get_agent().worker_info(worker_name)


def get_worker_infos() -> list:
    """Every worker's ``WorkerInfo``, by id (PyTorch has it on the agent only: ``_get_current_rpc_agent()``)."""
    return list(get_agent().workers)


def get_rpc_timeout() -> float:
    """The default timeout of RPC calls on this worker, in seconds (0: none); see :func:`_set_rpc_timeout`."""
    return get_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout) -> None:
    """Set the default timeout of the calls this worker makes from now on (seconds; 0: none; None:
    ``DISTLAB_TIMEOUT``), as PyTorch's ``rpc._set_rpc_timeout``; calls already in flight keep theirs."""
    get_agent().rpc_timeout = _check_timeout(rpc_timeout)


remote = rref.remote


def reinit(timeout=None):
    """Start RPC again on the job's world after a failure shrank it: what the survivors call, all of them, once
    :func:`distlab.comm.recovery.rebuild` made the new world (``elastic.run`` does both). Returns this worker's
    new :class:`WorkerInfo`.

    The running agent stops without waiting for anyone (``shutdown(graceful=False)``): requests still in flight
    fail, and the RRefs it made are dropped (using one raises RRefError; make them again). A new agent starts with
    what ``init_rpc`` was given (the same name, timeout, threads and options) over the survivors: workers keep
    their names, their ids follow their new ranks. A worker that never ran RPC is left as it is (None).
    """
    if not _started:
        return None
    agent = calls.current_agent()
    if agent is not None and agent.running:
        shutdown(graceful=False, timeout=timeout)
    return init_rpc(**_started)


def shutdown(graceful=True, timeout=None):
    """Stop RPC on this worker. ``graceful`` (collective): wait until every worker has called shutdown, delete
    every UserRRef, wait until no OwnerRRef remains, wait until every worker is done sending, then stop; raises
    RRefLeakError naming leaked RRefs. Every wait is bounded by ``timeout`` (default the RPC timeout, or
    ``DISTLAB_TIMEOUT`` when that is disabled)."""
    with _state_lock:
        agent = calls.current_agent()
        if agent is None or not agent.running:
            raise RpcError("shutdown: distlab.rpc is not initialized on this worker")
        timeout = (agent.rpc_timeout or default_timeout()) if timeout is None else timeout
        try:
            if graceful:
                # mirrors torch.distributed.rpc.shutdown: first every worker agrees it is done (no new user
                # work), then UserRRefs are deleted and owners drained, then every worker is done sending.
                agent.wait_idle(timeout)
                agent.barrier(timeout)
                rref.graceful_delete(agent, timeout)
                agent.wait_idle(timeout)
                agent.barrier(timeout)
        finally:
            agent.stop(graceful=graceful, timeout=timeout)
            leaks = rref.detach(agent, check_leaks=graceful)
            calls.set_agent(None)
        if leaks is not None:
            raise leaks
