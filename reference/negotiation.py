"""The controller's cycle: from queued requests to the same ``ResponseList`` on every rank.

Twinned with ``core/_negotiation.pyx``, which holds the twins of all three negotiation modules.

Mirrors horovod/common/controller.cc ``Controller::ComputeResponseList``, ``ConstructResponse``,
``FuseResponses`` and ``IncrementTensorCount``. Each cycle:

1. pop this rank's queued requests; look each up in the :class:`ResponseCache` (hit, miss or invalid);
2. sync with every rank through the :class:`CacheCoordinator` (one AND allreduce of a bit vector, plus an OR
   allreduce when some entry is invalid);
3. requests that hit here but not on every rank go back to the queue for the next cycle;
4. *fast path*, when no rank has anything uncached: the responses are the common hits, taken from the cache in
   bit order and fused; no further communication;
5. *slow path* otherwise: every rank sends its uncached requests to rank 0 (a gather); rank 0 counts them per
   name, a tensor is ready when every rank that has not joined sent it; rank 0 validates the requests (an
   inconsistent tensor gets an ERROR response), fuses the ready responses up to the fusion threshold and
   broadcasts the list; every rank then caches the cacheable responses in the same order.

Communication goes through an injectable *transport* with three calls, so the cycle runs without MPI in tests:
``allreduce_bits(words, op)`` (uint64 array, ``"band"``/``"bor"``, in place), ``gather(payload) -> list | None``
(bytes from every rank to rank 0) and ``broadcast(payload) -> bytes`` (from rank 0).

This module re-exports the messages and the cache, so ``distlab.reference.negotiation`` holds the whole twin.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

from distlab._common.negotiation import (
    CACHEABLE_RESPONSE_TYPES,
    COUNTERS,
    HIT,
    INVALID,
    MISS,
    response_error,
    trace_negotiation_start,
)
from distlab._wire import DTYPE_SIZES, JOIN_TENSOR_NAME, RequestType, ResponseType
from distlab._stall import StallInspector
from distlab.reference.messages import Request, RequestList, Response, ResponseList
from distlab.reference.response_cache import CacheCoordinator, ResponseCache, request_params

__all__ = ["Request", "Response", "RequestList", "ResponseList", "ResponseCache", "CacheCoordinator",
           "Controller", "fuse_responses", "request_params", "MISS", "HIT", "INVALID"]

def _size_bytes(response) -> int:
    return response.tensor_sizes[0] * DTYPE_SIZES[response.tensor_type] if response.tensor_sizes else 0


def fuse_responses(responses, threshold: int) -> list:
    """Fuse single-tensor allreduce/adasum responses up to ``threshold`` bytes (mirrors FuseResponses).

    Responses fuse when type, devices, dtype, reduce op and scale factors agree. As Horovod does, a response that
    does not fit is skipped over while the skipped bytes stay under the threshold (look-ahead), then put back.
    Other response types are passed through unfused.
    """
    queue = deque(r.copy() for r in responses)
    out = []
    while queue:
        response = queue.popleft()
        if response.response_type in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
            size = _size_bytes(response)
            skipped = []
            skipped_size = 0
            while queue:
                candidate = queue[0]
                candidate_size = _size_bytes(candidate)
                if (candidate.response_type == response.response_type
                        and candidate.devices == response.devices
                        and candidate.tensor_type == response.tensor_type
                        and candidate.reduce_op == response.reduce_op
                        and size + candidate_size <= threshold
                        and candidate.prescale_factor == response.prescale_factor
                        and candidate.postscale_factor == response.postscale_factor):
                    size += candidate_size
                    response.tensor_names.append(candidate.tensor_names[0])
                    response.tensor_sizes.append(candidate.tensor_sizes[0])
                    queue.popleft()
                else:
                    skipped_size += candidate_size
                    if size + skipped_size <= threshold:
                        skipped.append(queue.popleft())
                    else:
                        break
            queue.extendleft(reversed(skipped))
        out.append(response)
    return out


class Controller:
    """One rank's negotiation state: its queue, its response cache, and (on rank 0) the message table.

    Parameters
    ----------
    rank, size : int
        This rank and the world size.
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
    """

    def __init__(self, rank, size, cache_capacity=1024, fusion_threshold=128 * 1024 * 1024, stall_check_time=60.0,
                 stall_shutdown_time=0.0, timeline=None, clock=None):
        self.rank = int(rank)
        self.size = int(size)
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
        # Coordinator state (rank 0): name -> requests received so far, in order of first arrival.
        self._message_table: OrderedDict[str, list] = OrderedDict()
        self._joined_ranks: list[int] = []

    # -- the queue -------------------------------------------------------------------------------------------
    def enqueue(self, request: Request) -> None:
        """Queue a request for the next cycle (thread-safe; called from the user's thread)."""
        with self._lock:
            self._queue.append(request)

    def queue_length(self) -> int:
        """Requests waiting for the next cycle (requeued hits included)."""
        with self._lock:
            return len(self._queue)

    # -- the cycle -------------------------------------------------------------------------------------------
    def compute_response_list(self, transport, shut_down: bool = False) -> ResponseList:
        """Run one negotiation cycle and return the responses every rank executes, in the same order."""
        counters = self.counters
        counters["cycles"] += 1
        cache = self.cache
        caching = cache.capacity > 0
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()

        coordinator = CacheCoordinator(cache.num_active_bits())
        for request in batch:
            if request.request_type == RequestType.JOIN:
                self.joined = True
                coordinator.set_uncached_in_queue(True)
                continue
            if caching:
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
        if self.joined and caching:
            # A joined rank has every cached allreduce "ready": it contributes zeros (mirrors controller.cc).
            # Other cached collectives cannot run without it: it invalidates them, so that they go to the
            # coordinator, which answers with an error (Horovod leaves them waiting for the stall inspector).
            for bit in cache.list_all_bits():
                if cache.peek_response(bit).response_type in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
                    coordinator.record_hit(bit)
                else:
                    coordinator.record_invalid_bit(bit)

        should_shut_down = bool(shut_down)
        if self.stall.should_check():
            if self.rank == 0:
                should_shut_down |= self.stall.check(self._joined_ranks)
            if caching:
                # Cached tensors held back too long go through the coordinator, whose report names the ranks.
                for name in self.stall.stalled_cached_names():
                    try:
                        coordinator.record_invalid_bit(cache.peek_cache_bit(name))
                    except Exception:  # noqa: BLE001 - evicted meanwhile
                        pass
                    self.stall.remove_cached(name)
            self.stall.update_check_time()
        coordinator.set_should_shut_down(should_shut_down)

        uncached = batch
        if caching:
            coordinator.sync(transport.allreduce_bits)
            for bit in coordinator.invalid_bits:
                cache.erase_response(bit)
            common = set(coordinator.cache_hits)
            uncached = []
            requeue = []
            for request in batch:
                if request.request_type != RequestType.JOIN and cache.cached(request) == HIT:
                    if cache.peek_cache_bit(request) not in common:
                        requeue.append(request)          # ready here, not everywhere: try again next cycle
                        self.stall.record_cached(request.tensor_name)
                    else:
                        self.stall.remove_cached(request.tensor_name)
                else:
                    uncached.append(request)
            if requeue:
                counters["requeued"] += len(requeue)
                with self._lock:
                    self._queue.extendleft(reversed(requeue))

        response_list = ResponseList(shutdown=coordinator.should_shut_down)
        # Fast path only when no rank has anything uncached or invalidated (an erased entry's request is uncached
        # now and must reach the coordinator).
        if caching and not coordinator.uncached_in_queue and not coordinator.invalid_in_queue:
            if not coordinator.cache_hits:
                counters["idle"] += 1
                return response_list
            counters["fast_path"] += 1
            # Every rank calls get_response in the same order, so the LRU order stays identical everywhere.
            hits = [cache.get_response(bit) for bit in coordinator.cache_hits]
            response_list.responses = fuse_responses(hits, self.fusion_threshold)
            self._finish(response_list)
            cache.update_cache_bits()
            return response_list

        counters["slow_path"] += 1
        for request in uncached:
            # Remember what we sent: ``put`` caches the response with these parameters when it comes back.
            self._pending[request.tensor_name] = request
        mine = RequestList(uncached, shutdown=should_shut_down).to_bytes()
        gathered = transport.gather(mine)
        if self.rank == 0:
            response_list = self._coordinate(gathered, coordinator, caching)
            payload = transport.broadcast(response_list.to_bytes())
        else:
            payload = transport.broadcast(None)
        response_list = ResponseList.from_bytes(payload)
        if caching:
            # All ranks cache the same responses in the same order (mirrors the end of ComputeResponseList).
            for response in response_list.responses:
                if response.response_type in CACHEABLE_RESPONSE_TYPES and len(response.devices) == self.size:
                    cache.put(response, self._pending, joined=self.joined)
        self._finish(response_list)
        cache.update_cache_bits()
        return response_list

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

    # -- rank 0 ----------------------------------------------------------------------------------------------
    def _coordinate(self, gathered, coordinator, caching) -> ResponseList:
        """Count requests, find the ready tensors, build and fuse their responses (rank 0's slow path)."""
        ready: list[str] = []
        should_shut_down = coordinator.should_shut_down
        for payload in gathered:
            request_list = RequestList.from_bytes(payload)
            should_shut_down |= request_list.shutdown
            for request in request_list.requests:
                if request.request_type == RequestType.JOIN:
                    if request.request_rank not in self._joined_ranks:
                        self._joined_ranks.append(request.request_rank)
                    continue
                if self._increment_tensor_count(request):
                    ready.append(request.tensor_name)
        joined_size = len(self._joined_ranks)
        if joined_size:
            # Tensors from earlier cycles may be ready now that more ranks have joined.
            for name, requests in self._message_table.items():
                if len(requests) == self.size - joined_size and name not in ready:
                    ready.append(name)
        responses = []
        if caching and joined_size < self.size:
            # Common hits first, least recently used first; peek keeps rank 0's LRU order like everyone's.
            responses.extend(self.cache.peek_response(bit) for bit in coordinator.cache_hits)
        responses.extend(self._construct_response(name, joined_size) for name in ready)
        fused = fuse_responses(responses, self.fusion_threshold)
        if joined_size == self.size:
            fused.append(Response(ResponseType.JOIN, [JOIN_TENSOR_NAME], last_joined_rank=self._joined_ranks[-1]))
            self._joined_ranks = []
        return ResponseList(fused, shutdown=should_shut_down)

    def _increment_tensor_count(self, request) -> bool:
        """Record one rank's request; True when every rank that has not joined sent it (IncrementTensorCount)."""
        name = request.tensor_name
        requests = self._message_table.get(name)
        if requests is None:
            requests = self._message_table[name] = []
            trace_negotiation_start(self.timeline, name, request.request_type)
        requests.append(request)
        self.stall.record_uncached(name, request.request_rank, request.request_type)
        return len(requests) == self.size - len(self._joined_ranks)

    def _construct_response(self, name, joined_size) -> Response:
        """Validate the requests for ``name`` and build its response, or an ERROR (mirrors ConstructResponse)."""
        requests = sorted(self._message_table.pop(name), key=lambda r: r.request_rank)
        self.stall.remove_uncached(name)
        first = requests[0]
        error = response_error(name, requests, self._joined_ranks)
        if error is not None:
            return Response(ResponseType.ERROR, [name], first.tensor_type, error_message=error,
                            devices=[r.device for r in requests])
        # By rank when every rank took part; shorter when some joined (then the response is not cached).
        devices = [r.device for r in requests]
        kind = first.request_type
        sizes = []
        if kind in (RequestType.ALLGATHER, RequestType.ALLTOALL):
            sizes = [0] * self.size             # allgather: each rank's first dimension, by rank
            for r in requests:
                sizes[r.request_rank] = r.tensor_shape[0]
        elif kind in (RequestType.ALLREDUCE, RequestType.ADASUM):
            count = 1                           # allreduce: the element count
            for d in first.tensor_shape:
                count *= d
            sizes = [count]
        return Response(kind, [name], first.tensor_type, devices=devices, tensor_sizes=sizes,
                        prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
                        reduce_op=first.reduce_op)
