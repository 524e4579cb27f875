# Included by _negotiation.pyx: core twin of distlab.reference.messages (same classes, same bytes). Messages are
# written with memcpy into one C++ string and parsed by a cursor over the bytes (_Reader); no struct module.

cdef class Request:
    """See :class:`distlab.reference.messages.Request`."""

    cdef public int request_type, tensor_type, request_rank, root_rank, device, reduce_op, group_id, group_size
    cdef public double prescale_factor, postscale_factor
    cdef object _name
    cdef tuple _shape
    cdef string _cname
    cdef vector[int64_t] _cshape
    cdef int _ndim
    cdef int64_t _dims[8]
    # A lookup hint: the cache bit of this name in the cache state numbered _hint_epoch (see ResponseCache._state)
    cdef uint64_t _hint_epoch
    cdef uint32_t _hint_bit

    def __init__(self, tensor_name="", request_type=RequestType.ALLREDUCE, tensor_type=0, tensor_shape=(),
                 request_rank=0, root_rank=0, device=CPU_DEVICE_ID, reduce_op=0, prescale_factor=1.0,
                 postscale_factor=1.0, group_id=_wire.NO_GROUP, group_size=0):
        self.tensor_name = tensor_name
        self.request_type = request_type
        self.tensor_type = tensor_type
        self.tensor_shape = tensor_shape
        self.request_rank = request_rank
        self.root_rank = root_rank
        self.device = device
        self.reduce_op = reduce_op
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.group_id = group_id
        self.group_size = group_size

    @property
    def tensor_name(self):
        return self._name

    @tensor_name.setter
    def tensor_name(self, value):
        self._name = str(value)
        self._cname = _utf8(self._name)
        self._hint_epoch = 0

    @property
    def tensor_shape(self):
        return self._shape

    @tensor_shape.setter
    def tensor_shape(self, value):
        cdef int i
        self._shape = tuple([int(d) for d in value])
        self._cshape.clear()
        for d in self._shape:
            self._cshape.push_back(d)
        self._ndim = len(self._shape)
        for i in range(min(self._ndim, 8)):
            self._dims[i] = self._cshape[i]

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.Request.to_bytes`."""
        cdef string buf
        self._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @staticmethod
    cdef Request _parse(_Reader* r):
        # the fields of REQUEST_HEAD at its offsets, range-checked, then the name and the dims
        cdef Request out = Request.__new__(Request)
        cdef int32_t i32
        cdef uint16_t name_len
        cdef int64_t dim, count, limit
        cdef int k, ndim
        cdef const char* p
        _need(r, _REQUEST_HEAD_SIZE, "request_head")
        p = r.p + r.pos
        memcpy(&i32, p, 4); out.request_rank = i32
        out.request_type = <uint8_t>p[4]
        out.tensor_type = <uint8_t>p[5]
        out.reduce_op = <uint8_t>p[6]
        ndim = <uint8_t>p[7]
        memcpy(&i32, p + 8, 4); out.root_rank = i32
        memcpy(&i32, p + 12, 4); out.device = i32
        memcpy(&i32, p + 16, 4); out.group_id = i32
        memcpy(&i32, p + 20, 4); out.group_size = i32
        memcpy(&out.prescale_factor, p + 24, 8)
        memcpy(&out.postscale_factor, p + 32, 8)
        memcpy(&name_len, p + 40, 2)
        if not _request_head_ok(out):
            raise request_field_error(out.request_rank, out.request_type, out.tensor_type, out.reduce_op,
                                      out.root_rank, out.device, out.group_id, out.group_size,
                                      out.prescale_factor, out.postscale_factor)
        r.pos += _REQUEST_HEAD_SIZE
        _need(r, name_len + 8 * ndim, "request_body")
        out._name = _decode_name(r, name_len)
        out._cname = string(r.p + r.pos - name_len, name_len)
        out._ndim = ndim
        for k in range(ndim):
            memcpy(&dim, r.p + r.pos, 8)
            r.pos += 8
            out._cshape.push_back(dim)
            if k < 8:
                out._dims[k] = dim
        for k in range(ndim):
            if out._cshape[k] < 0:
                raise dimension_error(k, out._cshape[k])
        # count * itemsize must fit int64: exact, without overflowing (a 0 dim makes it 0; otherwise every dim
        # must be at most limit // (the product so far))
        limit = INT64_MAX // _DTYPE_SIZE[out.tensor_type]
        count = 1
        for k in range(ndim):
            if out._cshape[k] == 0:
                count = 0
        for k in range(ndim if count else 0):
            if out._cshape[k] > limit // count:
                raise shape_size_error(out._name, tuple(out._cshape), out.tensor_type)
            count *= out._cshape[k]
        out._shape = tuple(out._cshape)
        return out

    def _key(self):
        return (self._name, self.request_type, self.tensor_type, self._shape, self.request_rank, self.root_rank,
                self.device, self.reduce_op, self.prescale_factor, self.postscale_factor, self.group_id,
                self.group_size)

    def __eq__(self, other):
        return type(other) is Request and self._key() == (<Request>other)._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return request_repr(self)

    cdef int _write(self, string& buf) except -1:
        cdef int32_t i32
        cdef uint8_t u8
        cdef uint16_t name_len
        cdef double f
        cdef int64_t dim
        if self._cname.size() > 0xFFFF:
            raise ValueError(f"tensor name too long ({self._cname.size()} bytes, at most 65535)")
        if self._cshape.size() > 255:
            raise ValueError(f"tensor has {self._cshape.size()} dimensions, at most 255 are supported")
        i32 = self.request_rank; _w(buf, &i32, 4)
        u8 = <uint8_t>self.request_type; _w(buf, &u8, 1)
        u8 = <uint8_t>self.tensor_type; _w(buf, &u8, 1)
        u8 = <uint8_t>self.reduce_op; _w(buf, &u8, 1)
        u8 = <uint8_t>self._cshape.size(); _w(buf, &u8, 1)
        i32 = self.root_rank; _w(buf, &i32, 4)
        i32 = self.device; _w(buf, &i32, 4)
        i32 = self.group_id; _w(buf, &i32, 4)
        i32 = self.group_size; _w(buf, &i32, 4)
        f = self.prescale_factor; _w(buf, &f, 8)
        f = self.postscale_factor; _w(buf, &f, 8)
        name_len = <uint16_t>self._cname.size(); _w(buf, &name_len, 2)
        buf.append(self._cname)
        for dim in self._cshape:
            _w(buf, &dim, 8)
        return 0


cdef class Response:
    """See :class:`distlab.reference.messages.Response`."""

    cdef public int response_type, tensor_type, reduce_op, last_joined_rank, group_id
    cdef public list tensor_names, devices, tensor_sizes
    cdef public str error_message
    cdef public double prescale_factor, postscale_factor

    def __init__(self, response_type=ResponseType.ALLREDUCE, tensor_names=(), tensor_type=0, error_message="",
                 devices=(), tensor_sizes=(), prescale_factor=1.0, postscale_factor=1.0, reduce_op=0,
                 last_joined_rank=-1, group_id=_wire.NO_GROUP):
        self.response_type = response_type
        self.tensor_names = [str(n) for n in tensor_names]
        self.tensor_type = tensor_type
        self.error_message = str(error_message)
        self.devices = [int(d) for d in devices]
        self.tensor_sizes = [int(s) for s in tensor_sizes]
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.reduce_op = reduce_op
        self.last_joined_rank = last_joined_rank
        self.group_id = group_id

    cpdef Response copy(self):
        """See :meth:`distlab.reference.messages.Response.copy`."""
        cdef Response out = Response.__new__(Response)
        out.response_type = self.response_type
        out.tensor_names = list(self.tensor_names)
        out.tensor_type = self.tensor_type
        out.error_message = self.error_message
        out.devices = list(self.devices)
        out.tensor_sizes = list(self.tensor_sizes)
        out.prescale_factor = self.prescale_factor
        out.postscale_factor = self.postscale_factor
        out.reduce_op = self.reduce_op
        out.last_joined_rank = self.last_joined_rank
        out.group_id = self.group_id
        return out

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.Response.to_bytes`."""
        cdef string buf
        self._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @staticmethod
    cdef Response _parse(_Reader* r):
        # the fields of RESPONSE_HEAD at its offsets, range-checked, then the counted lists (each count checked
        # against the bytes left before anything is allocated, each value against its range)
        cdef Response out = Response.__new__(Response)
        cdef int32_t i32
        cdef uint32_t count, k
        cdef uint16_t u16
        cdef int64_t i64
        cdef uint8_t pad
        cdef const char* p
        _need(r, _RESPONSE_HEAD_SIZE, "response_head")
        p = r.p + r.pos
        out.response_type = <uint8_t>p[0]
        out.tensor_type = <uint8_t>p[1]
        out.reduce_op = <uint8_t>p[2]
        pad = <uint8_t>p[3]
        memcpy(&i32, p + 4, 4); out.last_joined_rank = i32
        memcpy(&i32, p + 8, 4); out.group_id = i32
        memcpy(&out.prescale_factor, p + 12, 8)
        memcpy(&out.postscale_factor, p + 20, 8)
        memcpy(&count, p + 28, 4)
        if not (out.response_type < _NUM_RESPONSE_TYPES and out.tensor_type < _NUM_DTYPES
                and out.reduce_op <= _MAX_REDUCE_OP and pad == 0 and out.last_joined_rank >= -1
                and out.group_id >= NO_GROUP and isfinite(out.prescale_factor) and isfinite(out.postscale_factor)):
            raise response_field_error(out.response_type, out.tensor_type, out.reduce_op, pad, out.last_joined_rank,
                                       out.group_id, out.prescale_factor, out.postscale_factor)
        r.pos += _RESPONSE_HEAD_SIZE
        out.tensor_names = []
        for k in range(count):
            u16 = <uint16_t>_read_uint(r, 2)
            _need(r, u16, "response_body")
            out.tensor_names.append(_decode_name(r, u16))
        count = <uint32_t>_read_uint(r, 4)
        _need(r, 4 * <Py_ssize_t>count, "response_body")
        out.devices = []
        for k in range(count):
            memcpy(&i32, r.p + r.pos, 4)
            r.pos += 4
            if i32 < CPU_DEVICE:
                raise device_error(k, i32)
            out.devices.append(i32)
        count = <uint32_t>_read_uint(r, 4)
        _need(r, 8 * <Py_ssize_t>count, "response_body")
        out.tensor_sizes = []
        for k in range(count):
            memcpy(&i64, r.p + r.pos, 8)
            r.pos += 8
            if i64 < 0 or i64 > INT64_MAX // _DTYPE_SIZE[out.tensor_type]:
                raise size_error(k, i64, out.tensor_type)
            out.tensor_sizes.append(i64)
        count = <uint32_t>_read_uint(r, 4)
        _need(r, count, "response_body")
        out.error_message = _decode_name(r, count)
        return out

    def _key(self):
        return (self.response_type, self.tensor_names, self.tensor_type, self.error_message, self.devices,
                self.tensor_sizes, self.prescale_factor, self.postscale_factor, self.reduce_op,
                self.last_joined_rank, self.group_id)

    def __eq__(self, other):
        return type(other) is Response and self._key() == (<Response>other)._key()

    __hash__ = None

    def __repr__(self):
        return response_repr(self)

    cdef int _write(self, string& buf) except -1:
        cdef uint8_t u8
        cdef int32_t i32
        cdef uint32_t u32
        cdef uint16_t u16
        cdef int64_t i64
        cdef double f
        cdef string s
        u8 = <uint8_t>self.response_type; _w(buf, &u8, 1)
        u8 = <uint8_t>self.tensor_type; _w(buf, &u8, 1)
        u8 = <uint8_t>self.reduce_op; _w(buf, &u8, 1)
        u8 = 0; _w(buf, &u8, 1)
        i32 = self.last_joined_rank; _w(buf, &i32, 4)
        i32 = self.group_id; _w(buf, &i32, 4)
        f = self.prescale_factor; _w(buf, &f, 8)
        f = self.postscale_factor; _w(buf, &f, 8)
        u32 = len(self.tensor_names); _w(buf, &u32, 4)
        for name in self.tensor_names:
            s = _utf8(name)
            if s.size() > 0xFFFF:
                raise ValueError(f"tensor name too long ({s.size()} bytes, at most 65535)")
            u16 = <uint16_t>s.size(); _w(buf, &u16, 2)
            buf.append(s)
        u32 = len(self.devices); _w(buf, &u32, 4)
        for d in self.devices:
            i32 = d; _w(buf, &i32, 4)
        u32 = len(self.tensor_sizes); _w(buf, &u32, 4)
        for v in self.tensor_sizes:
            i64 = v; _w(buf, &i64, 8)
        s = _utf8(self.error_message)
        u32 = <uint32_t>s.size(); _w(buf, &u32, 4)
        buf.append(s)
        return 0


cdef class RequestList:
    """See :class:`distlab.reference.messages.RequestList`."""

    cdef public list requests
    cdef public bint shutdown
    cdef public str shutdown_reason
    cdef public int process_set_id

    def __init__(self, requests=(), shutdown=False, shutdown_reason="", process_set_id=_wire.GLOBAL_PROCESS_SET_ID):
        self.requests = list(requests)
        self.shutdown = shutdown
        self.shutdown_reason = str(shutdown_reason)
        self.process_set_id = process_set_id

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.RequestList.to_bytes`."""
        cdef string buf
        cdef Request request
        _pack_list(buf, _MAGIC_RQ, self.shutdown, self.shutdown_reason, self.process_set_id, len(self.requests))
        for request in self.requests:
            request._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @classmethod
    def from_bytes(cls, data):
        """See :meth:`distlab.reference.messages.RequestList.from_bytes`."""
        cdef bytes raw = bytes(data)
        cdef _Reader r
        cdef uint32_t count, k
        cdef RequestList out = RequestList.__new__(RequestList)
        count = _parse_list(&r, raw, _MAGIC_RQ, "request list", out)
        out.requests = []
        for k in range(count):
            out.requests.append(Request._parse(&r))
        _no_trailing(&r, "request list")
        return out

    def __eq__(self, other):
        return (type(other) is RequestList and self.requests == (<RequestList>other).requests
                and _list_key(self) == _list_key(other))

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


cdef class ResponseList:
    """See :class:`distlab.reference.messages.ResponseList`."""

    cdef public list responses
    cdef public bint shutdown
    cdef public str shutdown_reason
    cdef public int process_set_id

    def __init__(self, responses=(), shutdown=False, shutdown_reason="", process_set_id=_wire.GLOBAL_PROCESS_SET_ID):
        self.responses = list(responses)
        self.shutdown = shutdown
        self.shutdown_reason = str(shutdown_reason)
        self.process_set_id = process_set_id

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.ResponseList.to_bytes`."""
        cdef string buf
        cdef Response response
        _pack_list(buf, _MAGIC_RS, self.shutdown, self.shutdown_reason, self.process_set_id, len(self.responses))
        for response in self.responses:
            response._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @classmethod
    def from_bytes(cls, data):
        """See :meth:`distlab.reference.messages.ResponseList.from_bytes`."""
        cdef bytes raw = bytes(data)
        cdef _Reader r
        cdef uint32_t count, k
        cdef ResponseList out = ResponseList.__new__(ResponseList)
        count = _parse_list(&r, raw, _MAGIC_RS, "response list", out)
        out.responses = []
        for k in range(count):
            out.responses.append(Response._parse(&r))
        _no_trailing(&r, "response list")
        return out

    def __eq__(self, other):
        return (type(other) is ResponseList and self.responses == (<ResponseList>other).responses
                and _list_key(self) == _list_key(other))

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


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
