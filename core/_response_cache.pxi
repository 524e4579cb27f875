# Included by _negotiation.pyx: core twin of distlab.reference.response_cache (C++ containers, no per-tensor
# Python objects on the hit path). Entries live in slots; a bit maps to a slot; the LRU list orders slot ids.

def request_params(request):
    """See :func:`distlab.reference.response_cache.request_params`."""
    cdef Request r = <Request?>request
    return (r.request_type, r.tensor_type, r.tensor_shape, r.device, r.reduce_op, r.prescale_factor,
            r.postscale_factor, r.group_id, r.group_size)


@cython.final
cdef class ResponseCache:
    """See :class:`distlab.reference.response_cache.ResponseCache`."""

    cdef readonly uint32_t capacity  # (a property in the reference)
    cdef uint64_t _epoch
    cdef bint _print_warning, _bits_outdated
    cdef public long evictions
    cdef cpplist[int] _lru                            # slot ids, front = least recently used
    cdef vector[cpplist[int].iterator] _bit_iters     # bit -> LRU position
    cdef vector[int] _bit_slot                        # bit -> slot, -1 for a hole
    cdef vector[uint32_t] _slot_bit                   # slot -> bit
    cdef unordered_map[string, uint32_t] _name_to_bit
    cdef vector[_Params] _params                      # slot -> params
    cdef vector[_RespInfo] _info                      # slot -> fusion-relevant response fields
    cdef vector[string] _names                        # slot -> name
    cdef vector[int] _free                            # free slots
    cdef list _responses                              # slot -> Response
    cdef list _pynames                                # slot -> name (str), reused when fusing
    cdef list _pysizes                                # slot -> tensor_sizes[0] (int) or None
    # The last fast-path fusion, reused while the same slots hit in an unchanged cache (see fused_hits)
    cdef vector[int] _memo_slots
    cdef uint64_t _memo_epoch
    cdef long long _memo_threshold
    cdef list _memo_fused

    def __init__(self, capacity=1024):
        self.capacity = 0
        self._print_warning = True
        self.evictions = 0
        self.clear()
        self.set_capacity(capacity)

    def clear(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.clear`."""
        self._lru.clear()
        self._bit_iters.clear()
        self._bit_slot.clear()
        self._slot_bit.clear()
        self._name_to_bit.clear()
        self._params.clear()
        self._info.clear()
        self._names.clear()
        self._free.clear()
        self._responses = []
        self._pynames = []
        self._pysizes = []
        self._bits_outdated = False
        self._epoch = _new_epoch()

    def set_capacity(self, capacity):
        """See :meth:`distlab.reference.response_cache.ResponseCache.set_capacity`."""
        cdef uint32_t wanted = check_capacity(capacity)
        if wanted != self.capacity:
            self.clear()
        self.capacity = wanted

    cpdef size_t num_active_bits(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.num_active_bits`."""
        return self._bit_slot.size()

    def __len__(self):
        return self._lru.size()

    cpdef int cached(self, Request request):
        """See :meth:`distlab.reference.response_cache.ResponseCache.cached`."""
        cdef uint32_t bit
        return _cache_state(self, request, &bit)

    cdef inline int lookup(self, Request request, uint32_t* bit) noexcept:
        """``cached(request)`` and, for a HIT or an INVALID entry, ``peek_cache_bit(request)`` into ``bit``, at once
        (core only: the controller's call per request)."""
        return _cache_state(self, request, bit)

    cpdef uint32_t peek_cache_bit(self, request_or_name) except? 0xFFFFFFFF:
        """See :meth:`distlab.reference.response_cache.ResponseCache.peek_cache_bit`."""
        cdef uint32_t bit
        if type(request_or_name) is Request:  # a request remembers its bit while the cache's state lasts
            if _cache_state(self, <Request>request_or_name, &bit) == S_MISS:
                bit = _NO_BIT
        else:
            it = self._name_to_bit.find(_utf8(request_or_name if isinstance(request_or_name, str)
                                              else request_or_name.tensor_name))
            bit = _NO_BIT if it == self._name_to_bit.end() else deref(it).second
        if bit == _NO_BIT:
            raise cache_error("not_cached", name=request_or_name if isinstance(request_or_name, str)
                              else request_or_name.tensor_name)
        return bit

    cpdef Response peek_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.peek_response`."""
        return self._responses[_slot_at(self, bit)]

    cpdef Response get_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.get_response`."""
        cdef int slot = _slot_at(self, bit)
        _touch(self, <uint32_t>bit)
        return self._responses[slot]

    def list_all_bits(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.list_all_bits`."""
        cdef size_t b
        return [b for b in range(self._bit_slot.size()) if self._bit_slot[b] >= 0]

    def lru_names(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.lru_names`."""
        return [self._pynames[slot] for slot in self._lru]

    cpdef put(self, Response response, requests, bint joined=False):
        """See :meth:`distlab.reference.response_cache.ResponseCache.put`."""
        cdef _Params params
        cdef Response single
        cdef Py_ssize_t i, n = len(response.tensor_names)
        if self.capacity == 0:
            return
        if response.response_type not in CACHEABLE_RESPONSE_TYPES:
            raise cache_error("uncacheable", response_type=response.response_type)
        for i in range(n):
            name = response.tensor_names[i]
            single = response.copy()
            single.tensor_names = [name]
            if n > 1:                       # a fused part keeps its own size
                single.tensor_sizes = [response.tensor_sizes[i]]
            params.joined = joined
            params.known = True
            if joined:
                params.shape.clear()
            else:
                request = requests.get(name)
                if request is not None:
                    params = _params_of(<Request?>request)
                elif self._name_to_bit.count(_utf8(name)):
                    params.known = False    # a common hit, already checked
                else:
                    raise cache_error("no_request", name=name)
            self._put_one(name, single, params)

    cdef int _put_one(self, str name, Response response, _Params& params) except -1:
        # mirrors response_cache.cc ResponseCache::put_
        cdef string cname = _utf8(name)
        cdef uint32_t bit
        cdef int slot
        it = self._name_to_bit.find(cname)
        if it != self._name_to_bit.end():
            bit = deref(it).second
            if params.known and not _params_equal(self._params[self._bit_slot[bit]], params):
                raise cache_error("overwrite_invalid", name=name)
            _touch(self, bit)
            return 0
        if self._lru.size() >= self.capacity:
            slot = self._lru.front()
            if self._print_warning:
                warnings.warn(eviction_warning_text(self.capacity, self._pynames[slot], name), CacheEvictionWarning,
                              stacklevel=1)  # Cython adds no frame: 1 is the caller of put()
                self._print_warning = False
            self.evictions += 1
            bit = self._slot_bit[slot]
            self._name_to_bit.erase(self._names[slot])
            self._lru.pop_front()
            self._free.push_back(slot)
        else:
            bit = self._bit_slot.size()
            self._bit_slot.push_back(-1)
            self._bit_iters.push_back(self._lru.end())
        slot = _free_slot(self)
        self._params[slot] = params
        _fill_info(&self._info[slot], response)
        self._names[slot] = cname
        self._slot_bit[slot] = bit
        self._responses[slot] = response
        self._pynames[slot] = name
        self._pysizes[slot] = response.tensor_sizes[0] if response.tensor_sizes else None
        self._bit_slot[bit] = slot
        self._lru.push_back(slot)
        it_new = self._lru.end()
        dec(it_new)
        self._bit_iters[bit] = it_new
        self._name_to_bit[cname] = bit
        self._bits_outdated = True
        self._epoch = _new_epoch()
        return 0

    cpdef erase_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.erase_response`."""
        cdef int slot = _slot_at(self, bit)
        self._name_to_bit.erase(self._names[slot])
        self._lru.erase(self._bit_iters[bit])
        self._bit_iters[bit] = self._lru.end()
        self._bit_slot[bit] = -1
        self._responses[slot] = None
        self._free.push_back(slot)
        self._bits_outdated = True
        self._epoch = _new_epoch()

    cpdef update_cache_bits(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.update_cache_bits`."""
        cdef uint32_t bit = 0
        cdef int slot
        cdef bint changed = self._bit_slot.size() != self._lru.size()
        if not self._bits_outdated:
            return
        self._bit_slot.resize(self._lru.size())
        self._bit_iters.resize(self._lru.size())
        it = self._lru.begin()
        while it != self._lru.end():
            slot = deref(it)
            self._bit_slot[bit] = slot
            self._bit_iters[bit] = it
            if self._slot_bit[slot] != bit:
                self._slot_bit[slot] = bit
                self._name_to_bit[self._names[slot]] = bit
                changed = True
            bit += 1
            inc(it)
        self._bits_outdated = False
        if changed:
            self._epoch = _new_epoch()

    cpdef list fused_hits(self, CacheCoordinator coordinator, long long threshold):
        """See :meth:`distlab.reference.response_cache.ResponseCache.fused_hits`. An equal epoch (it changes with
        any put, erase or renumbering), equal slots and threshold give an equal fusion: a training loop fuses once."""
        cdef vector[uint32_t] bits
        cdef vector[int] slots, group_start, members
        cdef bint in_order = not self._bits_outdated
        cdef size_t k
        cdef Py_ssize_t g
        cdef Response response
        coordinator.common_hits(bits)
        if bits.empty():
            return None
        slots.resize(bits.size())
        for k in range(bits.size()):
            slots[k] = self._bit_slot[bits[k]]
        # every entry hit and bit order is LRU order: touching them all in bit order (get_response in the
        # reference) would leave the LRU order, hence every bit, as it is
        if not (in_order and slots.size() == self._lru.size() and slots.size() == self._bit_slot.size()):
            for k in range(bits.size()):
                _touch(self, bits[k])
        if not (self._memo_fused is not None and self._epoch == self._memo_epoch and threshold == self._memo_threshold
                and slots == self._memo_slots):
            _fuse_plan(self._info, slots, threshold, group_start, members)
            self._memo_fused = [_fused_response(self._responses, group_start, members, g, self._pynames, self._pysizes)
                                for g in range(<Py_ssize_t>group_start.size() - 1)]
            self._memo_slots = slots
            self._memo_threshold = threshold
            self.update_cache_bits()
            self._memo_epoch = self._epoch
        else:
            self.update_cache_bits()
        return [response.copy() for response in self._memo_fused]


@cython.final
cdef class CacheCoordinator:
    """See :class:`distlab.reference.response_cache.CacheCoordinator`."""

    cdef public long num_active_bits
    cdef public long num_words
    cdef vector[uint64_t] _hits        # raw cache bits (not shifted by the status bits)
    cdef vector[uint64_t] _invalid
    cdef readonly bint should_shut_down, uncached_in_queue, invalid_in_queue, synced  # (properties in the reference)
    cdef vector[uint64_t] _sent        # the words as they went into the AND allreduce (sent_words, once synced)

    def __init__(self, num_active_bits):
        self.start(num_active_bits)

    cdef int start(self, long num_active_bits) except -1:
        """``__init__`` at C level (core only: the controller makes one per cycle)."""
        self.num_active_bits = num_active_bits
        self.num_words = (num_active_bits + NUM_STATUS_BITS + 63) >> 6
        self._hits.assign(self.num_words, 0)
        self._invalid.assign(self.num_words, 0)
        return 0

    @property
    def sent_words(self):
        """See :attr:`distlab.reference.response_cache.CacheCoordinator.sent_words` (made when read)."""
        if not self.synced:
            return None
        out = np.empty(self._sent.size(), dtype=np.uint64)
        if self._sent.size():
            memcpy(cnp.PyArray_DATA(<cnp.ndarray>out), self._sent.data(), self._sent.size() * sizeof(uint64_t))
        return out

    cdef inline int _check_not_synced(self) except -1:
        if self.synced:
            raise cache_error("synced")
        return 0

    cdef inline int _check_bit(self, long bit) except -1:
        self._check_not_synced()
        if bit < 0 or bit >= self.num_active_bits:
            raise cache_error("bit_range", bit=bit, active=self.num_active_bits)
        return 0

    cpdef record_hit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.record_hit`."""
        self._check_bit(bit)
        self._hits[bit >> 6] |= (<uint64_t>1) << (bit & 63)

    cpdef record_invalid_bit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.record_invalid_bit`."""
        self._check_bit(bit)
        self._invalid[bit >> 6] |= (<uint64_t>1) << (bit & 63)
        self.invalid_in_queue = True

    def erase_hit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.erase_hit`."""
        if 0 <= bit < self.num_active_bits:
            self._hits[bit >> 6] &= ~((<uint64_t>1) << (bit & 63))

    cpdef set_should_shut_down(self, bint value):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.set_should_shut_down`."""
        self._check_not_synced()
        self.should_shut_down = value

    cpdef set_uncached_in_queue(self, bint value):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.set_uncached_in_queue`."""
        self._check_not_synced()
        self.uncached_in_queue = value

    @property
    def cache_hits(self):
        """See :attr:`distlab.reference.response_cache.CacheCoordinator.cache_hits`."""
        return _bits_list(self._hits)

    @property
    def invalid_bits(self):
        """See :attr:`distlab.reference.response_cache.CacheCoordinator.invalid_bits`."""
        return _bits_list(self._invalid)

    cdef inline void hit(self, uint32_t bit) noexcept:
        """``record_hit`` without its checks (core only: the controller's call per request, with a bit its cache
        gave this cycle, before the sync)."""
        self._hits[bit >> 6] |= (<uint64_t>1) << (bit & 63)

    cpdef bint common_hit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.common_hit`."""
        return 0 <= bit < self.num_active_bits and (self._hits[bit >> 6] >> (bit & 63)) & 1

    cdef inline size_t common_hits(self, vector[uint32_t]& bits) noexcept:
        """``cache_hits`` into ``bits`` (core only, no Python list): the hit bits, ascending; returns how many."""
        cdef size_t w, k = bits.size()
        cdef uint64_t word
        bits.resize(k + _popcount(self._hits))
        for w in range(self._hits.size()):
            word = self._hits[w]
            while word:
                bits[k] = <uint32_t>(w * 64 + __builtin_ctzll(word))
                k += 1
                word &= word - 1
        return k

    cdef size_t num_hits(self):
        """How many hits there are (core only)."""
        return _popcount(self._hits)

    def bitvector(self):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.bitvector`."""
        cdef object arr = np.empty(self.num_words, dtype=np.uint64)
        self.fill_bitvector(<uint64_t*>cnp.PyArray_DATA(<cnp.ndarray>arr))
        return arr

    def sync(self, allreduce):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.sync`."""
        self.sync_into(allreduce, np.empty(self.num_words, dtype=np.uint64))

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int fill_bitvector(self, uint64_t* words) noexcept:
        """``bitvector()`` into ``words`` (``num_words`` of them; core only)."""
        # _hits and _invalid have num_words entries and i < num_words on every access
        cdef uint64_t h, status = 0
        cdef long i, n = self.num_words
        if not self.should_shut_down:
            status |= (<uint64_t>1) << SHOULD_SHUT_DOWN
        if not self.uncached_in_queue:
            status |= (<uint64_t>1) << UNCACHED_IN_QUEUE
        if not self.invalid_in_queue:
            status |= (<uint64_t>1) << INVALID_IN_QUEUE
        memset(words, 0, n * sizeof(uint64_t))
        words[0] = status
        for i in range(n):
            h = self._hits[i] & ~self._invalid[i]     # an invalid bit is never a hit
            words[i] |= h << NUM_STATUS_BITS
            if i + 1 < n:
                words[i + 1] |= h >> (64 - NUM_STATUS_BITS)
        return 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int sync_into(self, allreduce, object words) except -1:
        """``sync(allreduce)`` through ``words``, a uint64 array of ``num_words`` the caller keeps (core only: the
        controller reuses one every cycle, so a cycle allocates no array)."""
        # every pointer below has num_words entries (checked after each allreduce) and i < num_words
        cdef uint64_t* w
        cdef long i, n = self.num_words
        self._check_not_synced()
        w = _words_at(words, n)
        self.fill_bitvector(w)
        self._sent.assign(w, w + n)
        w = _words_at(_reduce(allreduce, words, "band", n), n)
        self.should_shut_down = not (w[0] >> SHOULD_SHUT_DOWN) & 1
        self.uncached_in_queue = not (w[0] >> UNCACHED_IN_QUEUE) & 1
        self.invalid_in_queue = not (w[0] >> INVALID_IN_QUEUE) & 1
        for i in range(n):
            self._hits[i] = w[i] >> NUM_STATUS_BITS
            if i + 1 < n:
                self._hits[i] |= w[i + 1] << (64 - NUM_STATUS_BITS)
        if self.invalid_in_queue:
            invalid = np.empty(n, dtype=np.uint64)
            w = _words_at(invalid, n)
            for i in range(n):
                w[i] = self._invalid[i]
            w = _words_at(_reduce(allreduce, invalid, "bor", n), n)
            for i in range(n):
                self._invalid[i] = w[i]
                self._hits[i] &= ~w[i]
        self.synced = True
        return 0


cdef object _reduce(allreduce, object words, str op, long n):
    """See :func:`distlab.reference.response_cache._reduce` (the result checked: a uint64 array of n words)."""
    reduced = allreduce(words, op)
    if reduced is None:
        return words
    out = np.ascontiguousarray(reduced, dtype=np.uint64)
    if out.ndim != 1 or out.shape[0] != n:
        raise ValueError(f"the bit-vector allreduce returned {out.size} words, expected {n}")
    return out



# --- core-only helpers ---------------------------------------------------------------------------------------
cdef Request _BLANK_REQUEST = Request()


cdef inline int _cache_state(ResponseCache cache, Request r, uint32_t* bit) noexcept:
    """ResponseCache.cached() without the Python call; sets ``bit`` on HIT and INVALID. Remembered in the request
    while the cache's state lasts: a request looked up at enqueue costs the cycle one comparison."""
    cdef int state = r.hinted(cache._epoch, bit)
    cdef uint32_t b
    if state >= 0:
        return state
    b = r.find_bit(cache._name_to_bit)
    if b == _NO_BIT:
        state = S_MISS
    else:
        state = S_HIT if _params_match(cache._params[cache._bit_slot[b]], r) else S_INVALID
    r.remember(cache._epoch, b, state)
    bit[0] = b
    return state


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
