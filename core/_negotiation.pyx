# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.negotiation` (read that module, and reference/messages.py,
reference/response_cache.py and reference/coordinator.py, for the explanation).

One extension holds what the reference splits into four modules (messages, response_cache, coordinator,
negotiation), so the controller can reach the cache's C++ containers: the messages and the cache are included from
``_negotiation_messages.pxi`` and ``_negotiation_cache.pxi``, in the reference's reading order. The hit path
(lookups, bit vector, LRU updates, fusion) runs on C++ containers without creating Python objects per tensor;
what formats errors or validates the coordinator's requests is shared with the reference
(:mod:`distlab._common.negotiation`).
"""
import sys
import threading
import warnings

import numpy as np

cimport cython
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.math cimport isfinite
from libc.string cimport memcmp, memcpy
from libcpp.deque cimport deque as cppdeque
from libcpp.list cimport list as cpplist
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref, predecrement as dec, preincrement as inc

from distlab._common.negotiation import (
    MAX_TENSOR_BYTES,
    CACHEABLE_RESPONSE_TYPES,
    COUNTERS,
    cache_error,
    check_capacity,
    coordinator_failed_reason,
    device_error,
    dimension_error,
    eviction_warning_text,
    format_error,
    group_member_error,
    group_mismatch_error,
    group_name_of,
    group_size_error,
    list_field_error,
    list_repr,
    process_set_error,
    refused_list_reason,
    request_field_error,
    request_repr,
    response_error,
    response_field_error,
    response_repr,
    sender_error,
    shape_size_error,
    shutdown_reason_text,
    size_error,
    trace_negotiation_start,
)
from distlab._common import negotiation as _shared
from distlab import _wire
from distlab._wire import (
    CPU_DEVICE_ID,
    DTYPE_SIZES,
    JOIN_TENSOR_NAME,
    LIST_HEADER,
    REQUEST_HEAD,
    REQUEST_MAGIC,
    RESPONSE_HEAD,
    RESPONSE_MAGIC,
    RequestType,
    ResponseType,
)
from distlab._common.stall import StallInspector
from distlab.errors import CacheEvictionWarning, MessageFormatError

cdef extern from *:
    int __builtin_ctzll(unsigned long long)
    int __builtin_popcountll(unsigned long long)

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyBytes_FromStringAndSize(const char* v, Py_ssize_t n)

# The C mirrors of the shared codes (asserted equal below, at import).
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
    NEGOTIATION_WIRE_VERSION = 2
    FLAG_SHUTDOWN = 1
    LIST_FLAGS = 1
    VERSION_OFFSET = 4
    GLOBAL_PROCESS_SET_ID = 0
    NO_GROUP = -1
    CPU_DEVICE = -1
    _NUM_REQUEST_TYPES = 8
    _NUM_RESPONSE_TYPES = 9
    _NUM_DTYPES = 15
    _MAX_REDUCE_OP = 5
    MAX_DTYPES = 64

_C_CONSTANTS = {
    (_shared.MISS, _shared.HIT, _shared.INVALID): (S_MISS, S_HIT, S_INVALID),
    (_wire.SHOULD_SHUT_DOWN, _wire.UNCACHED_IN_QUEUE, _wire.INVALID_IN_QUEUE, _wire.NUM_STATUS_BITS):
        (SHOULD_SHUT_DOWN, UNCACHED_IN_QUEUE, INVALID_IN_QUEUE, NUM_STATUS_BITS),
    (RequestType.ALLREDUCE, RequestType.JOIN, RequestType.ADASUM): (RT_ALLREDUCE, RT_JOIN, RT_ADASUM),
    (_wire.NEGOTIATION_WIRE_VERSION, _wire.FLAG_SHUTDOWN, _wire.LIST_FLAGS, _wire.VERSION_OFFSET):
        (NEGOTIATION_WIRE_VERSION, FLAG_SHUTDOWN, LIST_FLAGS, VERSION_OFFSET),
    (_wire.GLOBAL_PROCESS_SET_ID, _wire.NO_GROUP, _wire.CPU_DEVICE_ID): (GLOBAL_PROCESS_SET_ID, NO_GROUP, CPU_DEVICE),
    (len(_wire.REQUEST_TYPE_NAMES), len(_wire.RESPONSE_TYPE_NAMES), len(_wire.DTYPE_NAMES),
     _wire.NEGOTIATED_REDUCE_OP_MAX): (_NUM_REQUEST_TYPES, _NUM_RESPONSE_TYPES, _NUM_DTYPES, _MAX_REDUCE_OP),
}
for _python, _c in _C_CONSTANTS.items():
    assert _python == _c, f"distlab.core._negotiation is out of date with the shared constants: {_python} != {_c}"
assert len(DTYPE_SIZES) <= MAX_DTYPES
assert MAX_TENSOR_BYTES == INT64_MAX, "a request's byte count must fit the core's int64"
if sys.byteorder != "little":  # the wire format is little-endian and written with memcpy
    raise ImportError("the distlab core negotiation twin needs a little-endian machine; use DISTLAB_IMPL=reference")

# Struct sizes come from the shared layouts (the parsers read fields at the offsets those layouts define).
cdef Py_ssize_t _LIST_HEADER_SIZE = LIST_HEADER.size
cdef Py_ssize_t _REQUEST_HEAD_SIZE = REQUEST_HEAD.size
cdef Py_ssize_t _RESPONSE_HEAD_SIZE = RESPONSE_HEAD.size
assert (_LIST_HEADER_SIZE, _REQUEST_HEAD_SIZE, _RESPONSE_HEAD_SIZE) == (16, 42, 32), "wire layout changed"
cdef bytes _MAGIC_RQ = REQUEST_MAGIC
cdef bytes _MAGIC_RS = RESPONSE_MAGIC
cdef long long _DTYPE_SIZE[MAX_DTYPES]
for _code, _itemsize in enumerate(DTYPE_SIZES):
    _DTYPE_SIZE[_code] = _itemsize


cdef struct _Reader:
    # a parse cursor over one message's bytes
    const char* p
    Py_ssize_t n
    Py_ssize_t pos


cdef struct _Params:
    # what a cache hit must match (reference: request_params), with the first dims inline
    int ndim
    int64_t dims[8]
    int rtype
    int dtype
    int device
    int op
    int group_id
    int group_size
    bint joined
    bint known
    double pre
    double post
    vector[int64_t] shape


cdef struct _RespInfo:
    # what fusion compares, kept in C so the fast path touches no Python object per tensor
    int rtype
    int dtype
    int op
    double pre
    double post
    long long nbytes
    int devices_id          # devices lists are interned: equal lists <=> equal ids
    int group_id


cdef struct _Counters:
    long long cycles, fast_path, slow_path, idle, hits, misses, invalid, requeued, responses, fused_tensors


MISS, HIT, INVALID = S_MISS, S_HIT, S_INVALID

__all__ = ["Request", "Response", "RequestList", "ResponseList", "ResponseCache", "CacheCoordinator",
           "Controller", "fuse_responses", "request_params", "MISS", "HIT", "INVALID"]

include "_negotiation_messages.pxi"
include "_negotiation_cache.pxi"


# -- rank 0's side of the slow path (reference: coordinator.py) ---------------------------------------------------
cdef inline long long _size_bytes(Response response):
    """See :func:`distlab.reference.coordinator._size_bytes`."""
    if not response.tensor_sizes or not 0 <= response.tensor_type < MAX_DTYPES:
        return 0
    return (<long long>response.tensor_sizes[0]) * _DTYPE_SIZE[response.tensor_type]


def fuse_responses(responses, threshold):
    """See :func:`distlab.reference.coordinator.fuse_responses`."""
    cdef list items = [(<Response?>r).copy() for r in responses]
    cdef vector[_RespInfo] info
    cdef vector[int] order, group_start, members
    cdef Py_ssize_t i, n = len(items)
    info.resize(n)
    for i in range(n):
        _fill_info(&info[i], <Response>items[i])
        order.push_back(i)
    _fuse_plan(info, order, threshold, group_start, members)
    return [_fused_response(items, group_start, members, i, None) for i in range(<Py_ssize_t>group_start.size() - 1)]


cdef class Coordinator:
    """See :class:`distlab.reference.coordinator.Coordinator`."""

    cdef public int size, process_set_id
    cdef public long long fusion_threshold
    cdef public object stall, timeline
    cdef public list joined_ranks
    cdef dict _message_table        # name -> [Request], insertion-ordered (first arrival)
    cdef dict _groups               # group id -> _Group

    def __init__(self, size, process_set_id, fusion_threshold, stall, timeline=None):
        self.size = size
        self.process_set_id = process_set_id
        self.fusion_threshold = fusion_threshold
        self.stall = stall
        self.timeline = timeline
        self.joined_ranks = []
        self._message_table = {}
        self._groups = {}

    cpdef ResponseList coordinate(self, list gathered, ResponseCache cache, list cache_hits):
        """See :meth:`distlab.reference.coordinator.Coordinator.coordinate`."""
        cdef list ready = [], responses = [], fused
        cdef dict reasons = {}
        cdef RequestList request_list
        cdef Request request
        cdef Py_ssize_t sender
        cdef int joined_size, group_id
        cdef _Group group
        for sender in range(len(gathered)):
            try:
                request_list = self._checked_request_list(sender, gathered[sender])
            except MessageFormatError as error:
                return ResponseList([], True, refused_list_reason(sender, error), self.process_set_id)
            if request_list.shutdown:
                reasons[sender] = request_list.shutdown_reason
            for request in request_list.requests:
                if request.request_type == RT_JOIN:
                    if request.request_rank not in self.joined_ranks:
                        self.joined_ranks.append(request.request_rank)
                elif self._increment_tensor_count(request):
                    ready.append(request._name)
        joined_size = len(self.joined_ranks)
        if joined_size:
            # tensors of earlier cycles may be ready now that more ranks have joined
            for name, requests in self._message_table.items():
                if len(<list>requests) == self.size - joined_size and name not in ready:
                    ready.append(name)
        if joined_size < self.size:
            for bit in cache_hits:          # common hits first; peek keeps rank 0's LRU order like everyone's
                responses.append(cache._responses[_slot_at(cache, bit)])
        for name in ready:
            group_id = (<Request>(<list>self._message_table[name])[0]).group_id
            if group_id == NO_GROUP:
                responses.append(self._construct_response(name, joined_size))
            else:
                group = <_Group>self._groups[group_id]
                if name not in group.ready:
                    group.ready.append(name)
        responses.extend(self._ready_groups(joined_size))
        fused = fuse_responses(responses, self.fusion_threshold)
        if joined_size == self.size:
            fused.append(Response(ResponseType.JOIN, [JOIN_TENSOR_NAME], last_joined_rank=self.joined_ranks[-1]))
            self.joined_ranks = []
        return ResponseList(fused, len(reasons) > 0, shutdown_reason_text(reasons) if reasons else "",
                            self.process_set_id)

    cdef RequestList _checked_request_list(self, Py_ssize_t sender, payload):
        cdef RequestList request_list = RequestList.from_bytes(payload)
        cdef Request request
        if request_list.process_set_id != self.process_set_id:
            raise process_set_error("request list", request_list.process_set_id, self.process_set_id)
        for request in request_list.requests:
            if request.request_rank != sender:
                raise sender_error(sender, request._name, request.request_rank)
        return request_list

    cdef bint _increment_tensor_count(self, Request request) except -1:
        cdef list requests = self._message_table.get(request._name)
        cdef _Group group
        if requests is None:
            requests = self._message_table[request._name] = []
            trace_negotiation_start(self.timeline, request._name, request.request_type)
        requests.append(request)
        if request.group_id != NO_GROUP:
            group = self._groups.get(request.group_id)
            if group is None:
                group = self._groups[request.group_id] = _Group()
            group.sizes[request.request_rank] = request.group_size
        self.stall.record_uncached(request._name, request.request_rank, request.request_type)
        return len(requests) == self.size - len(self.joined_ranks)

    cdef list _ready_groups(self, int joined_size):
        cdef list out = [], names, members
        cdef _Group group
        cdef Response member
        cdef set sizes
        for group_id in list(self._groups):
            group = <_Group>self._groups[group_id]
            if len(group.sizes) < self.size - joined_size:
                continue                                    # a rank has not submitted the group yet
            sizes = set(group.sizes.values())
            if len(sizes) == 1 and len(group.ready) < <int>next(iter(sizes)):
                continue                                    # a member is still missing: the group waits
            del self._groups[group_id]
            names = group.ready + [n for n in self._message_table
                                   if (<Request>self._message_table[n][0]).group_id == group_id
                                   and n not in group.ready]
            if len(sizes) > 1:
                for name in names:
                    self._message_table.pop(name, None)
                    self.stall.remove_uncached(name)
                out.append(Response(ResponseType.ERROR, names, 0, group_size_error(group_name_of(names[0]),
                                                                                    group.sizes),
                                    group_id=group_id))
                continue
            members = [self._construct_response(name, joined_size) for name in names]
            error = None
            for member in members:
                if member.response_type == ResponseType.ERROR:
                    error = group_member_error(group_name_of(names[0]), member.error_message)
                    break
            else:
                error = group_mismatch_error(group_name_of(names[0]), members)
            if error:
                member = members[0]
                out.append(Response(ResponseType.ERROR, names, member.tensor_type, error, member.devices,
                                    group_id=group_id))
            else:
                out.extend(members)
        return out

    cdef Response _construct_response(self, name, int joined_size):
        cdef list requests = sorted(self._message_table.pop(name), key=_request_rank)
        cdef Request first = requests[0]
        cdef Request r
        cdef int i, kind = first.request_type
        cdef long long count
        cdef list sizes
        self.stall.remove_uncached(name)
        # every rank sent the same parameters for an allreduce: no check can fail, skip building their texts
        error = None if _reduces(kind) and _uniform(requests) else response_error(name, requests, self.joined_ranks)
        if error is not None:
            return Response(ResponseType.ERROR, [name], first.tensor_type, error, [r.device for r in requests],
                            group_id=first.group_id)
        if _reduces(kind) or kind == RequestType.REDUCESCATTER:
            count = 1
            for i in range(first._ndim):
                count *= first._cshape[i]
            sizes = [count]
        elif kind == RequestType.ALLGATHER or kind == RequestType.ALLTOALL:
            sizes = [0] * self.size
            for r in requests:
                sizes[r.request_rank] = r._cshape[0]
        else:
            sizes = []
        return Response(kind, [name], first.tensor_type, devices=[r.device for r in requests], tensor_sizes=sizes,
                        prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
                        reduce_op=first.reduce_op, group_id=first.group_id)


cdef class Controller:
    """See :class:`distlab.reference.negotiation.Controller`."""

    cdef public int rank, size, process_set_id
    cdef public long long fusion_threshold
    cdef public ResponseCache cache
    cdef public object timeline, stall
    cdef public Coordinator coordinator
    cdef public bint joined
    cdef _Counters _counts
    cdef object _lock
    cdef list _queue
    cdef dict _pending
    # The last fast-path fusion, reused while the same slots hit in an unchanged cache (see _fast_path_responses)
    cdef vector[int] _memo_slots
    cdef uint64_t _memo_epoch
    cdef long long _memo_threshold
    cdef list _memo_fused

    def __init__(self, rank, size, cache_capacity=1024, fusion_threshold=128 * 1024 * 1024, stall_check_time=60.0,
                 stall_shutdown_time=0.0, timeline=None, clock=None, process_set_id=_wire.GLOBAL_PROCESS_SET_ID):
        self.rank = rank
        self.size = size
        self.process_set_id = process_set_id
        self.fusion_threshold = fusion_threshold
        self.cache = ResponseCache(cache_capacity)
        self.timeline = timeline
        self.stall = StallInspector(size, stall_check_time, stall_shutdown_time, **({"clock": clock} if clock else {}))
        self._lock = threading.Lock()
        self._queue = []
        self._pending = {}
        if rank == 0:
            self.coordinator = Coordinator(size, process_set_id, fusion_threshold, self.stall, timeline)

    @property
    def counters(self):
        """See :attr:`distlab.reference.negotiation.Controller.counters`."""
        return dict(zip(COUNTERS, (self._counts.cycles, self._counts.fast_path, self._counts.slow_path,
                                   self._counts.idle, self._counts.hits, self._counts.misses, self._counts.invalid,
                                   self._counts.requeued, self._counts.responses, self._counts.fused_tensors)))

    cpdef enqueue(self, Request request):
        """See :meth:`distlab.reference.negotiation.Controller.enqueue`."""
        with self._lock:
            self._queue.append(request)

    def enqueue_group(self, requests):
        """See :meth:`distlab.reference.negotiation.Controller.enqueue_group`."""
        cdef list checked = [<Request?>request for request in requests]
        with self._lock:
            self._queue.extend(checked)

    def queue_length(self):
        """See :meth:`distlab.reference.negotiation.Controller.queue_length`."""
        with self._lock:
            return len(self._queue)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def compute_response_list(self, transport, shut_down=False, shutdown_reason=""):
        """See :meth:`distlab.reference.negotiation.Controller.compute_response_list`."""
        # i < n == len(batch) == states.size() == bits.size() on every indexing below
        cdef ResponseCache cache = self.cache
        cdef bint caching = cache._capacity > 0
        cdef list batch, uncached, requeue
        cdef Py_ssize_t i, n
        cdef Request request
        cdef int state
        cdef uint32_t bit = 0
        cdef vector[int] states
        cdef vector[uint32_t] bits
        cdef CacheCoordinator coordinator
        cdef bint should_shut_down, erased = False, tracking, grouped = False
        cdef str reason
        cdef long long hits_before
        cdef ResponseList response_list
        self._counts.cycles += 1
        with self._lock:
            batch = self._queue
            self._queue = []
        n = len(batch)

        # 1. look every request up in the cache
        coordinator = CacheCoordinator(cache._bit_slot.size())
        states.resize(n, S_MISS)
        bits.resize(n, 0)
        hits_before = self._counts.hits
        for i in range(n):
            request = <Request>batch[i]
            if request.request_type == RT_JOIN:
                self.joined = True
                coordinator._uncached_in_queue = True
                continue
            grouped |= request.group_id != NO_GROUP
            if caching:
                state = _cache_state(cache, request, &bit)
                states[i] = state
                bits[i] = bit
                if state == S_HIT:
                    coordinator._hits[bit >> 6] |= (<uint64_t>1) << (bit & 63)
                    self._counts.hits += 1
                else:
                    if state == S_INVALID:
                        coordinator.record_invalid_bit(bit)
                        self._counts.invalid += 1
                    coordinator._uncached_in_queue = True
                    self._counts.misses += 1
                    self.stall.remove_cached(request._name)
        if grouped and caching:
            self._invalidate_partial_groups(batch, states, bits, coordinator)
        if self.joined and caching:
            # a joined rank: every cached allreduce is "ready" (zeros), every other cached collective invalid
            for bit in range(cache._bit_slot.size()):
                if cache._bit_slot[bit] >= 0:
                    if _reduces(cache._info[cache._bit_slot[bit]].rtype):
                        coordinator._hits[bit >> 6] |= (<uint64_t>1) << (bit & 63)
                    else:
                        coordinator.record_invalid_bit(bit)

        # 2. stall check (shared inspector), then the shutdown flag
        should_shut_down = shut_down
        reason = str(shutdown_reason) if should_shut_down else ""
        if self.stall.should_check():
            if self.coordinator is not None and self.stall.check(self.coordinator.joined_ranks):
                should_shut_down = True
                reason = reason or self.stall.shutdown_reason
            if caching:
                for name in self.stall.stalled_cached_names():
                    if cache._name_to_bit.count(_utf8(name)):
                        coordinator.record_invalid_bit(cache._name_to_bit[_utf8(name)])
                    self.stall.remove_cached(name)
            self.stall.update_check_time()
        coordinator._should_shut_down = should_shut_down
        if should_shut_down:
            coordinator._uncached_in_queue = True      # the reason travels on the slow path

        # 3. sync the bit vector; erase invalid entries; requeue hits that are not common
        uncached = batch
        if caching:
            coordinator.sync(transport.allreduce_bits)
            if coordinator._invalid_in_queue:
                for bit in coordinator.invalid_bits:
                    cache.erase_response(bit)
                    erased = True
            uncached = []
            requeue = []
            tracking = bool(self.stall._cached)
            if (not erased and not tracking and self._counts.hits - hits_before == n
                    and _popcount(coordinator._hits) == <size_t>n):
                n = 0       # every request hit here and everywhere: nothing to requeue or send
            for i in range(n):
                request = <Request>batch[i]
                if erased and request.request_type != RT_JOIN:
                    states[i] = _cache_state(cache, request, &bits[i])
                if states[i] == S_HIT:
                    bit = bits[i]
                    if not (coordinator._hits[bit >> 6] >> (bit & 63)) & 1:
                        requeue.append(request)     # ready here, not everywhere: try again next cycle
                        self.stall.record_cached(request._name)
                    elif tracking:
                        self.stall.remove_cached(request._name)
                else:
                    uncached.append(request)
            if requeue:
                self._counts.requeued += len(requeue)
                with self._lock:
                    self._queue[0:0] = requeue

        # 4. fast path: the common hits in bit order, fused
        response_list = ResponseList.__new__(ResponseList)
        response_list.responses = []
        response_list.shutdown = coordinator._should_shut_down
        response_list.shutdown_reason = ""
        response_list.process_set_id = self.process_set_id
        if caching and not coordinator._uncached_in_queue and not coordinator._invalid_in_queue:
            if not self._fast_path(response_list, coordinator):
                self._counts.idle += 1
                return response_list
            self._counts.fast_path += 1
            self._finish(response_list)
            cache.update_cache_bits()
            return response_list

        # 5. slow path: gather request lists on rank 0, which coordinates and broadcasts the responses
        self._counts.slow_path += 1
        for request in uncached:
            self._pending[request._name] = request
        mine = RequestList(uncached, should_shut_down, reason, self.process_set_id).to_bytes()
        gathered = transport.gather(mine)
        if self.coordinator is not None:
            self.coordinator.fusion_threshold = self.fusion_threshold
            try:
                payload = self.coordinator.coordinate(list(gathered), cache, coordinator.cache_hits).to_bytes()
            except Exception as error:
                payload = ResponseList([], True, coordinator_failed_reason(error), self.process_set_id).to_bytes()
            payload = transport.broadcast(payload)
        else:
            payload = transport.broadcast(None)
        response_list = ResponseList.from_bytes(payload)
        if response_list.process_set_id != self.process_set_id:
            raise process_set_error("response list", response_list.process_set_id, self.process_set_id)
        if caching:
            for response in response_list.responses:
                if (<Response>response).response_type in CACHEABLE_RESPONSE_TYPES and \
                        len((<Response>response).devices) == self.size:
                    cache.put(response, self._pending, self.joined)
        self._finish(response_list)
        cache.update_cache_bits()
        return response_list

    cdef int _invalidate_partial_groups(self, list batch, vector[int]& states, vector[uint32_t]& bits,
                                        CacheCoordinator coordinator) except -1:
        """See :meth:`distlab.reference.negotiation.Controller._invalidate_partial_groups`."""
        cdef set partial = set()
        cdef Request request
        cdef Py_ssize_t i
        for i in range(len(batch)):
            request = <Request>batch[i]
            if request.group_id != NO_GROUP and states[i] != S_HIT:
                partial.add(request.group_id)
        if partial:
            for i in range(len(batch)):
                request = <Request>batch[i]
                if states[i] == S_HIT and request.group_id in partial:
                    coordinator.record_invalid_bit(bits[i])
        return 0

    cdef _finish(self, ResponseList response_list):
        cdef Response response
        for response in response_list.responses:
            self._counts.responses += 1
            self._counts.fused_tensors += len(response.tensor_names)
            if response.response_type == RT_JOIN:
                self.joined = False
                self._pending.pop(JOIN_TENSOR_NAME, None)
            if self._pending:
                for name in response.tensor_names:
                    self._pending.pop(name, None)

    cdef bint _fast_path(self, ResponseList response_list, CacheCoordinator coordinator) except -1:
        """The fast path's responses: the common hits in bit order, their LRU touched in that order, fused.

        Returns False when there is nothing to run (an idle cycle).
        """
        cdef ResponseCache cache = self.cache
        cdef vector[int] slots
        cdef uint64_t word
        cdef uint32_t bit
        cdef size_t w, k
        cdef bint in_order = not cache._bits_outdated
        for w in range(coordinator._hits.size()):
            word = coordinator._hits[w]
            while word:
                bit = <uint32_t>(w * 64 + __builtin_ctzll(word))
                word &= word - 1
                slots.push_back(cache._bit_slot[bit])
        if slots.empty():
            return False
        # every entry hit and bit order is LRU order: touching them all in bit order (get_response in the
        # reference) would leave the LRU order, hence every bit, as it is
        if not (in_order and slots.size() == cache._lru.size() and slots.size() == cache._bit_slot.size()):
            for k in range(slots.size()):
                _touch(cache, cache._slot_bit[slots[k]])
        response_list.responses = self._fast_path_responses(slots)
        return True

    cdef list _fast_path_responses(self, vector[int]& slots):
        """fuse_responses over the hit slots, reusing the last result when it cannot differ.

        Fusion depends only on the responses in the slots, their order and the threshold. The cache's epoch
        changes whenever an entry is put, erased or renumbered, so an equal epoch, equal slots and an equal
        threshold give an equal fusion: a training loop that submits the same gradients every step fuses once.
        """
        cdef Response response
        cdef vector[int] group_start, members
        cdef Py_ssize_t i
        if not (self._memo_fused is not None and self.cache._epoch == self._memo_epoch
                and self.fusion_threshold == self._memo_threshold and slots == self._memo_slots):
            _fuse_plan(self.cache._info, slots, self.fusion_threshold, group_start, members)
            self._memo_fused = [_fused_response(self.cache._responses, group_start, members, i, self.cache)
                                for i in range(<Py_ssize_t>group_start.size() - 1)]
            self._memo_slots = slots
            self._memo_threshold = self.fusion_threshold
            self.cache.update_cache_bits()
            self._memo_epoch = self.cache._epoch
        return [response.copy() for response in self._memo_fused]


# --- core-only helpers ---------------------------------------------------------------------------------------
cdef inline void _w(string& buf, const void* p, size_t n):
    buf.append(<const char*>p, n)


cdef inline string _utf8(object text) except *:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(text, &n)
    return string(p, <size_t>n)


cdef inline bint _reduces(int request_type):
    return request_type == RT_ALLREDUCE or request_type == RT_ADASUM


def _request_rank(Request request):
    return request.request_rank


cdef bint _uniform(list requests):
    """Every rank sent the same type, dtype, shape, op, scale factors, root and device."""
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


cdef size_t _popcount(vector[uint64_t]& words):
    cdef size_t total = 0
    cdef uint64_t w
    for w in words:
        total += __builtin_popcountll(w)
    return total


cdef int _fuse_plan(const vector[_RespInfo]& info, const vector[int]& order, long long limit,
                    vector[int]& group_start, vector[int]& members) except -1:
    """fuse_responses' grouping over C records: members[group_start[g]:group_start[g + 1]] is group g.

    A group's members all join its first member, whatever the threshold. Other allreduce/adasum responses fuse
    while type, devices, dtype, op and scale factors agree, they belong to no group, and the bytes stay under
    ``limit``; a response that does not fit is skipped over while the skipped bytes also fit (look-ahead).
    """
    cdef cppdeque[int] queue, rest
    cdef vector[int] skipped
    cdef int head, cand
    cdef long long size, skipped_size
    cdef size_t k
    cdef const _RespInfo* first
    cdef const _RespInfo* ci
    for k in range(order.size()):
        queue.push_back(order[k])
    group_start.clear()
    members.clear()
    while not queue.empty():
        head = queue.front()
        queue.pop_front()
        group_start.push_back(members.size())
        members.push_back(head)
        first = &info[head]
        if first.group_id != NO_GROUP:
            rest.clear()
            while not queue.empty():
                cand = queue.front()
                queue.pop_front()
                if info[cand].group_id == first.group_id:
                    members.push_back(cand)
                else:
                    rest.push_back(cand)
            queue.swap(rest)
            continue
        if not _reduces(first.rtype):
            continue
        size = first.nbytes
        skipped.clear()
        skipped_size = 0
        while not queue.empty():
            cand = queue.front()
            ci = &info[cand]
            if (ci.rtype == first.rtype and ci.group_id == NO_GROUP and ci.devices_id == first.devices_id
                    and ci.dtype == first.dtype and ci.op == first.op and ci.nbytes <= limit - size
                    and ci.pre == first.pre and ci.post == first.post):
                size += ci.nbytes
                members.push_back(cand)
                queue.pop_front()
            else:
                if ci.nbytes > limit - size - skipped_size:
                    break
                skipped_size += ci.nbytes
                skipped.push_back(cand)
                queue.pop_front()
        for k in range(skipped.size()):
            queue.push_front(skipped[skipped.size() - 1 - k])
    group_start.push_back(members.size())
    return 0


cdef Response _fused_response(list responses, vector[int]& group_start, vector[int]& members, Py_ssize_t g,
                              ResponseCache cache):
    """Group ``g`` of a fusion plan as one Response (a copy of its first member with every name and size)."""
    cdef int k, index
    cdef Response fused = (<Response>responses[members[group_start[g]]]).copy()
    for k in range(group_start[g] + 1, group_start[g + 1]):
        index = members[k]
        if cache is not None:       # the cache keeps each slot's name and size as Python objects
            fused.tensor_names.append(cache._pynames[index])
            fused.tensor_sizes.append(cache._pysizes[index])
        else:
            fused.tensor_names.append((<Response>responses[index]).tensor_names[0])
            fused.tensor_sizes.append((<Response>responses[index]).tensor_sizes[0])
    return fused


cdef dict _DEVICE_IDS = {}
cdef Request _BLANK_REQUEST = Request()


cdef int _fill_info(_RespInfo* info, Response response) except -1:
    info.rtype = response.response_type
    info.dtype = response.tensor_type
    info.op = response.reduce_op
    info.pre = response.prescale_factor
    info.post = response.postscale_factor
    info.nbytes = _size_bytes(response)
    info.group_id = response.group_id
    key = tuple(response.devices)
    devices_id = _DEVICE_IDS.get(key)
    if devices_id is None:
        devices_id = _DEVICE_IDS[key] = len(_DEVICE_IDS)
    info.devices_id = devices_id
    return 0


cdef inline bint _same_shape(_Params& a, Request r):
    cdef int i
    if a.ndim != r._ndim:
        return False
    if a.ndim > 8:
        return a.shape == r._cshape
    for i in range(a.ndim):
        if a.dims[i] != r._dims[i]:
            return False
    return True


cdef inline bint _params_match(_Params& a, Request r):
    # the HIT condition (mirrors response_cache.cc cached(), plus op and scale factors)
    return (a.joined or (a.rtype == r.request_type and a.dtype == r.tensor_type and _same_shape(a, r)
                         and a.device == r.device and a.op == r.reduce_op and a.pre == r.prescale_factor
                         and a.post == r.postscale_factor and a.group_id == r.group_id
                         and a.group_size == r.group_size))


cdef inline bint _params_equal(_Params& a, _Params& b):
    return (a.joined or b.joined or (a.rtype == b.rtype and a.dtype == b.dtype and a.shape == b.shape
                                     and a.device == b.device and a.op == b.op and a.pre == b.pre
                                     and a.post == b.post and a.group_id == b.group_id
                                     and a.group_size == b.group_size))


cdef _Params _params_of(Request r):
    cdef _Params p
    p.rtype = r.request_type
    p.dtype = r.tensor_type
    p.device = r.device
    p.op = r.reduce_op
    p.joined = False
    p.known = True
    p.pre = r.prescale_factor
    p.post = r.postscale_factor
    p.group_id = r.group_id
    p.group_size = r.group_size
    p.shape = r._cshape
    p.ndim = r._ndim
    memcpy(p.dims, r._dims, sizeof(p.dims))    # a Request's dims beyond its ndim are zero
    return p


# Every state of every cache's name -> bit mapping gets a number never used before (0 = none), so a Request can
# remember "in mapping state E my name had bit B (or none)" and skip the hash lookup while E is current. No lock:
# the increment is one C statement under the GIL (no Python code runs between its read and its write).
cdef uint64_t _EPOCHS = 0
cdef uint32_t _NO_BIT = 0xFFFFFFFF


cdef inline uint64_t _new_epoch():
    global _EPOCHS
    _EPOCHS += 1
    return _EPOCHS


cdef inline int _cache_state(ResponseCache cache, Request r, uint32_t* bit):
    """ResponseCache.cached() without the Python call; sets ``bit`` on HIT and INVALID."""
    cdef uint32_t b
    if r._hint_epoch == cache._epoch:
        b = r._hint_bit
    else:
        it = cache._name_to_bit.find(r._cname)
        b = _NO_BIT if it == cache._name_to_bit.end() else deref(it).second
        r._hint_epoch = cache._epoch
        r._hint_bit = b
    if b == _NO_BIT:
        return S_MISS
    bit[0] = b
    return S_HIT if _params_match(cache._params[cache._bit_slot[b]], r) else S_INVALID


cdef int _slot_at(ResponseCache cache, long bit) except -1:
    """The slot holding ``bit`` (the reference's _name_at); CacheStateError for a hole or an unknown bit."""
    if bit < 0 or bit >= <long>cache._bit_slot.size() or cache._bit_slot[bit] < 0:
        raise cache_error("no_entry", bit=bit, active=cache._bit_slot.size())
    return cache._bit_slot[bit]


cdef inline void _touch(ResponseCache cache, uint32_t bit):
    # move to most recently used: splice relinks the node (no allocation; the bit's iterator stays valid)
    cache._lru.splice(cache._lru.end(), cache._lru, cache._bit_iters[bit])
    cache._bits_outdated = True


cdef int _free_slot(ResponseCache cache) except -1:
    """A free slot for a new entry: a recycled one, or a new one appended to every per-slot array."""
    cdef int slot
    cdef _Params blank = _params_of(_BLANK_REQUEST)
    if cache._free.size():
        slot = cache._free.back()
        cache._free.pop_back()
        return slot
    slot = cache._params.size()
    cache._params.push_back(blank)
    cache._info.push_back(_RespInfo(0, 0, 0, 0.0, 0.0, 0, 0, NO_GROUP))
    cache._names.push_back(string())
    cache._slot_bit.push_back(0)
    cache._responses.append(None)
    cache._pynames.append(None)
    cache._pysizes.append(None)
    return slot


cdef class _Group:
    # rank 0's state of one pending group: each rank's group size, and the members ready so far
    cdef dict sizes
    cdef list ready

    def __cinit__(self):
        self.sizes = {}
        self.ready = []


cdef inline bint _request_head_ok(Request r):
    """Every field of a parsed request head in its range (the shared request_field_error names the first that
    is not, in the same order)."""
    return (r.request_rank >= 0 and r.request_type < _NUM_REQUEST_TYPES and r.tensor_type < _NUM_DTYPES
            and r.reduce_op <= _MAX_REDUCE_OP and r.root_rank >= 0 and r.device >= CPU_DEVICE
            and r.group_id >= NO_GROUP and r.group_size >= 0 and isfinite(r.prescale_factor)
            and isfinite(r.postscale_factor) and (r.group_id == NO_GROUP) == (r.group_size == 0))
