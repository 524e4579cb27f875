# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.negotiation` (read that module, and reference/messages.py and
reference/response_cache.py, for the explanation).

One extension holds what the reference splits into three modules (messages, response_cache, negotiation), so the
controller can reach the cache's C++ containers: the messages and the cache are included from
``_negotiation_messages.pxi`` and ``_negotiation_cache.pxi``. The hit path (lookups, bit vector, LRU updates,
fusion) runs on C++ containers without creating Python objects per tensor.
"""
import sys
import warnings
from collections import OrderedDict, deque

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy
from libcpp.deque cimport deque as cppdeque
from libcpp.list cimport list as cpplist
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref, preincrement as inc, predecrement as dec

from distlab._negotiation_shared import (
    CACHEABLE_RESPONSE_TYPES,
    CPU_DEVICE_ID,
    DTYPE_SIZES,
    FLAG_SHUTDOWN,
    JOIN_TENSOR_NAME,
    REDUCE_OPS,
    REQUEST_MAGIC,
    REQUEST_TYPE_NAMES,
    RESPONSE_MAGIC,
    RESPONSE_TYPE_NAMES,
    WIRE_VERSION,
    CacheEvictionWarning,
    CacheStateError,
    MessageFormatError,
    RequestType,
    ResponseType,
    dtype_name,
    eviction_warning_text,
    joined_phrase,
)
from distlab._stall import StallInspector

cdef extern from *:
    int __builtin_ctzll(unsigned long long)
    int __builtin_popcountll(unsigned long long)

cdef enum:
    S_MISS = 0
    S_HIT = 1
    S_INVALID = 2
    SHOULD_SHUT_DOWN = 0
    UNCACHED_IN_QUEUE = 1
    INVALID_IN_QUEUE = 2
    NUM_STATUS_BITS = 3
    RT_ALLREDUCE = 0
    RT_JOIN = 3
    RT_ADASUM = 4

MISS, HIT, INVALID = S_MISS, S_HIT, S_INVALID

__all__ = ["Request", "Response", "RequestList", "ResponseList", "ResponseCache", "CacheCoordinator",
           "Controller", "fuse_responses", "request_params", "MISS", "HIT", "INVALID"]

include "_negotiation_messages.pxi"

cdef long long _DTYPE_SIZE[64]
for _i, _s in enumerate(DTYPE_SIZES):
    _DTYPE_SIZE[_i] = _s

_COUNTERS = ("cycles", "fast_path", "slow_path", "idle", "hits", "misses", "invalid", "requeued", "responses",
             "fused_tensors")


cdef inline long long _size_bytes(Response r):
    if not r.tensor_sizes:
        return 0
    return (<long long>r.tensor_sizes[0]) * (_DTYPE_SIZE[r.tensor_type] if 0 <= r.tensor_type < 64 else 0)


include "_negotiation_cache.pxi"

def fuse_responses(responses, threshold):
    """See :func:`distlab.reference.negotiation.fuse_responses`."""
    cdef long long limit = threshold, size, skipped_size, candidate_size
    cdef Response response, candidate
    queue = deque([(<Response>r).copy() for r in responses])
    out = []
    while queue:
        response = queue.popleft()
        if response.response_type == RT_ALLREDUCE or response.response_type == RT_ADASUM:
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
                        and size + candidate_size <= limit
                        and candidate.prescale_factor == response.prescale_factor
                        and candidate.postscale_factor == response.postscale_factor):
                    size += candidate_size
                    response.tensor_names.append(candidate.tensor_names[0])
                    response.tensor_sizes.append(candidate.tensor_sizes[0])
                    queue.popleft()
                else:
                    skipped_size += candidate_size
                    if size + skipped_size <= limit:
                        skipped.append(queue.popleft())
                    else:
                        break
            queue.extendleft(reversed(skipped))
        out.append(response)
    return out


cdef size_t _popcount(vector[uint64_t]& words):
    cdef size_t total = 0
    cdef uint64_t w
    for w in words:
        total += __builtin_popcountll(w)
    return total


cdef list _fuse_slots(ResponseCache cache, vector[int]& slots, long long limit):
    """fuse_responses over cache slots (the fast path): C comparisons, one Response per fused group."""
    cdef cppdeque[int] queue
    cdef vector[int] skipped
    cdef int slot, cand
    cdef long long size, skipped_size, cand_size
    cdef Response fused
    cdef list out = []
    cdef list names, sizes
    cdef size_t k
    cdef _RespInfo* first
    cdef _RespInfo* ci
    for slot in slots:
        queue.push_back(slot)
    while not queue.empty():
        slot = queue.front()
        queue.pop_front()
        fused = (<Response>cache._responses[slot]).copy()
        first = &cache._info[slot]
        if first.rtype == RT_ALLREDUCE or first.rtype == RT_ADASUM:
            names = fused.tensor_names
            sizes = fused.tensor_sizes
            size = first.nbytes
            skipped.clear()
            skipped_size = 0
            while not queue.empty():
                cand = queue.front()
                ci = &cache._info[cand]
                cand_size = ci.nbytes
                if (ci.rtype == first.rtype and ci.dtype == first.dtype and ci.op == first.op
                        and size + cand_size <= limit and ci.pre == first.pre and ci.post == first.post
                        and ci.devices_id == first.devices_id):
                    size += cand_size
                    names.append(cache._pynames[cand])
                    sizes.append(cache._pysizes[cand])
                    queue.pop_front()
                else:
                    skipped_size += cand_size
                    if size + skipped_size <= limit:
                        skipped.push_back(cand)
                        queue.pop_front()
                    else:
                        break
            for k in range(skipped.size()):
                queue.push_front(skipped[skipped.size() - 1 - k])
        out.append(fused)
    return out


cdef class Controller:
    """See :class:`distlab.reference.negotiation.Controller`."""

    cdef public int rank, size
    cdef public long long fusion_threshold
    cdef public ResponseCache cache
    cdef public object timeline, stall
    cdef public bint joined
    cdef long long _c[10]
    cdef list _queue
    cdef dict _pending
    cdef object _message_table
    cdef list _joined_ranks
    # The last fast-path fusion, reused while the same slots hit in an unchanged cache (see _fast_path_responses)
    cdef vector[int] _memo_slots
    cdef uint64_t _memo_epoch
    cdef long long _memo_threshold
    cdef list _memo_fused

    def __init__(self, rank, size, cache_capacity=1024, fusion_threshold=128 * 1024 * 1024, stall_check_time=60.0,
                 stall_shutdown_time=0.0, timeline=None, clock=None):
        self.rank = rank
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.cache = ResponseCache(cache_capacity)
        self.timeline = timeline
        self.stall = StallInspector(self.size, stall_check_time, stall_shutdown_time,
                                    **({"clock": clock} if clock else {}))
        self.joined = False
        for i in range(10):
            self._c[i] = 0
        self._queue = []
        self._pending = {}
        self._message_table = OrderedDict()
        self._joined_ranks = []
        self._memo_epoch = 0
        self._memo_fused = None

    @property
    def counters(self):
        """See :attr:`distlab.reference.negotiation.Controller.counters`."""
        return {name: self._c[i] for i, name in enumerate(_COUNTERS)}

    def enqueue(self, Request request):
        """See :meth:`distlab.reference.negotiation.Controller.enqueue`."""
        # No lock: the append and the cycle's swap of the queue are each one C step under the GIL.
        self._queue.append(request)

    def queue_length(self):
        """See :meth:`distlab.reference.negotiation.Controller.queue_length`."""
        return len(self._queue)

    def compute_response_list(self, transport, shut_down=False):
        """See :meth:`distlab.reference.negotiation.Controller.compute_response_list`."""
        cdef ResponseCache cache = self.cache
        cdef bint caching = cache._capacity > 0
        cdef list batch
        cdef Py_ssize_t i, n
        cdef Request request
        cdef uint32_t bit
        cdef int state
        cdef vector[int] states
        cdef vector[uint32_t] bits
        cdef CacheCoordinator coordinator
        cdef bint should_shut_down, erased = False
        cdef list uncached, requeue
        cdef vector[int] slots
        cdef uint64_t word
        cdef size_t w, k
        cdef long long hits_before, local_hits
        cdef bint in_order
        self._c[0] += 1
        batch = self._queue          # atomic under the GIL (no Python code runs between these two steps)
        self._queue = []
        n = len(batch)
        coordinator = CacheCoordinator(cache._bit_slot.size())
        states.resize(n)
        bits.resize(n)
        hits_before = self._c[4]
        bit = 0     # _state leaves it unset on a miss
        for i in range(n):
            request = <Request>batch[i]
            if request.request_type == RT_JOIN:
                self.joined = True
                coordinator._uncached_in_queue = True
                states[i] = S_MISS
                continue
            if caching:
                state = cache._state(request, &bit)
                states[i] = state
                bits[i] = bit
                if state == S_HIT:
                    coordinator._hit(bit)
                    self._c[4] += 1
                else:
                    if state == S_INVALID:
                        coordinator.record_invalid_bit(bit)
                        self._c[6] += 1
                    coordinator._uncached_in_queue = True
                    self._c[5] += 1
                    self.stall.remove_cached(request._name)
            else:
                states[i] = S_MISS
        if self.joined and caching:
            for w in range(cache._bit_slot.size()):
                if cache._bit_slot[w] >= 0:
                    if cache._info[cache._bit_slot[w]].rtype == RT_ALLREDUCE or \
                            cache._info[cache._bit_slot[w]].rtype == RT_ADASUM:
                        coordinator._hit(<uint32_t>w)
                    else:
                        coordinator.record_invalid_bit(w)

        should_shut_down = shut_down
        if self.stall.should_check():
            if self.rank == 0:
                should_shut_down |= self.stall.check(self._joined_ranks)
            if caching:
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
            if coordinator._invalid_in_queue:
                for b in coordinator.invalid_bits:
                    cache.erase_response(b)
                    erased = True
            uncached = []
            requeue = []
            tracking = bool(self.stall._cached)
            local_hits = self._c[4] - hits_before
            if (not erased and not tracking and local_hits == n
                    and _popcount(coordinator._hits) == <size_t>local_hits):
                n = 0       # every request hit here and everywhere: nothing to requeue or send
            for i in range(n):
                request = <Request>batch[i]
                if erased and request.request_type != RT_JOIN:
                    states[i] = cache._state(request, &bits[i])
                if states[i] == S_HIT:
                    bit = bits[i]
                    if not (coordinator._hits[bit >> 6] >> (bit & 63)) & 1:
                        requeue.append(request)
                        self.stall.record_cached(request._name)
                    elif tracking:
                        self.stall.remove_cached(request._name)
                else:
                    uncached.append(request)
            if requeue:
                self._c[7] += len(requeue)
                self._queue[0:0] = requeue

        response_list = ResponseList([], coordinator._should_shut_down)
        if caching and not coordinator._uncached_in_queue and not coordinator._invalid_in_queue:
            in_order = not cache._bits_outdated
            for w in range(coordinator._hits.size()):
                word = coordinator._hits[w]
                while word:
                    bit = <uint32_t>(w * 64 + __builtin_ctzll(word))
                    word &= word - 1
                    slots.push_back(cache._bit_slot[bit])
            if slots.empty():
                self._c[3] += 1
                return response_list
            if not (in_order and slots.size() == cache._lru.size() and slots.size() == cache._bit_slot.size()):
                for k in range(slots.size()):
                    cache._touch(cache._slot_bit[slots[k]])
            # else every entry hit, and bit order is LRU order: touching them all in bit order (get_response in
            # the reference) would leave the LRU order, hence every bit, as it is.
            self._c[1] += 1
            response_list.responses = self._fast_path_responses(slots)
            self._finish(response_list)
            cache.update_cache_bits()
            return response_list

        self._c[2] += 1
        for request in uncached:
            self._pending[request._name] = request
        mine = RequestList(uncached, should_shut_down).to_bytes()
        gathered = transport.gather(mine)
        if self.rank == 0:
            response_list = self._coordinate(gathered, coordinator, caching)
            payload = transport.broadcast(response_list.to_bytes())
        else:
            payload = transport.broadcast(None)
        response_list = ResponseList.from_bytes(payload)
        if caching:
            for response in response_list.responses:
                if (<Response>response).response_type in CACHEABLE_RESPONSE_TYPES and \
                        len((<Response>response).devices) == self.size:
                    cache.put(response, self._pending, self.joined)
        self._finish(response_list)
        cache.update_cache_bits()
        return response_list

    cdef list _fast_path_responses(self, vector[int]& slots):
        """fuse_responses over the hit slots, reusing the last result when it cannot differ.

        Fusion depends only on the responses in the slots, their order and the threshold. The cache's epoch
        changes whenever an entry is put, erased or renumbered, so an equal epoch, equal slots and an equal
        threshold give an equal fusion: a training loop that submits the same gradients every step fuses once.
        """
        cdef Response response
        if not (self._memo_fused is not None and self.cache._epoch == self._memo_epoch
                and self.fusion_threshold == self._memo_threshold and slots == self._memo_slots):
            self._memo_fused = _fuse_slots(self.cache, slots, self.fusion_threshold)
            self._memo_slots = slots
            self._memo_threshold = self.fusion_threshold
            self.cache.update_cache_bits()
            self._memo_epoch = self.cache._epoch
        return [response.copy() for response in self._memo_fused]

    cdef _finish(self, ResponseList response_list):
        cdef Response response
        for response in response_list.responses:
            self._c[8] += 1
            self._c[9] += len(response.tensor_names)
            if response.response_type == RT_JOIN:
                self.joined = False
                self._pending.pop(JOIN_TENSOR_NAME, None)
            if self._pending:
                for name in response.tensor_names:
                    self._pending.pop(name, None)

    # -- rank 0 ----------------------------------------------------------------------------------------------
    cdef ResponseList _coordinate(self, gathered, CacheCoordinator coordinator, bint caching):
        cdef list ready = []
        cdef bint should_shut_down = coordinator._should_shut_down
        cdef Request request
        for payload in gathered:
            request_list = RequestList.from_bytes(payload)
            should_shut_down |= request_list.shutdown
            for request in request_list.requests:
                if request.request_type == RT_JOIN:
                    if request.request_rank not in self._joined_ranks:
                        self._joined_ranks.append(request.request_rank)
                    continue
                if self._increment_tensor_count(request):
                    ready.append(request._name)
        joined_size = len(self._joined_ranks)
        if joined_size:
            for name, requests in self._message_table.items():
                if len(requests) == self.size - joined_size and name not in ready:
                    ready.append(name)
        responses = []
        if caching and joined_size < self.size:
            responses.extend(self.cache.peek_response(bit) for bit in coordinator.cache_hits)
        responses.extend(self._construct_response(name, joined_size) for name in ready)
        fused = fuse_responses(responses, self.fusion_threshold)
        if joined_size == self.size:
            fused.append(Response(ResponseType.JOIN, [JOIN_TENSOR_NAME], last_joined_rank=self._joined_ranks[len(self._joined_ranks) - 1]))
            self._joined_ranks = []
        return ResponseList(fused, should_shut_down)

    cdef bint _increment_tensor_count(self, Request request):
        name = request._name
        requests = self._message_table.get(name)
        if requests is None:
            requests = self._message_table[name] = []
            if self.timeline is not None:
                self.timeline.instant(f"negotiate {name}", lane="negotiation",
                                      args={"type": REQUEST_TYPE_NAMES[request.request_type]})
        requests.append(request)
        self.stall.record_uncached(name, request.request_rank, request.request_type)
        return len(requests) == self.size - len(self._joined_ranks)

    cdef Response _construct_response(self, name, int joined_size):
        requests = sorted(self._message_table.pop(name), key=lambda r: r.request_rank)
        self.stall.remove_uncached(name)
        cdef Request first = requests[0]
        # When every rank sent the same parameters no check can fail: skip building their descriptions.
        cdef bint uniform = _uniform(requests)
        kind = first.request_type
        kind_name = REQUEST_TYPE_NAMES[kind]
        error = None if uniform else _first_mismatch(name, requests, [
            ("operations", lambda r: REQUEST_TYPE_NAMES[r.request_type]),
            ("data types", lambda r: dtype_name(r.tensor_type)),
        ])
        if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.BROADCAST):
            error = None if uniform else _first_mismatch(name, requests, [("shapes", lambda r: _shape(r.tensor_shape))])
        if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM):
            error = None if uniform else _first_mismatch(name, requests, [
                ("reduce ops", lambda r: REDUCE_OPS[r.reduce_op] or "none"),
                ("prescale/postscale factors", lambda r: f"({r.prescale_factor:g}, {r.postscale_factor:g})"),
            ])
        sizes = []
        if error is None and kind in (RequestType.ALLGATHER, RequestType.ALLTOALL):
            if joined_size > 0:
                error = (f"{kind_name} of {name!r} is not supported once a rank has joined "
                         f"({joined_phrase(self._joined_ranks)}); only allreduce works with join")
            elif len(first.tensor_shape) == 0:
                error = f"rank {first.request_rank} tried to {kind_name} {name!r}, a 0-dimensional array"
            else:
                error = None if uniform else _first_mismatch(name, requests, [
                    ("shapes beyond the first dimension",
                     lambda r: f"[*, {', '.join(map(str, r.tensor_shape[1:]))}]")])
            if error is None:
                sizes = [0] * self.size
                for r in requests:
                    sizes[r.request_rank] = r.tensor_shape[0]
        if error is None and kind == RequestType.BROADCAST:
            if joined_size > 0:
                error = (f"broadcast of {name!r} is not supported once a rank has joined "
                         f"({joined_phrase(self._joined_ranks)})")
            else:
                error = None if uniform else _first_mismatch(name, requests, [("root ranks", lambda r: f"root {r.root_rank}")])
        if error is None:
            error = None if uniform else _first_mismatch(name, requests, [
                ("devices", lambda r: "CPU" if r.device == CPU_DEVICE_ID else f"GPU {r.device}")])
        if error is not None:
            return Response(ResponseType.ERROR, [name], first.tensor_type, error_message=error,
                            devices=[r.device for r in requests])
        devices = [r.device for r in requests]
        if kind in (RequestType.ALLREDUCE, RequestType.ADASUM):
            count = 1
            for d in first.tensor_shape:
                count *= d
            sizes = [count]
        return Response(kind, [name], first.tensor_type, devices=devices, tensor_sizes=sizes,
                        prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
                        reduce_op=first.reduce_op)


cdef bint _uniform(list requests):
    cdef Request first = requests[0]
    cdef Request r
    cdef Py_ssize_t i
    for i in range(1, len(requests)):
        r = requests[i]
        if not (r.request_type == first.request_type and r.tensor_type == first.tensor_type
                and r._cshape == first._cshape and r.reduce_op == first.reduce_op
                and r.prescale_factor == first.prescale_factor and r.postscale_factor == first.postscale_factor
                and r.root_rank == first.root_rank and r.device == first.device):
            return False
    return True


def _shape(shape):
    return f"[{', '.join(map(str, shape))}]"


def _first_mismatch(name, requests, checks):
    for label, describe in checks:
        groups = {}
        for r in requests:
            groups.setdefault(describe(r), []).append(r.request_rank)
        if len(groups) > 1:
            parts = []
            for value, ranks in groups.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                parts.append(f"{who} sent {value}")
            kind = REQUEST_TYPE_NAMES[requests[0].request_type]
            return f"Mismatched {label} for tensor {name!r} ({kind}): " + "; ".join(parts) + "."
    return None
