# Included by _negotiation.pyx: core twin of distlab.reference.messages (same classes, same bytes).

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyBytes_FromStringAndSize(const char* v, Py_ssize_t n)

if sys.byteorder != "little":  # the wire format is little-endian and written with memcpy
    raise ImportError("the distlab core negotiation twin needs a little-endian machine; use DISTLAB_IMPL=reference")

cdef bytes _MAGIC_RQ = REQUEST_MAGIC
cdef bytes _MAGIC_RS = RESPONSE_MAGIC
cdef int _VERSION = WIRE_VERSION


cdef inline void _w(string& buf, const void* p, size_t n):
    buf.append(<const char*>p, n)


cdef inline string _utf8(object text) except *:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(text, &n)
    return string(p, <size_t>n)


cdef struct _Reader:
    const char* p
    Py_ssize_t n
    Py_ssize_t pos


cdef int _need(_Reader* r, Py_ssize_t k, str what) except -1:
    if r.pos + k > r.n:
        raise MessageFormatError(what)
    return 0


cdef object _read_text(_Reader* r, Py_ssize_t k, str what):
    _need(r, k, what)
    try:
        text = PyUnicode_DecodeUTF8(r.p + r.pos, k, NULL)
    except UnicodeDecodeError as exc:
        raise MessageFormatError(f"a name in the message is not valid UTF-8: {exc}") from None
    r.pos += k
    return text


cdef int _write_list_header(string& buf, bytes magic, bint shutdown, uint32_t count) except -1:
    cdef uint8_t version = _VERSION
    cdef uint8_t flags = FLAG_SHUTDOWN if shutdown else 0
    _w(buf, <const char*>magic, 4)
    _w(buf, &version, 1)
    _w(buf, &flags, 1)
    _w(buf, &count, 4)
    return 0


cdef int _read_list_header(_Reader* r, bytes magic, str what, uint32_t* count, uint8_t* flags) except -1:
    cdef uint8_t version
    if r.n < 10:
        raise MessageFormatError(f"{what} is truncated: {r.n} bytes, the header alone needs 10")
    got = PyBytes_FromStringAndSize(r.p, 4)
    if got != magic:
        raise MessageFormatError(f"not a distlab {what}: magic {got!r}, expected {magic!r}")
    version = <uint8_t>r.p[4]
    if version != _VERSION:
        raise MessageFormatError(f"{what} has wire version {version}, this distlab speaks version {_VERSION}: "
                                 "every rank must run the same distlab version")
    flags[0] = <uint8_t>r.p[5]
    memcpy(count, r.p + 6, 4)
    r.pos = 10
    return 0


cdef class Request:
    """See :class:`distlab.reference.messages.Request`."""

    cdef public int request_type, tensor_type, request_rank, root_rank, device, reduce_op
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
                 postscale_factor=1.0):
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
        self._shape = tuple(int(d) for d in value)
        self._cshape.clear()
        for d in self._shape:
            self._cshape.push_back(d)
        self._ndim = len(self._shape)
        for i in range(min(self._ndim, 8)):
            self._dims[i] = self._shape[i]

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
        f = self.prescale_factor; _w(buf, &f, 8)
        f = self.postscale_factor; _w(buf, &f, 8)
        name_len = <uint16_t>self._cname.size(); _w(buf, &name_len, 2)
        buf.append(self._cname)
        for dim in self._cshape:
            _w(buf, &dim, 8)
        return 0

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.Request.to_bytes`."""
        cdef string buf
        self._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    def _key(self):
        return (self._name, self.request_type, self.tensor_type, self._shape, self.request_rank, self.root_rank,
                self.device, self.reduce_op, self.prescale_factor, self.postscale_factor)

    def __eq__(self, other):
        return isinstance(other, Request) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        kind = REQUEST_TYPE_NAMES[self.request_type] if 0 <= self.request_type < len(REQUEST_TYPE_NAMES) else "?"
        return (f"Request({self._name!r}, {kind}, rank={self.request_rank}, dtype={self.tensor_type}, "
                f"shape={self._shape})")


cdef Request _parse_request(_Reader* r):
    cdef int32_t rank, root, device
    cdef uint8_t rtype, dtype, op, ndim
    cdef double pre, post
    cdef uint16_t name_len
    cdef int64_t dim
    cdef Py_ssize_t i
    _need(r, 34, "request list is truncated inside a request header")
    cdef const char* p = r.p + r.pos
    memcpy(&rank, p, 4); rtype = <uint8_t>p[4]; dtype = <uint8_t>p[5]; op = <uint8_t>p[6]; ndim = <uint8_t>p[7]
    memcpy(&root, p + 8, 4); memcpy(&device, p + 12, 4); memcpy(&pre, p + 16, 8); memcpy(&post, p + 24, 8)
    memcpy(&name_len, p + 32, 2)
    r.pos += 34
    _need(r, name_len + 8 * ndim, "request list is truncated inside a request's name or shape")
    name = _read_text(r, name_len, "")
    shape = []
    for i in range(ndim):
        memcpy(&dim, r.p + r.pos, 8)
        r.pos += 8
        shape.append(dim)
    return Request(name, rtype, dtype, shape, rank, root, device, op, pre, post)


cdef class Response:
    """See :class:`distlab.reference.messages.Response`."""

    cdef public int response_type, tensor_type, reduce_op, last_joined_rank
    cdef public list tensor_names, devices, tensor_sizes
    cdef public str error_message
    cdef public double prescale_factor, postscale_factor

    def __init__(self, response_type=ResponseType.ALLREDUCE, tensor_names=(), tensor_type=0, error_message="",
                 devices=(), tensor_sizes=(), prescale_factor=1.0, postscale_factor=1.0, reduce_op=0,
                 last_joined_rank=-1):
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
        return out

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

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.Response.to_bytes`."""
        cdef string buf
        self._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    def _key(self):
        return (self.response_type, self.tensor_names, self.tensor_type, self.error_message, self.devices,
                self.tensor_sizes, self.prescale_factor, self.postscale_factor, self.reduce_op,
                self.last_joined_rank)

    def __eq__(self, other):
        return isinstance(other, Response) and self._key() == other._key()

    __hash__ = None

    def __repr__(self):
        kind = (RESPONSE_TYPE_NAMES[self.response_type] if 0 <= self.response_type < len(RESPONSE_TYPE_NAMES)
                else "?")
        return f"Response({kind}, {self.tensor_names!r}, sizes={self.tensor_sizes})"


cdef uint32_t _read_u32(_Reader* r) except? 0xFFFFFFFF:
    cdef uint32_t v
    _need(r, 4, "response list is truncated inside a response")
    memcpy(&v, r.p + r.pos, 4)
    r.pos += 4
    return v


cdef Response _parse_response(_Reader* r):
    cdef Response out = Response.__new__(Response)
    cdef int32_t i32
    cdef uint32_t count, k
    cdef uint16_t u16
    cdef int64_t i64
    cdef const char* p
    _need(r, 28, "response list is truncated inside a response header")
    p = r.p + r.pos
    out.response_type = <uint8_t>p[0]
    out.tensor_type = <uint8_t>p[1]
    out.reduce_op = <uint8_t>p[2]
    memcpy(&i32, p + 4, 4); out.last_joined_rank = i32
    memcpy(&out.prescale_factor, p + 8, 8)
    memcpy(&out.postscale_factor, p + 16, 8)
    memcpy(&count, p + 24, 4)
    r.pos += 28
    names = []
    for k in range(count):
        _need(r, 2, "response list is truncated inside a response")
        memcpy(&u16, r.p + r.pos, 2)
        r.pos += 2
        _need(r, u16, "response list is truncated inside a response")
        names.append(_read_text(r, u16, ""))
    out.tensor_names = names
    count = _read_u32(r)
    _need(r, 4 * <Py_ssize_t>count, "response list is truncated inside a response")
    devices = []
    for k in range(count):
        memcpy(&i32, r.p + r.pos, 4)
        r.pos += 4
        devices.append(i32)
    out.devices = devices
    count = _read_u32(r)
    _need(r, 8 * <Py_ssize_t>count, "response list is truncated inside a response")
    sizes = []
    for k in range(count):
        memcpy(&i64, r.p + r.pos, 8)
        r.pos += 8
        sizes.append(i64)
    out.tensor_sizes = sizes
    count = _read_u32(r)
    _need(r, count, "response list is truncated inside a response")
    out.error_message = _read_text(r, count, "")
    return out


cdef class RequestList:
    """See :class:`distlab.reference.messages.RequestList`."""

    cdef public list requests
    cdef public bint shutdown

    def __init__(self, requests=(), shutdown=False):
        self.requests = list(requests)
        self.shutdown = shutdown

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.RequestList.to_bytes`."""
        cdef string buf
        cdef Request request
        _write_list_header(buf, _MAGIC_RQ, self.shutdown, len(self.requests))
        for request in self.requests:
            request._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @classmethod
    def from_bytes(cls, data):
        """See :meth:`distlab.reference.messages.RequestList.from_bytes`."""
        cdef bytes raw = bytes(data)
        cdef _Reader r
        cdef uint32_t count, k
        cdef uint8_t flags
        r.p = raw
        r.n = len(raw)
        r.pos = 0
        _read_list_header(&r, _MAGIC_RQ, "request list", &count, &flags)
        requests = []
        for k in range(count):
            requests.append(_parse_request(&r))
        if r.pos != r.n:
            raise MessageFormatError(f"request list has {r.n - r.pos} unexpected trailing bytes")
        return RequestList(requests, bool(flags & FLAG_SHUTDOWN))

    def __eq__(self, other):
        return isinstance(other, RequestList) and (self.requests, self.shutdown) == (other.requests, other.shutdown)

    __hash__ = None

    def __repr__(self):
        return f"RequestList({self.requests!r}, shutdown={self.shutdown})"


cdef class ResponseList:
    """See :class:`distlab.reference.messages.ResponseList`."""

    cdef public list responses
    cdef public bint shutdown

    def __init__(self, responses=(), shutdown=False):
        self.responses = list(responses)
        self.shutdown = shutdown

    def to_bytes(self):
        """See :meth:`distlab.reference.messages.ResponseList.to_bytes`."""
        cdef string buf
        cdef Response response
        _write_list_header(buf, _MAGIC_RS, self.shutdown, len(self.responses))
        for response in self.responses:
            response._write(buf)
        return PyBytes_FromStringAndSize(buf.data(), buf.size())

    @classmethod
    def from_bytes(cls, data):
        """See :meth:`distlab.reference.messages.ResponseList.from_bytes`."""
        cdef bytes raw = bytes(data)
        cdef _Reader r
        cdef uint32_t count, k
        cdef uint8_t flags
        r.p = raw
        r.n = len(raw)
        r.pos = 0
        _read_list_header(&r, _MAGIC_RS, "response list", &count, &flags)
        responses = []
        for k in range(count):
            responses.append(_parse_response(&r))
        if r.pos != r.n:
            raise MessageFormatError(f"response list has {r.n - r.pos} unexpected trailing bytes")
        return ResponseList(responses, bool(flags & FLAG_SHUTDOWN))

    def __eq__(self, other):
        return (isinstance(other, ResponseList)
                and (self.responses, self.shutdown) == (other.responses, other.shutdown))

    __hash__ = None

    def __repr__(self):
        return f"ResponseList({self.responses!r}, shutdown={self.shutdown})"
