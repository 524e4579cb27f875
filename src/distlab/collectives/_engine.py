"""The engine of distlab.collectives: the process sets, their submission tables and the background cycle thread.

The cycle thread runs, for each process set this rank belongs to (the global set first, then the others in id
order), the controller's negotiation (the active twin of :mod:`distlab.reference.negotiation`) over the set's own
process group, then runs the agreed responses (:mod:`distlab.collectives._execute`). Every member of a set starts
cycling it in the same cycle (a set is created while running a response of the global set, which every rank runs
at the same point), so the sets' collectives always pair up. A cycle thread that fails tells every peer at once
(:mod:`distlab.collectives._failures`), so that every rank stops within the cycle it is in, saying who failed and why.
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from .. import _backend
from .._common.negotiation import dtype_code, group_id_of
from .._types import ReduceOp
from ..autograd._array import array_module
from .._wire import CPU_DEVICE_ID, GLOBAL_PROCESS_SET_ID, JOIN_TENSOR_NAME, REDUCE_OP_CODES, RequestType
from ..errors import DistlabError, DuplicateNameError, NotInitializedError, ProcessFailedError, StallShutdownError
from ..futures import Future
from ..timeline import get_timeline, now_us
from ._execute import check_reduction, execute
from ._failures import FailureNotes, PeerFailed, failure_reason, stopped_by
from ._placement import placeable
from ._settings import settings

__all__ = ["Handle", "OP_CODES", "KINDS", "get"]

#: The reduce ops a negotiated allreduce supports, with their wire codes (distlab._wire.REDUCE_OP_CODES).
OP_CODES = {op: REDUCE_OP_CODES[op.value] for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX,
                                                    ReduceOp.PRODUCT)}
#: Collective kinds and their request types.
KINDS = {"allreduce": RequestType.ALLREDUCE, "allgather": RequestType.ALLGATHER,
         "broadcast": RequestType.BROADCAST, "barrier": RequestType.BARRIER, "join": RequestType.JOIN,
         "alltoall": RequestType.ALLTOALL, "reducescatter": RequestType.REDUCESCATTER}


class Handle:
    """An in-flight collective: pass it to :func:`poll` or :func:`synchronize`."""

    __slots__ = ("name", "kind", "future", "process_set_id")

    def __init__(self, name: str, kind: str, future: Future, process_set_id: int = GLOBAL_PROCESS_SET_ID):
        self.name = name
        self.kind = kind
        self.future = future
        self.process_set_id = process_set_id

    def __repr__(self) -> str:
        return f"<collectives.Handle {self.kind} {self.name!r} {'done' if self.future.done() else 'pending'}>"


class _Entry:
    """One submitted tensor: its copy, how to run it, and the future its handle waits on."""

    __slots__ = ("name", "kind", "array", "op", "root", "pre", "post", "splits", "future", "after", "offset",
                 "source", "copied")

    def __init__(self, name, kind, array, op, root, pre, post, future, splits=None, after=None, offset=None):
        self.name, self.kind, self.array, self.op, self.root = name, kind, array, op, root
        self.pre, self.post, self.future, self.splits, self.after = pre, post, future, splits, after
        self.offset = offset  # where the copy lies in this rank's slot of the set's arena (None: private memory)
        self.source = None    # the caller's array, copied into the arena once the request is queued
        self.copied = None    # set when that copy is done (the cycle waits for it before reducing)

    def fill(self) -> None:
        """Copy the caller's array into the arena region (after queueing: the copy overlaps the negotiation)."""
        try:
            np.copyto(self.array, self.source, casting="no")
        finally:
            self.source = None
            self.copied.set()


class _MPIChannel:
    """The controller's three calls over a set's ProcessGroup (every wait bounded by its timeout)."""

    def __init__(self, group):
        self.group = group

    def allreduce_bits(self, words, op):
        self.group.allreduce(words, op=op, name="negotiation bits")

    def gather(self, payload):
        gathered = self.group.allgather_object(bytes(payload), name="negotiation requests")
        return gathered if self.group.rank == 0 else None

    def broadcast(self, payload):
        return self.group.broadcast_object(payload, src=0, name="negotiation responses")


class _SetState:
    """One process set as this rank sees it: its members and, on a member, its group, controller and table."""

    def __init__(self, engine, process_set_id, ranks, group):
        self.id = process_set_id
        self.ranks = list(ranks)                          # world ranks, sorted
        self.member = group is not None
        self.group = group
        self.rank = group.rank if group is not None else -1
        self.size = len(self.ranks)
        self.table: dict[str, _Entry] = {}
        self.lock = threading.Lock()
        self.counters = {kind: itertools.count() for kind in KINDS}
        self.fusion_buffer = np.empty(0, dtype=np.uint8)
        self.placement = None          # the set's shared-memory arena on one host (_placement), once made
        self.placement_tried = False
        self.timeline = engine.timeline
        self.controller = None
        if group is not None:
            s = engine.settings
            self.controller = engine.module.Controller(
                self.rank, self.size, cache_capacity=s["cache_capacity"], fusion_threshold=s["fusion_threshold"],
                stall_check_time=s["stall_check_time"], stall_shutdown_time=s["stall_shutdown_time"],
                timeline=engine.timeline if engine.timeline.enabled else None, process_set_id=process_set_id)
            self.channel = _MPIChannel(group)
            group.interrupt = engine.notes.check      # a wait on the set's group hears a peer's failure note

    def size_in_world(self) -> int:
        return self.size

    def world_rank(self, set_rank: int) -> int:
        return self.ranks[set_rank]

    def take(self, names):
        with self.lock:
            return [self.table.pop(n, None) for n in names]

    def release(self, entries, queued: bool = True) -> None:
        """Give the arena regions of ``entries`` back (their results were copied out, or they failed)."""
        for entry in entries:
            if entry is not None and entry.offset is not None:
                if queued and entry.copied is not None:   # not while the submitting thread still copies into it
                    entry.copied.wait(self.group.timeout)
                self.placement.release(entry.offset, entry.array.nbytes)
                entry.offset = None

    def fail_all(self, exc) -> None:
        with self.lock:
            entries, self.table = list(self.table.values()), {}
        self.release(entries)
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(exc)


class Engine:
    def __init__(self):
        from mpi4py import MPI

        from .. import comm
        from ..comm import recovery

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise DistlabError("distlab.collectives runs its cycle in a background thread and needs "
                               f"MPI_THREAD_MULTIPLE, but MPI provides thread level {MPI.Query_thread()}")
        self.settings = settings()
        self.module = _backend.load("negotiation")
        self.timeline = get_timeline()
        # over the job's ranks: COMM_WORLD, or the survivors' world once a failure shrank it (comm.recovery)
        group = comm.ProcessGroup(recovery.parent(), name="collectives")
        self.rank, self.size = group.rank, group.size
        self.notes = FailureNotes(group.comm, self.rank, self.size)
        self.node_keys = group.node_keys                # the node layout the comm layer asked MPI for (local_rank)
        self.sets: dict[int, _SetState] = {}
        self.sets[GLOBAL_PROCESS_SET_ID] = _SetState(self, GLOBAL_PROCESS_SET_ID, range(self.size), group)
        self.next_set_id = GLOBAL_PROCESS_SET_ID + 1
        self.set_counter = itertools.count()              # names the process-set operations (same on all ranks)
        self.registered: dict[int, object] = {}           # id -> the ProcessSet add_process_set returned
        self.sets_lock = threading.Lock()
        self.error: BaseException | None = None
        self.agreed_stop = False
        self.stop_reason = ""
        self.stop = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="distlab-collectives-cycle", daemon=True)
        self.thread.start()

    @property
    def world(self) -> _SetState:
        return self.sets[GLOBAL_PROCESS_SET_ID]

    @property
    def controller(self):
        return self.world.controller

    def process_set_state(self, process_set) -> _SetState:
        """The state of a ProcessSet; a clear error when it is not (or no longer) registered."""
        state = self.sets.get(process_set.process_set_id) if process_set.process_set_id is not None else None
        if state is None or (process_set.ranks is not None and state.ranks != process_set.ranks):
            raise ValueError(f"{process_set!r} is not registered: create it with add_process_set(ranks) on every "
                             "rank (it may have been removed)")
        return state

    # -- submission (user thread) -----------------------------------------------------------------------------
    def check_running(self) -> None:
        if self.error is not None:
            raise NotInitializedError(str(self.error)) from self.error
        if self.stop.is_set():
            raise NotInitializedError("distlab.collectives is shutting down; call init() again to use it")

    def submit(self, kind, array, name, process_set, op=None, root=0, pre=1.0, post=1.0, splits=None,
               after=None) -> Handle:
        """Copy ``array``, record the entry and queue its request with the set's controller."""
        handle, entry, request = self._prepare(kind, array, name, process_set, op, root, pre, post, splits, after)
        state = self.process_set_state(process_set)
        self._register(state, [entry])
        state.controller.enqueue(request)
        if entry.source is not None:
            entry.fill()
        return handle

    def submit_group(self, arrays, name, process_set, op, pre, post) -> list:
        """The members of one grouped allreduce, queued at once (the group is one response, all or nothing)."""
        state = self.process_set_state(process_set)
        if name is None:
            name = f"grouped_allreduce.noname.{next(state.counters['allreduce'])}"
        arrays = [array_module(a).asarray(a) for a in arrays]  # device arrays stay on their device
        if not arrays:
            raise ValueError(f"grouped allreduce {name!r}: no tensors")
        if len({a.dtype for a in arrays}) > 1:
            raise TypeError(f"grouped allreduce {name!r}: every tensor of a group must have the same dtype, got "
                            f"{', '.join(sorted({str(a.dtype) for a in arrays}))}")
        group = (group_id_of(str(name)), len(arrays))
        prepared = [self._prepare("allreduce", a, f"{name}.{i}", process_set, op, 0, pre, post, None, None, group)
                    for i, a in enumerate(arrays)]
        self._register(state, [entry for _h, entry, _r in prepared])
        state.controller.enqueue_group([request for _h, _e, request in prepared])
        for _h, entry, _r in prepared:
            if entry.source is not None:
                entry.fill()
        return [handle for handle, _e, _r in prepared]

    def _prepare(self, kind, array, name, process_set, op, root, pre, post, splits, after, group=(-1, 0)):
        self.check_running()
        state = self.process_set_state(process_set)
        if not state.member:
            raise ValueError(f"rank {self.rank} is not in process set {state.id} (ranks {state.ranks}): only its "
                             "members may submit collectives to it")
        if name is None:
            name = JOIN_TENSOR_NAME if kind == "join" else f"{kind}.noname.{next(state.counters[kind])}"
        name = str(name)
        offset = source = None
        if array is not None:
            xp = array_module(array)
            array = xp.asarray(array)
            if kind in ("allreduce", "reducescatter"):
                check_reduction(array.dtype, op, kind, name)
            placement = state.placement
            if (kind == "allreduce" and placement is not None and xp is np
                    and placeable(array.nbytes, array.dtype, "sum" if op is ReduceOp.AVG else op.value)):
                region, offset = placement.region(array.size, array.dtype)   # the copy goes into the set's arena
                if region is not None:
                    array, source = region.reshape(array.shape), array
            if offset is None:
                # the caller may reuse its array at once: a copy, on the array's device
                array = xp.array(array, copy=True, order="C")
            tensor_type, shape = dtype_code(array.dtype), array.shape
        else:
            tensor_type, shape = 0, ()
        future = Future(description=f"{kind} of {name!r}")
        entry = _Entry(name, kind, array, op, root, float(pre), float(post), future, splits, after, offset)
        if source is not None:
            entry.source, entry.copied = source, threading.Event()
        request = self.module.Request(name, KINDS[kind], tensor_type, shape, request_rank=state.rank,
                                      root_rank=root, device=CPU_DEVICE_ID,
                                      reduce_op=OP_CODES[op] if op is not None else 0, prescale_factor=pre,
                                      postscale_factor=post, group_id=group[0], group_size=group[1])
        return Handle(name, kind, future, state.id), entry, request

    def _register(self, state, entries) -> None:
        with state.lock:
            for entry in entries:
                if entry.name in state.table:
                    state.release(entries, queued=False)   # never queued: nothing copies into them
                    raise DuplicateNameError(
                        f"a collective named {entry.name!r} is already in flight on rank {self.rank}; wait for it "
                        "(synchronize) before submitting the name again, or use a different name")
            for entry in entries:
                state.table[entry.name] = entry

    # -- the cycle (background thread) ------------------------------------------------------------------------
    def _loop(self):
        cycle = self.settings["cycle_time_ms"] / 1000.0
        reason = ""
        try:
            while True:
                start = time.perf_counter()
                self.notes.check()               # a peer's failure note: stop in this cycle, with its cause
                response_list = self._cycle(self.world, self.stop.is_set())
                if response_list.shutdown:
                    self.agreed_stop = True      # every rank leaves the loop in this same cycle
                    reason = response_list.shutdown_reason
                    break
                with self.sets_lock:
                    others = [s for i, s in sorted(self.sets.items()) if i != GLOBAL_PROCESS_SET_ID and s.member]
                for state in others:
                    stopped = self._cycle(state, False)
                    if stopped.shutdown:
                        self._stop_set(state, stopped.shutdown_reason)
                remaining = cycle - (time.perf_counter() - start)
                if remaining > 0:
                    time.sleep(remaining)
        except PeerFailed as failure:
            self.error = stopped_by(failure)
        except BaseException as exc:  # noqa: BLE001 - every pending handle must learn about it
            self.error = exc
            if not isinstance(exc, ProcessFailedError):  # a dead process: MPI tells every survivor itself (ULFM)
                self.notes.announce(failure_reason(exc, self.rank))   # and every peer, within the cycle it is in
        finally:
            self._finish(reason)

    def _cycle(self, state, shut_down):
        t0 = now_us() if self.timeline.enabled else 0.0
        # a copy: the reference twin's counters are its live dict
        before = dict(state.controller.counters) if self.timeline.enabled else None
        response_list = state.controller.compute_response_list(state.channel, shut_down, self.stop_reason)
        if self.timeline.enabled:
            self._trace_cycle(state, t0, before, response_list)
        for response in response_list.responses:
            execute(self, state, response)
        return response_list

    def _stop_set(self, state, reason) -> None:
        """A set's coordinator stopped the set (a refused list, its stall inspector): every member drops it."""
        with self.sets_lock:
            self.sets.pop(state.id, None)
        state.fail_all(NotInitializedError(f"process set {state.id} (ranks {state.ranks}) stopped: {reason}"))
        state.group.destroy()

    def _finish(self, reason):
        """Fail every pending handle once, with the error that says who stopped the engine and why."""
        error = self.error
        if error is None:
            reports = self.controller.stall.reports
            if self.stop.is_set():
                error = NotInitializedError("distlab.collectives was shut down with this collective pending")
            elif "stall inspector" in reason:
                error = StallShutdownError(reports[-1] if reports else f"distlab.collectives stopped: {reason}")
            else:
                error = NotInitializedError(f"distlab.collectives stopped: {reason or 'another rank shut it down'}")
            self.error = error
        for state in list(self.sets.values()):
            state.fail_all(error)
        self.stopped.set()

    def _trace_cycle(self, state, t0, before, response_list):
        after = state.controller.counters
        path = "fast" if after["fast_path"] > before["fast_path"] else (
            "slow" if after["slow_path"] > before["slow_path"] else "idle")
        if path == "idle" and not response_list.responses:
            return
        self.timeline.complete(f"negotiate ({path} path)", t0, lane="negotiation", cat="collectives",
                               args={"process_set": state.id, "hits": after["hits"] - before["hits"],
                                     "misses": after["misses"] - before["misses"],
                                     "invalid": after["invalid"] - before["invalid"],
                                     "requeued": after["requeued"] - before["requeued"],
                                     "responses": len(response_list.responses)})
        self.timeline.counter("response cache", {"hits": after["hits"], "misses": after["misses"]})

    # -- process sets (run in the cycle thread, at the same response on every rank) ---------------------------
    def create_process_set(self, masks):
        """The ranks' agreed set (an allgather of membership masks, one row per rank) becomes a process set."""
        masks = np.asarray(masks).reshape(self.size, self.size)
        if not (masks == masks[0]).all():
            differ = [r for r in range(self.size) if not (masks[r] == masks[0]).all()]
            raise ValueError("add_process_set: the ranks asked for different sets: rank 0 asked for "
                             f"{np.flatnonzero(masks[0]).tolist()}, " + ", ".join(
                                 f"rank {r} for {np.flatnonzero(masks[r]).tolist()}" for r in differ))
        ranks = np.flatnonzero(masks[0]).tolist()
        with self.sets_lock:
            for state in self.sets.values():
                if state.id != GLOBAL_PROCESS_SET_ID and state.ranks == ranks:
                    raise ValueError(f"add_process_set: a process set with ranks {ranks} already exists "
                                     f"(id {state.id})")
            process_set_id = self.next_set_id
            self.next_set_id += 1
        group = self.world.group.new_group(ranks, name=f"collectives set {process_set_id}")
        with self.sets_lock:
            self.sets[process_set_id] = _SetState(self, process_set_id, ranks, group)
        return process_set_id, ranks

    def remove_process_set(self, ids):
        """Every rank asked to remove the same set: fail its pending handles and free its group."""
        ids = np.asarray(ids).reshape(-1).tolist()
        if len(set(ids)) != 1:
            raise ValueError(f"remove_process_set: the ranks asked to remove different sets: {ids} (by rank)")
        with self.sets_lock:
            state = self.sets.pop(int(ids[0]), None)
        if state is None:
            raise ValueError(f"remove_process_set: no process set has id {ids[0]}")
        state.fail_all(NotInitializedError(f"process set {state.id} (ranks {state.ranks}) was removed with this "
                                           "collective pending"))
        if state.group is not None:
            state.group.destroy()
        return state.id

    def close(self, timeout, reason):
        self.stop_reason = reason
        self.stop.set()
        if not self.stopped.wait(timeout):
            raise DistlabError(f"distlab.collectives did not shut down within {timeout:g} s: another rank may "
                               "not have called shutdown() and is not cycling")
        self.thread.join(timeout)
        if self.agreed_stop:
            # Freeing communicators is collective: only when every rank stopped in the same cycle (every member
            # of every set stopped with it).
            for state in sorted(self.sets.values(), key=lambda s: -s.id):
                if state.group is not None:
                    state.group.destroy()


#: The running engine of this process (None before init() and after shutdown()), and the lock guarding it.
current: Engine | None = None
lock = threading.Lock()


def get() -> Engine:
    """The running engine, or NotInitializedError saying how to start it."""
    engine = current
    if engine is None:
        raise NotInitializedError("distlab.collectives is not initialized: call collectives.init() on every rank "
                                  "first (or again after shutdown())")
    return engine
