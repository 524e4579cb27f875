"""The controller's cycle: from queued requests to the same ``ResponseList`` on every rank.

Twinned with ``core/_negotiation.pyx``, which includes the twins of the other negotiation modules.

Mirrors horovod/common/controller.cc ``Controller::ComputeResponseList``, split into its steps as there (the
coordinator's ``ConstructResponse``, ``FuseResponses`` and ``IncrementTensorCount`` are in
:mod:`~distlab.reference.coordinator`). Each cycle, in both twins:

1. ``_look_up``: pop this rank's queued requests; look each up in the :class:`ResponseCache` (hit, miss or
   invalid) and tell the :class:`CacheCoordinator`;
2. ``_check_for_stalls``: the stall inspector's check (and shutdown), and the shutdown flag;
3. ``_coordinate_cache_and_state``: sync with every rank through the :class:`CacheCoordinator` (one AND allreduce
   of a bit vector, plus an OR allreduce when some entry is invalid), and erase the invalid entries;
4. ``_requeue_uncommon_hits``: requests that hit here but not on every rank go back to the queue for the next
   cycle;
5. ``_fast_path``, when no rank has anything uncached: the responses are the common hits, taken from the cache in
   bit order and fused; no further communication;
6. ``_slow_path`` otherwise: every rank sends its uncached requests to rank 0 (a gather), whose
   :class:`~distlab.reference.coordinator.Coordinator` finds the ready tensors, validates and fuses their
   responses and broadcasts the list; every rank then caches the cacheable responses in the same order.

A *group* (``grouped_allreduce``) runs as one: its members are one response, whatever the fusion threshold, and
only once every member is ready on every rank; ranks that disagree on its members get one error for the whole
group. A rank that wants to stop sends its reason through the slow path, so that every rank can say who stopped
and why. Each process set has its own controller (``process_set_id``) and cache.

Communication goes through an injectable *channel* with three calls, so the cycle runs without MPI in tests:
``allreduce_bits(words, op)`` (uint64 array, ``"band"``/``"bor"``, in place), ``gather(payload) -> list | None``
(bytes from every rank to rank 0) and ``broadcast(payload) -> bytes`` (from rank 0).

This module re-exports the messages and the cache, so ``distlab.reference.negotiation`` holds the whole twin.
"""
from __future__ import annotations

import threading
from collections import deque

from distlab._common.negotiation import (
    CACHEABLE_RESPONSE_TYPES,
    COUNTERS,
    HIT,
    INVALID,
    MISS,
    coordinator_failed_reason,
    process_set_error,
)
from distlab._common.stall import StallInspector
from distlab._wire import GLOBAL_PROCESS_SET_ID, JOIN_TENSOR_NAME, NO_GROUP, RequestType, ResponseType
from distlab.reference.coordinator import Coordinator, fuse_responses
from distlab.reference.messages import Request, RequestList, Response, ResponseList
from distlab.reference.response_cache import CacheCoordinator, ResponseCache, request_params

__all__ = ["Request", "Response", "RequestList", "ResponseList", "ResponseCache", "CacheCoordinator",
           "Controller", "fuse_responses", "request_params", "MISS", "HIT", "INVALID"]


class Controller:
    """One rank's negotiation state: its queue, its response cache, and (on rank 0) the message table.

    Parameters
    ----------
    rank, size : int
        This rank and the number of ranks (in the process set).
    cache_capacity : int
        Response cache capacity (``DISTLAB_CACHE_CAPACITY``, default 1024; 0 disables the cache).
    fusion_threshold : int
        Fusion buffer size in bytes (``DISTLAB_FUSION_THRESHOLD``, default 128 MiB).
    stall_check_time, stall_shutdown_time : float
        Stall inspector settings in seconds (``DISTLAB_STALL_CHECK_TIME`` = 60, ``DISTLAB_STALL_SHUTDOWN_TIME`` = 0).
    timeline : distlab.timeline.Timeline, optional
        Where negotiation events go.
    clock : callable, optional
        Monotonic clock for the stall inspector (tests inject one).
    process_set_id : int
        The process set this controller negotiates for (0: every rank); its messages carry it.
    """

    def __init__(self, rank, size, cache_capacity=1024, fusion_threshold=128 * 1024 * 1024, stall_check_time=60.0,
                 stall_shutdown_time=0.0, timeline=None, clock=None, process_set_id=GLOBAL_PROCESS_SET_ID):
        self.rank = int(rank)
        self.size = int(size)
        self.process_set_id = int(process_set_id)
        self.fusion_threshold = int(fusion_threshold)
        self.cache = ResponseCache(cache_capacity)
        self.timeline = timeline
        self.stall = StallInspector(self.size, stall_check_time, stall_shutdown_time,
                                    **({"clock": clock} if clock else {}))
        self.joined = False
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._pending: dict[str, Request] = {}             # popped requests still waiting for a response
        #: Rank 0's side of the slow path (None on the other ranks).
        self.coordinator = (Coordinator(self.size, self.process_set_id, self.fusion_threshold, self.stall, timeline)
                            if self.rank == 0 else None)

    # -- the queue -------------------------------------------------------------------------------------------
    def enqueue(self, request: Request) -> None:
        """Queue a request for the next cycle (thread-safe; called from the user's thread)."""
        with self._lock:
            self._queue.append(request)

    def enqueue_group(self, requests) -> None:
        """Queue the requests of one group at once, so that no cycle sees part of a group (thread-safe)."""
        with self._lock:
            self._queue.extend(requests)

    def queue_length(self) -> int:
        """Requests waiting for the next cycle (requeued hits included)."""
        with self._lock:
            return len(self._queue)

    # -- the cycle -------------------------------------------------------------------------------------------
    def compute_response_list(self, channel, shut_down: bool = False, shutdown_reason: str = "") -> ResponseList:
        """Run one negotiation cycle and return the responses every rank executes, in the same order.

        ``shut_down`` asks every rank to stop after this cycle; ``shutdown_reason`` says why (a predicate of
        this rank, ``"called shutdown()"``), and reaches every rank in the ResponseList's ``shutdown_reason``.
        The steps are numbered as the module docstring numbers them (mirrors ``ComputeResponseList``).
        """
        self.counters["cycles"] += 1
        coordinator = CacheCoordinator(self.cache.num_active_bits())
        batch = self._look_up(coordinator)                                                               # 1
        stopping = self._check_for_stalls(coordinator, shut_down, shutdown_reason)                       # 2
        uncached = batch
        if self.cache.capacity > 0:
            self._coordinate_cache_and_state(coordinator, channel)                                       # 3
            uncached = self._requeue_uncommon_hits(batch, coordinator)                                   # 4
            # An erased entry's request is uncached now and must reach the coordinator: fast path only when no rank
            # has anything uncached or invalidated
            if not coordinator.uncached_in_queue and not coordinator.invalid_in_queue:
                return self._fast_path(coordinator)                                                      # 5
        return self._slow_path(uncached, stopping, coordinator, channel)                                 # 6

    def _look_up(self, coordinator) -> list:
        """1. Pop this rank's queued requests and look each up in the cache: hits, invalid entries and uncached
        requests go to ``coordinator`` (mirrors the message loop of ``ComputeResponseList``). Returns them."""
        counters, cache = self.counters, self.cache
        caching = cache.capacity > 0
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        states = []
        for request in batch:
            state = MISS
            if request.request_type == RequestType.JOIN:
                self.joined = True
                coordinator.set_uncached_in_queue(True)
            elif caching:
                state = cache.cached(request)
                if state == HIT:
                    coordinator.record_hit(cache.peek_cache_bit(request))
                    counters["hits"] += 1
                else:
                    if state == INVALID:
                        coordinator.record_invalid_bit(cache.peek_cache_bit(request))
                        counters["invalid"] += 1
                    coordinator.set_uncached_in_queue(True)
                    counters["misses"] += 1
                    self.stall.remove_cached(request.tensor_name)
            states.append(state)
        if caching:
            self._invalidate_partial_groups(batch, states, coordinator)
        if self.joined and caching:
            # A joined rank has every cached allreduce "ready": it contributes zeros (mirrors controller.cc).
            # Other cached collectives cannot run without it: it invalidates them, so that they go to the
            # coordinator, which answers with an error (Horovod leaves them waiting for the stall inspector).
            for bit in cache.list_all_bits():
                if cache.peek_response(bit).response_type in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
                    coordinator.record_hit(bit)
                else:
                    coordinator.record_invalid_bit(bit)
        return batch

    def _check_for_stalls(self, coordinator, shut_down: bool, shutdown_reason: str) -> str | None:
        """2. Check for stalled tensors (rank 0 reports them, and may shut the job down), push cached tensors held
        back too long onto the slow path, and set the shutdown flag. Returns why this rank stops (``""``: no
        reason given), None when it does not (the coordinator's flag becomes every rank's at the sync)."""
        should_shut_down = bool(shut_down)
        reason = str(shutdown_reason) if should_shut_down else ""
        if self.stall.should_check():
            if self.coordinator is not None and self.stall.check(self.coordinator.joined_ranks):
                should_shut_down = True
                reason = reason or self.stall.shutdown_reason
            if self.cache.capacity > 0:
                # Cached tensors held back too long go through the coordinator, whose report names the ranks
                # (mirrors InvalidateStalledCachedTensors).
                for name in self.stall.stalled_cached_names():
                    try:
                        coordinator.record_invalid_bit(self.cache.peek_cache_bit(name))
                    except Exception:  # noqa: BLE001 - evicted meanwhile
                        pass
                    self.stall.remove_cached(name)
            self.stall.update_check_time()
        coordinator.set_should_shut_down(should_shut_down)
        if should_shut_down:
            # Only the slow path carries a reason: every rank takes it, and learns from rank 0 who stopped and why.
            coordinator.set_uncached_in_queue(True)
        return reason if should_shut_down else None

    def _coordinate_cache_and_state(self, coordinator, channel) -> None:
        """3. Agree with every rank on the common hits and the status flags (one AND allreduce of the bit vector,
        an OR allreduce when some entry is invalid), and erase the entries invalid anywhere (mirrors
        ``CoordinateCacheAndState``)."""
        coordinator.sync(channel.allreduce_bits)
        for bit in coordinator.invalid_bits:
            self.cache.erase_response(bit)

    def _requeue_uncommon_hits(self, batch, coordinator) -> list:
        """4. Requests that hit here but not on every rank go back to the queue for the next cycle; returns the
        requests not in the cache (what the slow path sends)."""
        cache, stall = self.cache, self.stall
        uncached, requeue = [], []
        for request in batch:
            if request.request_type != RequestType.JOIN and cache.cached(request) == HIT:
                if not coordinator.common_hit(cache.peek_cache_bit(request)):
                    requeue.append(request)              # ready here, not everywhere: try again next cycle
                    stall.record_cached(request.tensor_name)
                else:
                    stall.remove_cached(request.tensor_name)
            else:
                uncached.append(request)
        if requeue:
            self.counters["requeued"] += len(requeue)
            with self._lock:
                self._queue.extendleft(reversed(requeue))
        return uncached

    def _fast_path(self, coordinator) -> ResponseList:
        """5. No rank has anything uncached: the responses are the common hits, taken from the cache in bit order
        and fused; no further communication (an idle cycle when nothing hit)."""
        response_list = ResponseList(shutdown=coordinator.should_shut_down, process_set_id=self.process_set_id)
        fused = self.cache.fused_hits(coordinator, self.fusion_threshold)
        if fused is None:
            self.counters["idle"] += 1
            return response_list
        self.counters["fast_path"] += 1
        response_list.responses = fused
        self._finish(response_list)
        self.cache.update_cache_bits()
        return response_list

    def _slow_path(self, uncached, stopping: str | None, coordinator, channel) -> ResponseList:
        """6. Every rank sends its uncached requests to rank 0, whose coordinator answers with the responses every
        rank runs (mirrors SendReadyTensors, RecvReadyTensors, SendFinalTensors and RecvFinalTensors); every rank
        then caches the cacheable responses, in the same order. ``stopping``: this rank's reason to stop, as
        ``_check_for_stalls`` returned it."""
        self.counters["slow_path"] += 1
        cache = self.cache
        for request in uncached:
            # Remember what we sent: ``put`` caches the response with these parameters when it comes back.
            self._pending[request.tensor_name] = request
        mine = RequestList(uncached, stopping is not None, stopping or "", self.process_set_id).to_bytes()
        gathered = channel.gather(mine)
        if self.coordinator is not None:
            self.coordinator.fusion_threshold = self.fusion_threshold
            try:
                payload = self.coordinator.coordinate(gathered, cache, coordinator.cache_hits).to_bytes()
            except Exception as error:  # noqa: BLE001 - the others wait in the broadcast: stop them, saying why
                payload = ResponseList(shutdown=True, shutdown_reason=coordinator_failed_reason(error),
                                       process_set_id=self.process_set_id).to_bytes()
            payload = channel.broadcast(payload)
        else:
            payload = channel.broadcast(None)
        response_list = ResponseList.from_bytes(payload)
        if response_list.process_set_id != self.process_set_id:
            raise process_set_error("response list", response_list.process_set_id, self.process_set_id)
        if cache.capacity > 0:
            # All ranks cache the same responses in the same order (mirrors the end of ComputeResponseList).
            for response in response_list.responses:
                if response.response_type in CACHEABLE_RESPONSE_TYPES and len(response.devices) == self.size:
                    cache.put(response, self._pending, joined=self.joined)
        self._finish(response_list)
        cache.update_cache_bits()
        return response_list

    def _invalidate_partial_groups(self, batch, states, coordinator) -> None:
        """A group is cached all or nothing: if a member misses here, its cached members are invalidated.

        Every rank then erases them and the whole group goes to the coordinator together, so that no group is
        split between the cache's fast path and the coordinator.
        """
        partial = {r.group_id for r, s in zip(batch, states) if r.group_id != NO_GROUP and s != HIT}
        for request, state in zip(batch, states):
            if state == HIT and request.group_id in partial:
                coordinator.record_invalid_bit(self.cache.peek_cache_bit(request))

    def _finish(self, response_list) -> None:
        counters = self.counters
        for response in response_list.responses:
            counters["responses"] += 1
            counters["fused_tensors"] += len(response.tensor_names)
            if response.response_type == ResponseType.JOIN:
                self.joined = False
                self._pending.pop(JOIN_TENSOR_NAME, None)
            for name in response.tensor_names:
                self._pending.pop(name, None)
