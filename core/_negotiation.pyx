# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.negotiation` (read that module, and reference/messages.py,
reference/response_cache.py and reference/coordinator.py, for the explanation).

One extension holds what the reference splits into four modules, so the controller can reach the cache's C++
containers, laid out file for file like the reference: ``_messages.pxi``, ``_response_cache.pxi`` and
``_coordinator.pxi`` are included below, in the reference's reading order, and this file holds the controller
(reference: negotiation.py). The hit path
(lookups, bit vector, LRU updates, fusion) runs on C++ containers without creating Python objects per tensor;
what formats errors or validates the coordinator's requests is shared with the reference
(:mod:`distlab._common.negotiation`).
"""
import sys
import warnings

import numpy as np

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.math cimport isfinite
from libc.string cimport memcmp, memcpy, memset
from libcpp.deque cimport deque as cppdeque
from libcpp.list cimport list as cpplist
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref, predecrement as dec, preincrement as inc
from cpython.pythread cimport (NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock,
                               PyThread_free_lock, PyThread_release_lock, PyThread_type_lock)

from distlab._common.negotiation import (
    MAX_TENSOR_BYTES, CACHEABLE_RESPONSE_TYPES, COUNTERS, cache_error, check_capacity,
    coordinator_failed_reason, device_error, dimension_error, eviction_warning_text, format_error,
    group_member_error, group_mismatch_error, group_name_of, group_size_error, list_field_error, list_repr,
    process_set_error, refused_list_reason, request_field_error, request_repr, response_error,
    response_field_error, response_repr, sender_error, shape_size_error, shutdown_reason_text, size_error,
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
from distlab.errors import CacheEvictionWarning, CacheStateError, MessageFormatError

cdef extern from *:
    int __builtin_ctzll(unsigned long long)
    int __builtin_popcountll(unsigned long long)

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyBytes_FromStringAndSize(const char* v, Py_ssize_t n)
    int PyObject_GenericSetAttr(object o, object name, object value) except -1

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
cnp.import_array()
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


cdef uint32_t _NO_BIT = 0xFFFFFFFF  # a name with no bit in the cache


MISS, HIT, INVALID = S_MISS, S_HIT, S_INVALID

__all__ = ["Request", "Response", "RequestList", "ResponseList", "ResponseCache", "CacheCoordinator",
           "Controller", "fuse_responses", "request_params", "MISS", "HIT", "INVALID"]

include "_messages.pxi"
include "_response_cache.pxi"
include "_coordinator.pxi"


# -- the controller: each rank's cycle (reference: negotiation.py) -----------------------------------------------
cdef class Controller:
    """See :class:`distlab.reference.negotiation.Controller`."""

    cdef public int rank, size, process_set_id
    cdef public long long fusion_threshold
    cdef public ResponseCache cache
    cdef public object timeline, stall
    cdef public Coordinator coordinator
    cdef public bint joined
    cdef _Counters _counts
    cdef PyThread_type_lock _lock  # the queue's lock (a C lock: taken per request by enqueue)
    cdef list _queue
    cdef dict _pending
    cdef object _words               # the bit vector's uint64 words, reused every cycle
    cdef vector[int] _states         # per request of the cycle's batch: its cache state, and its bit (reused)
    cdef vector[uint32_t] _bits

    def __cinit__(self, *args, **kwargs):
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("cannot allocate the controller's queue lock")

    def __dealloc__(self):
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __init__(self, rank, size, cache_capacity=1024, fusion_threshold=128 * 1024 * 1024, stall_check_time=60.0,
                 stall_shutdown_time=0.0, timeline=None, clock=None, process_set_id=_wire.GLOBAL_PROCESS_SET_ID):
        self.rank = rank
        self.size = size
        self.process_set_id = process_set_id
        self.fusion_threshold = fusion_threshold
        self.cache = ResponseCache(cache_capacity)
        self.timeline = timeline
        self.stall = StallInspector(size, stall_check_time, stall_shutdown_time, **({"clock": clock} if clock else {}))
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
        """See :meth:`distlab.reference.negotiation.Controller.enqueue` (the request is looked up in the cache
        here, on the submitting thread: the cycle then only checks that the cache has not changed since)."""
        cdef uint32_t bit
        if self.cache.capacity > 0:
            self.cache.lookup(request, &bit)
        _acquire(self._lock)
        self._queue.append(request)
        PyThread_release_lock(self._lock)

    def enqueue_group(self, requests):
        """See :meth:`distlab.reference.negotiation.Controller.enqueue_group`."""
        cdef list checked = [<Request?>request for request in requests]
        cdef Request request
        cdef uint32_t bit
        if self.cache.capacity > 0:
            for request in checked:
                self.cache.lookup(request, &bit)
        _acquire(self._lock)
        self._queue.extend(checked)
        PyThread_release_lock(self._lock)

    def queue_length(self):
        """See :meth:`distlab.reference.negotiation.Controller.queue_length`."""
        cdef Py_ssize_t n
        _acquire(self._lock)
        n = len(self._queue)
        PyThread_release_lock(self._lock)
        return n

    def compute_response_list(self, channel, shut_down=False, shutdown_reason=""):
        """See :meth:`distlab.reference.negotiation.Controller.compute_response_list`."""
        cdef CacheCoordinator coordinator = CacheCoordinator.__new__(CacheCoordinator)
        cdef long long hits = self._counts.hits
        cdef list batch, uncached
        cdef bint erased
        cdef object stopping                # this rank's reason to stop (None: it does not)
        coordinator.start(self.cache.num_active_bits())
        self._counts.cycles += 1
        batch = self._look_up(coordinator, self._states, self._bits)                                     # 1
        stopping = self._check_for_stalls(coordinator, shut_down, shutdown_reason)                       # 2
        uncached = batch
        if self.cache.capacity > 0:
            erased = self._coordinate_cache_and_state(coordinator, channel)                              # 3
            uncached = self._requeue_uncommon_hits(batch, coordinator, self._states, self._bits, erased, # 4
                                                   self._counts.hits - hits)
            if not coordinator.uncached_in_queue and not coordinator.invalid_in_queue:
                return self._fast_path(coordinator)                                                      # 5
        return self._slow_path(uncached, stopping, coordinator, channel)                                 # 6

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef list _look_up(self, CacheCoordinator coordinator, vector[int]& states, vector[uint32_t]& bits):
        """See :meth:`distlab.reference.negotiation.Controller._look_up` (each request's state and bit kept)."""
        # i < n == len(batch) == states.size() == bits.size() on every indexing below
        cdef ResponseCache cache = self.cache
        cdef bint caching = cache.capacity > 0, grouped = False, missed = False
        cdef list batch, fresh = []
        cdef Py_ssize_t i, n
        cdef Request request
        cdef int state
        cdef uint32_t bit
        _acquire(self._lock)
        batch = self._queue
        self._queue = fresh
        PyThread_release_lock(self._lock)
        n = len(batch)
        states.assign(n, S_MISS)
        bits.assign(n, 0)
        for i in range(n):
            request = <Request>batch[i]
            if request.request_type == RT_JOIN:
                self.joined = True
                coordinator.set_uncached_in_queue(True)
                continue
            grouped |= request.group_id != NO_GROUP
            if caching:
                state = states[i] = cache.lookup(request, &bit)  # cached() and peek_cache_bit()
                if state == S_HIT:
                    bits[i] = bit
                    coordinator.hit(bit)  # record_hit
                    self._counts.hits += 1
                else:
                    missed = True
                    if state == S_INVALID:
                        bits[i] = bit
                        coordinator.record_invalid_bit(bit)
                        self._counts.invalid += 1
                    coordinator.set_uncached_in_queue(True)
                    self._counts.misses += 1
                    self.stall.remove_cached(request.name())
        if grouped and missed:  # (a group is partial only where a member did not hit)
            self._invalidate_partial_groups(batch, states, bits, coordinator)
        if self.joined and caching:
            # a joined rank: every cached allreduce is "ready" (zeros), every other cached collective invalid
            for bit in cache.list_all_bits():
                if _reduces(cache.peek_response(bit).response_type):
                    coordinator.record_hit(bit)
                else:
                    coordinator.record_invalid_bit(bit)
        return batch

    cdef object _check_for_stalls(self, CacheCoordinator coordinator, shut_down, shutdown_reason):
        """See :meth:`distlab.reference.negotiation.Controller._check_for_stalls`."""
        cdef bint should_shut_down = shut_down
        reason = str(shutdown_reason) if should_shut_down else ""
        if self.stall.should_check():
            if self.coordinator is not None and self.stall.check(self.coordinator.joined_ranks):
                should_shut_down = True
                reason = reason or self.stall.shutdown_reason
            if self.cache.capacity > 0:
                for name in self.stall.stalled_cached_names():
                    try:
                        coordinator.record_invalid_bit(self.cache.peek_cache_bit(name))
                    except CacheStateError:  # evicted meanwhile
                        pass
                    self.stall.remove_cached(name)
            self.stall.update_check_time()
        coordinator.set_should_shut_down(should_shut_down)
        if should_shut_down:
            coordinator.set_uncached_in_queue(True)      # the reason travels on the slow path
        return reason if should_shut_down else None

    cdef bint _coordinate_cache_and_state(self, CacheCoordinator coordinator, channel) except -1:
        """See :meth:`distlab.reference.negotiation.Controller._coordinate_cache_and_state` (True when it erased)."""
        cdef bint erased = False
        if self._words is None or len(self._words) != coordinator.num_words:
            self._words = np.empty(coordinator.num_words, dtype=np.uint64)
        coordinator.sync_into(channel.allreduce_bits, self._words)
        if coordinator.invalid_in_queue:
            for bit in coordinator.invalid_bits:
                self.cache.erase_response(bit)
                erased = True
        return erased

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef list _requeue_uncommon_hits(self, list batch, CacheCoordinator coordinator, vector[int]& states,
                                     vector[uint32_t]& bits, bint erased, long long hits):
        """See :meth:`distlab.reference.negotiation.Controller._requeue_uncommon_hits` (``hits``: how many of
        the batch hit here; ``erased``: whether the sync erased entries, which changes the states)."""
        # i < n <= len(batch) == states.size() == bits.size() on every indexing below
        cdef ResponseCache cache = self.cache
        cdef Py_ssize_t i, n = len(batch)
        cdef Request request
        cdef list uncached = [], requeue = []
        cdef bint tracking = bool(self.stall.cached_waits)  # (when empty, there is none to remove)
        if not erased and not tracking and hits == n and coordinator.num_hits() == <size_t>n:
            return uncached  # every request hit here and everywhere: nothing to requeue or send
        for i in range(n):
            request = <Request>batch[i]
            if erased and request.request_type != RT_JOIN:
                states[i] = cache.lookup(request, &bits[i])
            if states[i] == S_HIT:
                if not coordinator.common_hit(bits[i]):
                    requeue.append(request)     # ready here, not everywhere: try again next cycle
                    self.stall.record_cached(request.name())
                elif tracking:
                    self.stall.remove_cached(request.name())
            else:
                uncached.append(request)
        if requeue:
            self._counts.requeued += len(requeue)
            _acquire(self._lock)
            try:
                self._queue[0:0] = requeue
            finally:
                PyThread_release_lock(self._lock)
        return uncached

    cdef ResponseList _fast_path(self, CacheCoordinator coordinator):
        """See :meth:`distlab.reference.negotiation.Controller._fast_path`."""
        cdef ResponseList response_list = _response_list(coordinator.should_shut_down, self.process_set_id)
        fused = self.cache.fused_hits(coordinator, self.fusion_threshold)
        if fused is None:
            self._counts.idle += 1
            return response_list
        self._counts.fast_path += 1
        response_list.responses = fused
        self._finish(response_list)
        self.cache.update_cache_bits()
        return response_list

    cdef ResponseList _slow_path(self, list uncached, stopping, CacheCoordinator coordinator, channel):
        """See :meth:`distlab.reference.negotiation.Controller._slow_path`."""
        cdef ResponseCache cache = self.cache
        cdef ResponseList response_list
        cdef Request request
        self._counts.slow_path += 1
        for request in uncached:
            self._pending[request.name()] = request
        mine = RequestList(uncached, stopping is not None, stopping or "", self.process_set_id).to_bytes()
        gathered = channel.gather(mine)
        if self.coordinator is not None:
            self.coordinator.fusion_threshold = self.fusion_threshold
            try:
                payload = self.coordinator.coordinate(list(gathered), cache, coordinator.cache_hits).to_bytes()
            except Exception as error:
                payload = ResponseList([], True, coordinator_failed_reason(error), self.process_set_id).to_bytes()
            payload = channel.broadcast(payload)
        else:
            payload = channel.broadcast(None)
        response_list = ResponseList.from_bytes(payload)
        if response_list.process_set_id != self.process_set_id:
            raise process_set_error("response list", response_list.process_set_id, self.process_set_id)
        if cache.capacity > 0:
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


# --- core-only helpers: the extension's C helpers, in its own file ------------------------------------------
include "_negotiation.pxi"
