# Included by _negotiation.pyx: core twin of distlab.reference.messages (same classes, same bytes). Messages are
# written with memcpy into one C++ string and parsed by a cursor over the bytes (_Reader); no struct module.

@cython.final
cdef class Request:
    """See :class:`distlab.reference.messages.Request`."""

    # readonly to Cython's descriptors: every write from Python goes through __setattr__, which forgets the hint
    cdef readonly int request_type, tensor_type, request_rank, root_rank, device, reduce_op, group_id, group_size
    cdef readonly double prescale_factor, postscale_factor
    cdef object _name
    cdef tuple _shape
    cdef string _cname
    cdef vector[int64_t] _cshape
    cdef int _ndim
    cdef int64_t _dims[8]
    # A lookup hint: this request's cache state (MISS, HIT, INVALID) and bit in the cache state numbered
    # _hint_epoch (see _new_epoch in _response_cache.pxi); any change of the request forgets it
    cdef uint64_t _hint_epoch
    cdef uint32_t _hint_bit
    cdef int _hint_state

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

    def __setattr__(self, str name, value):
        # the typed fields by C assignment (same conversions as __init__), the rest through their descriptors
        if name == "request_type": self.request_type = value
        elif name == "tensor_type": self.tensor_type = value
        elif name == "request_rank": self.request_rank = value
        elif name == "root_rank": self.root_rank = value
        elif name == "device": self.device = value
        elif name == "reduce_op": self.reduce_op = value
        elif name == "group_id": self.group_id = value
        elif name == "group_size": self.group_size = value
        elif name == "prescale_factor": self.prescale_factor = value
        elif name == "postscale_factor": self.postscale_factor = value
        else:
            PyObject_GenericSetAttr(self, name, value)
        self._hint_epoch = 0

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
        self._hint_epoch = 0

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.Request.to_bytes`."""
        cdef string buf
        self._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    # -- what the cache and the coordinator read, at C level (core only) --------------------------------------
    cdef inline str name(self):
        """``tensor_name``."""
        return self._name

    cdef inline uint32_t find_bit(self, unordered_map[string, uint32_t]& name_to_bit) noexcept:
        """The bit of this request's name in a cache's ``name_to_bit`` (_NO_BIT: none)."""
        it = name_to_bit.find(self._cname)
        return _NO_BIT if it == name_to_bit.end() else deref(it).second

    cdef inline int hinted(self, uint64_t epoch, uint32_t* bit) noexcept:
        """The cache state remembered for the cache state numbered ``epoch`` (its bit into ``bit``); -1 when none
        is (every state of every cache gets a new number, so an equal number means nothing changed)."""
        if self._hint_epoch != epoch:
            return -1
        bit[0] = self._hint_bit
        return self._hint_state

    cdef inline void remember(self, uint64_t epoch, uint32_t bit, int state) noexcept:
        """Remember this request's cache state and bit in the cache state numbered ``epoch``."""
        self._hint_epoch = epoch
        self._hint_bit = bit
        self._hint_state = state

    cdef inline int64_t num_elements(self):
        """The product of the dimensions (the element count of an allreduce's response)."""
        cdef int64_t count = 1
        cdef int i
        for i in range(self._ndim):
            count *= self._cshape[i]
        return count

    cdef inline int64_t first_dim(self):
        """The first dimension (an allgather's rows from this rank)."""
        return self._cshape[0]

    cdef inline bint same_shape(self, Request other):
        """Whether ``other`` has this request's shape."""
        return self._cshape == other._cshape

    cdef inline bint shape_in(self, _Params* params) noexcept:
        """Whether the shape a cache entry remembers (``params``) is this request's."""
        cdef int i
        if params.ndim != self._ndim:
            return False
        if params.ndim > 8:
            return params.shape == self._cshape
        for i in range(params.ndim):
            if params.dims[i] != self._dims[i]:
                return False
        return True

    cdef inline void shape_into(self, _Params* params):
        """Write this request's shape into the ``params`` a cache entry remembers."""
        params.shape = self._cshape
        params.ndim = self._ndim
        memcpy(params.dims, self._dims, sizeof(params.dims))  # a Request's dims beyond its ndim are zero

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
