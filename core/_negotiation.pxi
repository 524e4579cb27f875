# Included at the end of _negotiation.pyx: the C helpers of the whole extension (writing and parsing the wire
# format over a C cursor, UTF-8, bit counts, range checks), which only the core needs; the reference twin packs and
# parses with the struct layouts of distlab._wire (reference/messages.py).
# --- core-only helpers ---

cdef inline void _acquire(PyThread_type_lock lock) noexcept:
    """Take ``lock``: at once when free, else waiting with the GIL released (its holders run a few C statements
    and never wait for the GIL while holding it, so no thread waits on both)."""
    if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(lock, WAIT_LOCK)


cdef inline ResponseList _response_list(bint shutdown, int process_set_id):
    """An empty ResponseList (no Python-level construction on the fast path)."""
    cdef ResponseList response_list = ResponseList.__new__(ResponseList)
    response_list.responses = []
    response_list.shutdown = shutdown
    response_list.shutdown_reason = ""
    response_list.process_set_id = process_set_id
    return response_list


cdef inline void _w(string& buf, const void* p, size_t n):
    buf.append(<const char*>p, n)


cdef inline string _utf8(object text) except *:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(text, &n)
    return string(p, <size_t>n)


cdef size_t _popcount(vector[uint64_t]& words):
    cdef size_t total = 0
    cdef uint64_t w
    for w in words:
        total += __builtin_popcountll(w)
    return total


cdef inline bint _request_head_ok(Request r):
    """Every field of a parsed request head in its range (the shared request_field_error names the first that
    is not, in the same order)."""
    return (r.request_rank >= 0 and r.request_type < _NUM_REQUEST_TYPES and r.tensor_type < _NUM_DTYPES
            and r.reduce_op <= _MAX_REDUCE_OP and r.root_rank >= 0 and r.device >= CPU_DEVICE
            and r.group_id >= NO_GROUP and r.group_size >= 0 and isfinite(r.prescale_factor)
            and isfinite(r.postscale_factor) and (r.group_id == NO_GROUP) == (r.group_size == 0))


# -- packing and parsing helpers (the reference's, over a C cursor) ----------------------------------------------
cdef int _pack_list(string& buf, bytes magic, bint shutdown, str reason, int32_t process_set_id,
                    uint32_t count) except -1:
    """The list header (magic, version, flags, process set, count, reason length), then the reason."""
    cdef uint8_t version = NEGOTIATION_WIRE_VERSION
    cdef uint8_t flags = FLAG_SHUTDOWN if shutdown else 0
    cdef string text = _utf8(reason)
    cdef uint16_t reason_len
    if text.size() > 0xFFFF:
        text.resize(0xFFFF)
    reason_len = <uint16_t>text.size()
    _w(buf, <const char*>magic, 4)
    _w(buf, &version, 1)
    _w(buf, &flags, 1)
    _w(buf, &process_set_id, 4)
    _w(buf, &count, 4)
    _w(buf, &reason_len, 2)
    buf.append(text)
    return 0


cdef uint32_t _parse_list(_Reader* r, bytes raw, bytes magic, str what, object out) except? 0xFFFFFFFF:
    """Point the cursor at ``raw``, read the header and the reason into ``out``; return the item count."""
    cdef uint32_t count
    cdef uint8_t flags
    cdef int32_t process_set_id
    cdef uint16_t reason_len
    r.p = raw
    r.n = len(raw)
    r.pos = 0
    _parse_header(r, magic, what, &count, &flags, &process_set_id, &reason_len)
    if reason_len > r.n - r.pos:
        raise format_error("reason", what=what)
    out.shutdown = flags & FLAG_SHUTDOWN
    out.shutdown_reason = _decode_name(r, reason_len)
    out.process_set_id = process_set_id
    return count


cdef int _parse_header(_Reader* r, bytes magic, str what, uint32_t* count, uint8_t* flags, int32_t* process_set_id,
                       uint16_t* reason_len) except -1:
    # the version first (it sits at the same offset in every version), then the length, magic and fields
    if (r.n > VERSION_OFFSET and memcmp(r.p, <const char*>magic, VERSION_OFFSET) == 0
            and <uint8_t>r.p[VERSION_OFFSET] != NEGOTIATION_WIRE_VERSION):
        raise format_error("version", what=what, got=<uint8_t>r.p[VERSION_OFFSET],
                           expected=NEGOTIATION_WIRE_VERSION)
    if r.n < _LIST_HEADER_SIZE:
        raise format_error("short_header", what=what, got=r.n, need=_LIST_HEADER_SIZE)
    got = PyBytes_FromStringAndSize(r.p, 4)
    if got != magic:
        raise format_error("magic", what=what, got=got, expected=magic)
    flags[0] = <uint8_t>r.p[5]
    memcpy(process_set_id, r.p + 6, 4)
    memcpy(count, r.p + 10, 4)
    memcpy(reason_len, r.p + 14, 2)
    if flags[0] & ~LIST_FLAGS or process_set_id[0] < 0:
        raise list_field_error(what, flags[0], process_set_id[0])
    r.pos = _LIST_HEADER_SIZE
    return 0


cdef inline int _need(_Reader* r, Py_ssize_t k, str where) except -1:
    if k > r.n - r.pos:
        raise format_error(where)
    return 0


cdef inline uint64_t _read_uint(_Reader* r, int width) except? 0xFFFFFFFFFFFFFFFF:
    # little-endian unsigned of 2 or 4 bytes (the machine is little-endian: checked at import)
    cdef uint64_t value = 0
    _need(r, width, "response_body")
    memcpy(&value, r.p + r.pos, width)
    r.pos += width
    return value


cdef object _decode_name(_Reader* r, Py_ssize_t k):
    # k bytes at the cursor, already checked by the caller
    try:
        text = PyUnicode_DecodeUTF8(r.p + r.pos, k, NULL)
    except UnicodeDecodeError as exc:
        raise format_error("utf8", reason=exc) from None
    r.pos += k
    return text


cdef int _no_trailing(_Reader* r, str what) except -1:
    if r.pos != r.n:
        raise format_error("trailing", what=what, count=r.n - r.pos)
    return 0


cdef tuple _list_key(object message_list):
    return (bool(message_list.shutdown), message_list.shutdown_reason, message_list.process_set_id)


# the cache entries' parameters (reference: request_params tuples, compared with ==)
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
    r.shape_into(&p)
    return p


# -- the response cache's C helpers that touch no cache's fields (_response_cache.pxi) ---------------------------
cdef list _bits_list(const vector[uint64_t]& words):
    """The set bits, ascending (the reference's _set_bits over C words)."""
    cdef list out = []
    cdef size_t i
    cdef uint64_t word
    for i in range(words.size()):
        word = words[i]
        while word:
            out.append(<long>(i * 64 + __builtin_ctzll(word)))
            word &= word - 1
    return out

cdef inline uint64_t* _words_at(object words, long n) except NULL:
    """The data of ``words``, a C-contiguous, aligned uint64 numpy array of ``n`` words (numpy's C API: no
    buffer export, no memoryview per cycle)."""
    cdef cnp.ndarray arr
    if type(words) is not np.ndarray:
        raise TypeError(f"the bit vector must be a numpy array, got {type(words).__name__}")
    arr = <cnp.ndarray>words
    if not (cnp.PyArray_TYPE(arr) == cnp.NPY_UINT64 and cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_DIM(arr, 0) == n
            and cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISALIGNED(arr)):
        raise ValueError(f"the bit vector must be a uint64 array of {n} words, got {words.dtype} "
                         f"{words.shape}")
    return <uint64_t*>cnp.PyArray_DATA(arr)

cdef inline bint _params_match(_Params& a, Request r) noexcept:
    # the HIT condition (mirrors response_cache.cc cached(), plus op and scale factors)
    return (a.joined or (a.rtype == r.request_type and a.dtype == r.tensor_type and r.shape_in(&a)
                         and a.device == r.device and a.op == r.reduce_op and a.pre == r.prescale_factor
                         and a.post == r.postscale_factor and a.group_id == r.group_id
                         and a.group_size == r.group_size))

# Every state of every cache's name -> bit mapping gets a number never used before (0 = none), so a Request can
# remember "in mapping state E my name had bit B (or none)" and skip the hash lookup while E is current. No lock:
# the increment is one C statement under the GIL (no Python code runs between its read and its write).
cdef uint64_t _EPOCHS = 0


cdef inline uint64_t _new_epoch():
    global _EPOCHS
    _EPOCHS += 1
    return _EPOCHS
