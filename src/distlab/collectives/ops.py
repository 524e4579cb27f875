"""The Horovod-style operations of distlab.collectives (the package re-exports them; read its docstring)."""
from __future__ import annotations

import atexit
import sys
import threading

import numpy as np

from .. import _backend
from .._types import ReduceOp
from ..autograd._array import array_module
from ..errors import (
    CollectiveError,
    DistTimeoutError,
    DuplicateNameError,
    NotInitializedError,
    StallShutdownError,
)
from ..futures import resolve_timeout
from . import _engine as _engines
from ._engine import OP_CODES, Handle
from ._execute import even_splits
from ._settings import settings
from .process_sets import ProcessSet, global_process_set

__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "allgather",
    "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier", "join", "poll", "synchronize", "Handle", "stats", "stall_reports", "settings",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "CollectiveError", "DuplicateNameError", "NotInitializedError", "StallShutdownError",
]

Average = ReduceOp.AVG
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
#: Horovod's Adasum reduction: not implemented here; passing it raises NotImplementedError.
Adasum = "adasum"

_atexit_registered = False


def init() -> None:
    """Start the negotiation engine (collective: every rank calls it).

    Calling it again is a no-op until this rank's own :func:`shutdown`, as in Horovod, also when a peer's
    shutdown (or a crash) stopped the engine: then operations raise NotInitializedError saying who stopped it,
    and every rank calls ``shutdown()`` before starting again.
    """
    global _atexit_registered
    with _engines.lock:
        if _engines.current is None:
            _engines.current = _engines.Engine()
        if not _atexit_registered:
            # A program that ends without shutdown() must not leave the cycle thread inside MPI at finalize.
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True


def _exit_reason() -> str:
    """Why this rank shuts the collectives down at exit, as the other ranks will read it."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is not None:
        return (f"crashed ({type(exc).__name__}: {exc}) and shut its collectives down at exit; see its "
                "traceback")
    return "exited without calling shutdown()"


def _shutdown_at_exit() -> None:
    try:
        _shutdown(10.0, _exit_reason())
    except Exception:  # noqa: BLE001 - exiting anyway; another rank may already be gone
        pass


def shutdown(timeout: float | None = None) -> None:
    """Stop the engine on every rank (collective); pending handles fail with NotInitializedError.

    The other ranks' pending handles say that this rank called shutdown().
    """
    _shutdown(resolve_timeout(timeout, "shutdown(timeout)"), "called shutdown()")


def _shutdown(timeout: float, reason: str) -> None:
    with _engines.lock:
        engine, _engines.current = _engines.current, None
    if engine is not None:
        engine.close(timeout, reason)


def is_initialized() -> bool:
    """True from :func:`init` until this rank's own :func:`shutdown`, as Horovod's ``is_initialized``.

    Also while a peer's shutdown (or failure) has stopped the engine: this rank is still initialized, so
    :func:`init` stays a no-op and operations raise NotInitializedError saying who stopped it and why, until
    this rank calls ``shutdown()`` (Horovod clears ``initialization_done`` only in ``horovod_shutdown``).
    """
    return _engines.current is not None


_get = _engines.get


def rank() -> int:
    """This rank (in the world)."""
    return _get().rank


def size() -> int:
    """The number of ranks (in the world)."""
    return _get().size


def _node_peers(same_node: bool) -> np.ndarray:
    """World ranks on this rank's node (``same_node``), or holding its local rank on every node (Horovod's cross
    communicator); the node layout is the comm layer's (``DISTLAB_RANKS_PER_NODE`` simulates nodes)."""
    engine = _get()
    keys = engine.node_keys                      # every rank's node: the smallest world rank on it
    local = np.array([np.count_nonzero(keys[:r] == keys[r]) for r in range(engine.size)])
    return np.flatnonzero(keys == keys[engine.rank] if same_node else local == local[engine.rank])


def local_rank() -> int:
    """This rank's index among the ranks on its node (Horovod's ``local_rank``)."""
    return int(np.searchsorted(_node_peers(True), _get().rank))


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return len(_node_peers(True))


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank, one per node (the index of its node)."""
    return int(np.searchsorted(_node_peers(False), _get().rank))


def cross_size() -> int:
    """The number of ranks with this rank's local rank (the number of nodes, when nodes are alike)."""
    return len(_node_peers(False))


def _reduce_op(op, what: str) -> ReduceOp:
    if isinstance(op, str) and op.lower() == Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not implemented by distlab.collectives (Horovod's "
                                  "Adasum reduction); use op=Average or op=Sum")
    op = ReduceOp.parse(op)
    if op not in OP_CODES:
        raise ValueError(f"{what} op must be Average, Sum, Min, Max or Product, got {op}")
    return op


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:
    """Submit an allreduce of ``array``; returns a Handle whose result is the reduced copy.

    ``op`` is Average (the sum divided by the number of ranks; a joined rank counts, contributing zeros), Sum,
    Min, Max or Product. ``prescale_factor`` multiplies the input, ``postscale_factor`` the result, as Horovod
    scales: float16 and bfloat16 in float32, integers in float64 then truncated toward zero (Average of
    integers is the sum times ``1/size``, truncated).
    """
    op = _reduce_op(op, "allreduce")
    return _get().submit("allreduce", array, name, process_set, op=op, pre=prescale_factor, post=postscale_factor)


def allreduce(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set):
    """Blocking :func:`allreduce_async` + :func:`synchronize`."""
    return synchronize(allreduce_async(array, name, op, prescale_factor, postscale_factor, process_set))


class _GroupHandle(Handle):
    """A grouped collective's handle: its result is the list of the members' results."""

    __slots__ = ("members",)

    def __init__(self, name, members, process_set_id):
        from ..futures import Future

        future = Future(description=f"grouped allreduce of {name!r}")
        super().__init__(name, "grouped_allreduce", future, process_set_id)
        self.members = members
        remaining = [len(members)]
        lock = threading.Lock()

        def done(_member_future):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                errors = [m.future.exception() for m in members if m.future.exception() is not None]
                if errors:
                    future.set_exception(errors[0])
                else:
                    future.set_result([m.future.value() for m in members])

        for member in members:
            member.future.add_done_callback(done)


def grouped_allreduce_async(arrays, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> Handle:
    """Submit one allreduce of several arrays that runs as one (Horovod's grouped allreduce).

    The group is one response, whatever the fusion threshold, and only once every member is ready on every
    rank (all or nothing); ranks that submit the group with different members get one CollectiveError naming
    the group, on every rank. The handle's result is the list of reduced copies, in order. The arrays must share
    a dtype; the members are named ``<name>.<index>``.
    """
    op = _reduce_op(op, "grouped allreduce")
    engine = _get()
    members = engine.submit_group(list(arrays), name, process_set, op, prescale_factor, postscale_factor)
    group_name = members[0].name.rpartition(".")[0]
    return _GroupHandle(group_name, members, members[0].process_set_id)


def grouped_allreduce(arrays, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Blocking :func:`grouped_allreduce_async` + :func:`synchronize`."""
    return synchronize(grouped_allreduce_async(arrays, name, op, prescale_factor, postscale_factor, process_set))


def allgather_async(array, name=None, process_set=global_process_set) -> Handle:
    """Submit an allgather: the result concatenates every rank's array along axis 0 (first dims may differ)."""
    return _get().submit("allgather", array, name, process_set)


def allgather(array, name=None, process_set=global_process_set):
    """Blocking :func:`allgather_async` + :func:`synchronize`."""
    return synchronize(allgather_async(array, name, process_set))


def _set_rank(engine, process_set, world_rank, what: str) -> int:
    state = engine.process_set_state(process_set)
    if int(world_rank) not in state.ranks:
        raise ValueError(f"{what} {world_rank} is not a rank of {process_set!r} (ranks {state.ranks})")
    return state.ranks.index(int(world_rank))


def broadcast_async(array, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Submit a broadcast of ``root_rank``'s array (a world rank in the set); the result is a copy of it."""
    engine = _get()
    root = _set_rank(engine, process_set, root_rank, "broadcast root_rank")
    return engine.submit("broadcast", array, name, process_set, root=root)


def broadcast(array, root_rank, name=None, process_set=global_process_set):
    """Blocking :func:`broadcast_async` + :func:`synchronize`."""
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def alltoall_async(array, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Submit an alltoall: rows ``splits[j]`` of ``array`` (along axis 0, in order) go to the set's rank ``j``.

    Without ``splits`` the rows are split as evenly as possible (the remainder to the first ranks). The result
    is ``(received, received_splits)``: the rows received from every rank, in rank order, and how many came from
    each (as horovod.torch's alltoall).
    """
    engine = _get()
    state = engine.process_set_state(process_set)
    array = array_module(array).asarray(array)  # device arrays stay on their device
    if array.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    splits = even_splits(array.shape[0], state.size) if splits is None else [int(s) for s in np.asarray(splits)]
    if len(splits) != state.size or min(splits) < 0 or sum(splits) != array.shape[0]:
        raise ValueError(f"alltoall splits {splits} must be {state.size} non-negative counts summing to the "
                         f"first dimension {array.shape[0]}")
    return engine.submit("alltoall", array, name, process_set, splits=splits)


def alltoall(array, splits=None, name=None, process_set=global_process_set):
    """Blocking :func:`alltoall_async` + :func:`synchronize`: ``(received, received_splits)``."""
    return synchronize(alltoall_async(array, splits, name, process_set))


def reducescatter_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=global_process_set) -> Handle:
    """Submit a reducescatter: the arrays are reduced and rank ``r`` of the set receives its rows.

    Rows are split as Horovod does: ``n // size`` each, one more for the first ``n % size`` ranks.
    """
    op = _reduce_op(op, "reducescatter")
    return _get().submit("reducescatter", array, name, process_set, op=op, pre=prescale_factor,
                         post=postscale_factor)


def reducescatter(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set):
    """Blocking :func:`reducescatter_async` + :func:`synchronize`."""
    return synchronize(reducescatter_async(array, name, op, prescale_factor, postscale_factor, process_set))


def barrier(timeout: float | None = None, process_set=global_process_set) -> None:
    """Wait until every rank of the set has reached a barrier (negotiated like any collective)."""
    synchronize(_get().submit("barrier", None, None, process_set), timeout)


def join(timeout: float | None = None, process_set=global_process_set) -> int:
    """Declare that this rank has no more data; wait for every rank to join; return the last rank that joined.

    Until then this rank takes part in the other ranks' allreduces with zeros; allgather, broadcast, alltoall
    and reducescatter are refused while any rank has joined.
    """
    return synchronize(_get().submit("join", None, None, process_set), timeout)


def add_process_set(ranks) -> ProcessSet:
    """Register a process set of ``ranks`` (world ranks); collective: every rank calls it with the same ranks.

    Returns the :class:`ProcessSet` to pass as ``process_set=``; its members negotiate their own tensors with
    their own coordinator and response cache. Ranks that ask for different sets get a clear error.
    """
    engine = _get()
    ranks = sorted({int(r) for r in ranks})
    if not ranks or ranks[0] < 0 or ranks[-1] >= engine.size:
        raise ValueError(f"add_process_set: ranks {ranks} must be ranks of the world (0 to {engine.size - 1})")
    mask = np.zeros(engine.size, dtype=np.uint8)
    mask[ranks] = 1
    name = f"process_set.add.{next(engine.set_counter)}"
    handle = engine.submit("allgather", mask.reshape(1, -1), name, global_process_set,
                           after=engine.create_process_set)
    process_set_id, agreed = synchronize(handle)
    process_set = ProcessSet(agreed)
    process_set.process_set_id = process_set_id
    engine.registered[process_set_id] = process_set  # made again on the survivors of a failure (elastic)
    return process_set


def remove_process_set(process_set) -> None:
    """Unregister a process set (collective: every rank calls it); its pending handles fail."""
    engine = _get()
    if process_set.process_set_id == global_process_set.process_set_id:
        raise ValueError("remove_process_set: the global process set cannot be removed")
    state = engine.process_set_state(process_set)
    name = f"process_set.remove.{next(engine.set_counter)}"
    synchronize(engine.submit("allgather", np.array([state.id], dtype=np.int64), name, global_process_set,
                              after=engine.remove_process_set))
    engine.registered.pop(state.id, None)
    process_set.process_set_id = None


def poll(handle: Handle) -> bool:
    """True when the collective has finished (successfully or not)."""
    return handle.future.done()


def synchronize(handle: Handle, timeout: float | None = None):
    """Wait for ``handle`` (default timeout ``DISTLAB_TIMEOUT``) and return its result, or raise its error.

    A timeout raises :class:`~distlab.errors.DistTimeoutError`; on the set's rank 0, once the stall inspector
    has checked, it names the ranks that have not submitted the tensor (``missing_ranks``).
    """
    timeout = resolve_timeout(timeout, "synchronize(timeout)")
    try:
        return handle.future.wait(timeout)
    except DistTimeoutError:
        engine = _engines.current
        missing = []
        where = "this rank"
        if engine is not None:
            state = engine.sets.get(handle.process_set_id)
            names = [m.name for m in getattr(handle, "members", [handle])]
            if state is not None and state.controller is not None:
                stalled = state.controller.stall.last_stalled
                missing = sorted({state.world_rank(r) for n in names for r in stalled.get(n, [])})
            where = f"rank {engine.rank}"
        if missing:
            detail = f"ranks {missing} have not submitted it (stall inspector)"
        else:
            detail = ("the ranks that have not submitted it are named by rank 0's stall report after "
                      "DISTLAB_STALL_CHECK_TIME")
        raise DistTimeoutError(
            f"{handle.kind} of {handle.name!r} did not complete within {timeout:g} s on {where}: {detail}. "
            "Every rank must submit the same names; a rank without more data should call join().",
            op=handle.kind, name=handle.name, missing_ranks=missing, timeout=timeout) from None


def stats(process_set=global_process_set) -> dict:
    """The set's controller counters: cycles, fast_path, slow_path, idle, hits, misses, invalid, requeued, ..."""
    state = _get().process_set_state(process_set)
    if state.controller is None:
        raise ValueError(f"rank {_get().rank} is not in {process_set!r}")
    out = dict(state.controller.counters)
    out["cache_entries"] = len(state.controller.cache)
    out["impl"] = _backend.active_impl()
    return out


def stall_reports(process_set=global_process_set) -> list:
    """Stall reports produced so far (on the set's rank 0, where the stall inspector checks)."""
    state = _get().process_set_state(process_set)
    return list(state.controller.stall.reports) if state.controller is not None else []
