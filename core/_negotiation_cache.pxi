# Included by _negotiation.pyx: core twin of distlab.reference.response_cache (C++ containers, no per-tensor
# Python objects on the hit path).

cdef struct _Params:
    int ndim
    int64_t dims[8]         # the first dims inline: the hit check touches no heap buffer for ndim <= 8
    int rtype
    int dtype
    int device
    int op
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


cdef dict _DEVICE_IDS = {}


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
    # S_HIT condition (mirrors response_cache.cc cached(), plus op and scale factors)
    return (a.joined or (a.rtype == r.request_type and a.dtype == r.tensor_type and _same_shape(a, r)
                         and a.device == r.device and a.op == r.reduce_op and a.pre == r.prescale_factor
                         and a.post == r.postscale_factor))


cdef inline bint _params_equal(_Params& a, _Params& b):
    return (a.joined or b.joined or (a.rtype == b.rtype and a.dtype == b.dtype and a.shape == b.shape
                                     and a.device == b.device and a.op == b.op and a.pre == b.pre
                                     and a.post == b.post))


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
    p.shape = r._cshape
    p.ndim = r._ndim
    for i in range(min(r._ndim, 8)):
        p.dims[i] = r._dims[i]
    return p


def request_params(request):
    """See :func:`distlab.reference.response_cache.request_params`."""
    return (request.request_type, request.tensor_type, tuple(request.tensor_shape), request.device,
            request.reduce_op, request.prescale_factor, request.postscale_factor)


cdef int _fill_info(_RespInfo* info, Response response) except -1:
    info.rtype = response.response_type
    info.dtype = response.tensor_type
    info.op = response.reduce_op
    info.pre = response.prescale_factor
    info.post = response.postscale_factor
    info.nbytes = _size_bytes(response)
    key = tuple(response.devices)
    devices_id = _DEVICE_IDS.get(key)
    if devices_id is None:
        devices_id = _DEVICE_IDS[key] = len(_DEVICE_IDS)
    info.devices_id = devices_id
    return 0


# Every state of every cache's name -> bit mapping gets a number never used before (0 = none), so a Request can
# remember "in mapping state E my name had bit B (or none)" and skip the hash lookup while E is current.
cdef uint64_t _EPOCHS = 0
cdef uint32_t _NO_BIT = 0xFFFFFFFF


cdef inline uint64_t _new_epoch():
    global _EPOCHS
    _EPOCHS += 1
    return _EPOCHS


cdef class ResponseCache:
    """See :class:`distlab.reference.response_cache.ResponseCache`."""

    cdef uint32_t _capacity
    cdef uint64_t _epoch
    cdef bint _print_warning, _bits_outdated
    cdef public long evictions
    # Entries live in slots; the LRU list orders slot ids (front = least recently used, back = most).
    cdef cpplist[int] _lru
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

    def __init__(self, capacity=1024):
        self._capacity = 0
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
        capacity = int(capacity)
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        if capacity != self._capacity:
            self.clear()
        self._capacity = capacity

    @property
    def capacity(self):
        """See :attr:`distlab.reference.response_cache.ResponseCache.capacity`."""
        return self._capacity

    def num_active_bits(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.num_active_bits`."""
        return self._bit_slot.size()

    def __len__(self):
        return self._lru.size()

    # -- C-level helpers used by the controller --------------------------------------------------------------
    cdef inline int _state(self, Request r, uint32_t* bit):
        cdef uint32_t b
        if r._hint_epoch == self._epoch:
            b = r._hint_bit
        else:
            it = self._name_to_bit.find(r._cname)
            b = _NO_BIT if it == self._name_to_bit.end() else deref(it).second
            r._hint_epoch = self._epoch
            r._hint_bit = b
        if b == _NO_BIT:
            return S_MISS
        bit[0] = b
        return S_HIT if _params_match(self._params[self._bit_slot[b]], r) else S_INVALID

    cdef int _slot_at(self, long bit) except -1:
        if bit < 0 or bit >= <long>self._bit_slot.size() or self._bit_slot[bit] < 0:
            raise CacheStateError(f"cache bit {bit} holds no entry (active bits: {self._bit_slot.size()})")
        return self._bit_slot[bit]

    cdef inline void _touch(self, uint32_t bit):
        # move to most recently used
        # splice relinks the node: no allocation, and the bit's iterator stays valid
        self._lru.splice(self._lru.end(), self._lru, self._bit_iters[bit])
        self._bits_outdated = True

    # -- lookups ---------------------------------------------------------------------------------------------
    def cached(self, Request request):
        """See :meth:`distlab.reference.response_cache.ResponseCache.cached`."""
        cdef uint32_t bit
        return self._state(request, &bit)

    def peek_cache_bit(self, request_or_name):
        """See :meth:`distlab.reference.response_cache.ResponseCache.peek_cache_bit`."""
        name = request_or_name if isinstance(request_or_name, str) else request_or_name.tensor_name
        it = self._name_to_bit.find(_utf8(name))
        if it == self._name_to_bit.end():
            raise CacheStateError(f"tensor {name!r} is not in the response cache")
        return deref(it).second

    def peek_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.peek_response`."""
        return self._responses[self._slot_at(bit)]

    def get_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.get_response`."""
        cdef int slot = self._slot_at(bit)
        self._touch(<uint32_t>bit)
        return self._responses[slot]

    def list_all_bits(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.list_all_bits`."""
        cdef size_t b
        return [b for b in range(self._bit_slot.size()) if self._bit_slot[b] >= 0]

    def lru_names(self):
        """See :meth:`distlab.reference.response_cache.ResponseCache.lru_names`."""
        return [self._pynames[slot] for slot in self._lru]

    # -- mutation --------------------------------------------------------------------------------------------
    def put(self, Response response, requests, bint joined=False):
        """See :meth:`distlab.reference.response_cache.ResponseCache.put`."""
        cdef _Params params
        cdef Response single
        cdef Py_ssize_t i
        if self._capacity == 0:
            return
        if response.response_type not in CACHEABLE_RESPONSE_TYPES:
            raise CacheStateError(f"responses of type {response.response_type} are not cacheable; only "
                                  "allreduce, allgather, adasum and alltoall are")
        fused = len(response.tensor_names) > 1
        for i, name in enumerate(response.tensor_names):
            single = Response.__new__(Response)
            single.response_type = response.response_type
            single.tensor_names = [name]
            single.tensor_type = response.tensor_type
            single.error_message = response.error_message
            single.devices = list(response.devices)
            single.tensor_sizes = [response.tensor_sizes[i]] if fused else list(response.tensor_sizes)
            single.prescale_factor = response.prescale_factor
            single.postscale_factor = response.postscale_factor
            single.reduce_op = response.reduce_op
            single.last_joined_rank = response.last_joined_rank
            if joined:
                params.joined = True
                params.known = True
                params.shape.clear()
            else:
                request = requests.get(name)
                if request is None:
                    params.joined = False
                    params.known = False
                    if self._name_to_bit.find(_utf8(name)) == self._name_to_bit.end():
                        raise CacheStateError(f"cannot cache {name!r}: this rank has no request for it")
                else:
                    params = _params_of(<Request?>request)
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
                raise CacheStateError(
                    f"refusing to overwrite the cached response of {name!r}: the entry is S_INVALID (same name, "
                    "different parameters) and must be erased first (erase_response)")
            self._touch(bit)
            return 0
        if self._lru.size() >= self._capacity:
            slot = self._lru.front()
            evicted = self._pynames[slot]
            if self._print_warning:
                warnings.warn(eviction_warning_text(self._capacity, evicted, name), CacheEvictionWarning,
                              stacklevel=3)
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
        if self._free.size():
            slot = self._free.back()
            self._free.pop_back()
        else:
            slot = self._params.size()
            self._params.push_back(params)
            self._info.push_back(_RespInfo(0, 0, 0, 0.0, 0.0, 0, 0))  # filled below
            self._names.push_back(cname)
            self._slot_bit.push_back(0)
            self._responses.append(None)
            self._pynames.append(None)
            self._pysizes.append(None)
        self._params[slot] = params
        _fill_info(&self._info[slot], response)
        self._names[slot] = cname
        self._slot_bit[slot] = bit
        self._responses[slot] = response
        self._pynames[slot] = name
        self._pysizes[slot] = response.tensor_sizes[0] if response.tensor_sizes else None
        self._bit_slot[bit] = slot
        self._lru.push_back(slot)
        it2 = self._lru.end()
        dec(it2)
        self._bit_iters[bit] = it2
        self._name_to_bit[cname] = bit
        self._bits_outdated = True
        self._epoch = _new_epoch()
        return 0

    def erase_response(self, long bit):
        """See :meth:`distlab.reference.response_cache.ResponseCache.erase_response`."""
        cdef int slot = self._slot_at(bit)
        self._name_to_bit.erase(self._names[slot])
        self._lru.erase(self._bit_iters[bit])
        self._bit_iters[bit] = self._lru.end()
        self._bit_slot[bit] = -1
        self._responses[slot] = None
        self._free.push_back(slot)
        self._bits_outdated = True
        self._epoch = _new_epoch()

    def update_cache_bits(self):
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


cdef class CacheCoordinator:
    """See :class:`distlab.reference.response_cache.CacheCoordinator`."""

    cdef public long num_active_bits
    cdef public long num_words
    cdef vector[uint64_t] _hits        # raw cache bits (not shifted by the status bits)
    cdef vector[uint64_t] _invalid
    cdef bint _should_shut_down, _uncached_in_queue, _invalid_in_queue, _synced, _any_invalid
    cdef public object sent_words

    def __init__(self, num_active_bits):
        self.num_active_bits = num_active_bits
        self.num_words = (self.num_active_bits + NUM_STATUS_BITS + 63) // 64
        self._hits.assign(self.num_words, 0)
        self._invalid.assign(self.num_words, 0)
        self._should_shut_down = False
        self._uncached_in_queue = False
        self._invalid_in_queue = False
        self._synced = False
        self._any_invalid = False
        self.sent_words = None

    cdef int _check(self, long bit) except -1:
        if self._synced:
            raise CacheStateError("this CacheCoordinator has already synced; make a new one each cycle")
        if bit < 0 or bit >= self.num_active_bits:
            raise CacheStateError(f"cache bit {bit} is out of range (active bits: {self.num_active_bits})")
        return 0

    cdef inline void _hit(self, uint32_t bit):
        self._hits[bit >> 6] |= (<uint64_t>1) << (bit & 63)

    def record_hit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.record_hit`."""
        self._check(bit)
        self._hit(<uint32_t>bit)

    def record_invalid_bit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.record_invalid_bit`."""
        self._check(bit)
        self._invalid[bit >> 6] |= (<uint64_t>1) << (bit & 63)
        self._invalid_in_queue = True

    def erase_hit(self, long bit):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.erase_hit`."""
        if 0 <= bit < self.num_active_bits:
            self._hits[bit >> 6] &= ~((<uint64_t>1) << (bit & 63))

    def set_should_shut_down(self, value):
        if self._synced:
            raise CacheStateError("this CacheCoordinator has already synced; make a new one each cycle")
        self._should_shut_down = bool(value)

    def set_uncached_in_queue(self, value):
        if self._synced:
            raise CacheStateError("this CacheCoordinator has already synced; make a new one each cycle")
        self._uncached_in_queue = bool(value)

    @property
    def cache_hits(self):
        return _bits_list(self._hits)

    @property
    def invalid_bits(self):
        return _bits_list(self._invalid)

    @property
    def should_shut_down(self):
        return self._should_shut_down

    @property
    def uncached_in_queue(self):
        return self._uncached_in_queue

    @property
    def invalid_in_queue(self):
        return self._invalid_in_queue

    @property
    def synced(self):
        return self._synced

    cdef object _bitvector(self):
        cdef object arr = np.zeros(self.num_words, dtype=np.uint64)
        cdef uint64_t[::1] words = arr
        cdef uint64_t h
        cdef long i, n = self.num_words
        cdef uint64_t status = 0
        if not self._should_shut_down:
            status |= (<uint64_t>1) << SHOULD_SHUT_DOWN
        if not self._uncached_in_queue:
            status |= (<uint64_t>1) << UNCACHED_IN_QUEUE
        if not self._invalid_in_queue:
            status |= (<uint64_t>1) << INVALID_IN_QUEUE
        words[0] = status
        for i in range(n):
            h = self._hits[i] & ~self._invalid[i]
            words[i] |= h << NUM_STATUS_BITS
            if i + 1 < n:
                words[i + 1] |= h >> (64 - NUM_STATUS_BITS)
        return arr

    def bitvector(self):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.bitvector`."""
        return self._bitvector()

    def sync(self, allreduce):
        """See :meth:`distlab.reference.response_cache.CacheCoordinator.sync`."""
        cdef uint64_t[::1] w
        cdef long i, n = self.num_words
        if self._synced:
            raise CacheStateError("this CacheCoordinator has already synced; make a new one each cycle")
        words = self._bitvector()
        self.sent_words = words.copy()
        result = allreduce(words, "band")
        if result is not None:
            words = np.ascontiguousarray(result, dtype=np.uint64)
        w = words
        self._should_shut_down = not (w[0] >> SHOULD_SHUT_DOWN) & 1
        self._uncached_in_queue = not (w[0] >> UNCACHED_IN_QUEUE) & 1
        self._invalid_in_queue = not (w[0] >> INVALID_IN_QUEUE) & 1
        for i in range(n):
            self._hits[i] = w[i] >> NUM_STATUS_BITS
            if i + 1 < n:
                self._hits[i] |= w[i + 1] << (64 - NUM_STATUS_BITS)
        if self._invalid_in_queue:
            inv = np.zeros(n, dtype=np.uint64)
            w = inv
            for i in range(n):
                w[i] = self._invalid[i]
            result = allreduce(inv, "bor")
            if result is not None:
                inv = np.ascontiguousarray(result, dtype=np.uint64)
            w = inv
            for i in range(n):
                self._invalid[i] = w[i]
                self._hits[i] &= ~w[i]
        self._synced = True


cdef list _bits_list(const vector[uint64_t]& words):
    cdef list out = []
    cdef size_t i
    cdef uint64_t word, low
    for i in range(words.size()):
        word = words[i]
        while word:
            low = word & (~word + 1)
            out.append(<long>(i * 64 + __builtin_ctzll(word)))
            word ^= low
    return out
