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
import threading

from .. import _backend
from .._types import ReduceOp
from ..errors import (
    CollectiveError,
    DistTimeoutError,
    DuplicateNameError,
    NotInitializedError,
    StallShutdownError,
)
from ..futures import default_timeout
from ._engine import OP_CODES, Handle, _Engine
from ._settings import settings

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
    if op not in OP_CODES:
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
    return synchronize(_get().submit("join", None, None), timeout)


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
