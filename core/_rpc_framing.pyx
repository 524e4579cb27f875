# cython: language_level=3
"""Core twin of :mod:`distlab.reference.rpc_framing` (read that): same names, same order, same errors.

The header is read and written field by field in C (little-endian, whatever the machine), and the pickle check
walks the opcodes over the raw bytes (the buffer protocol, ``PyBUF_SIMPLE``: cheaper to take than a typed
memoryview, which matters at a few hundred nanoseconds per message): no Python object per opcode.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from distlab._common import rpc_framing as _shared
from distlab._common.rpc_framing import (bad_batch, bad_buffer_size, bad_control, bad_counts, bad_device,
                                         bad_devices, bad_flags, bad_fork_record, bad_magic, bad_pickle,
                                         bad_slot, bad_slot_number, bad_version, buffer_count, short_message, too_short,
                                         unknown_kind, with_sizes)
from distlab._wire import RFD_TUPLE_SIZE, RPC_WIRE_MAGIC
from distlab.errors import RpcMessageError

__all__ = ["pack_header", "unpack_header", "unpack_devices", "pack_batch", "split_batch", "check_pickle"]

cdef enum:
    VERSION = 4
    MAX_SLOT = 255
    MAX_BUFFERS = 65536
    MAX_FORKS = 65536
    MAX_DEVICES = 65536
    FLAG_DEVICES = 8
    HOST_DEVICE = -1
    MAX_PUT_DIGITS = 18
    OP_UNKNOWN = 0
    OP_PLAIN = 1
    OP_STOP = 2
    OP_FIXED1 = 3
    OP_FIXED2 = 4
    OP_FIXED4 = 5
    OP_FIXED8 = 6
    OP_COUNT1 = 7
    OP_COUNT4 = 8
    OP_COUNT8 = 9
    OP_LINE = 10
    OP_LINE2 = 11
    OP_PUT_LINE = 12
    OP_PUT4 = 13
    OP_FRAME = 14
    OP_NEXT_BUFFER = 15
    K_RESPONSE = 0
    K_STOP = 7
    K_WAKE = 8
    K_BATCH = 9
    NUM_KINDS = 10
    USER_KIND_BASE = 64
    RESPONSE_FLAGS = 9
    REQUEST_FLAGS = 14

# The C constants above must be the shared ones (they describe bytes that travel between ranks).
# Sizes are read from the shared module (the header layout is the struct there); the codes are asserted equal.
cdef Py_ssize_t HEADER_SIZE = _shared.HEADER.size
cdef Py_ssize_t COPY_MAX = _shared.COPY_MAX
cdef Py_ssize_t FORK_INTS = RFD_TUPLE_SIZE
assert (VERSION, MAX_BUFFERS, MAX_FORKS, MAX_PUT_DIGITS, MAX_DEVICES, FLAG_DEVICES, HOST_DEVICE, MAX_SLOT) == (
    _shared.VERSION, _shared.MAX_BUFFERS, _shared.MAX_FORKS, _shared.MAX_PUT_DIGITS, _shared.MAX_DEVICES,
    _shared.FLAG_DEVICES, _shared.HOST_DEVICE, _shared.MAX_SLOT)
assert (OP_UNKNOWN, OP_PLAIN, OP_STOP, OP_FIXED1, OP_FIXED2, OP_FIXED4, OP_FIXED8, OP_COUNT1, OP_COUNT4, OP_COUNT8,
        OP_LINE, OP_LINE2, OP_PUT_LINE, OP_PUT4, OP_FRAME, OP_NEXT_BUFFER) == (
    _shared.OP_UNKNOWN, _shared.OP_PLAIN, _shared.OP_STOP, _shared.OP_FIXED1, _shared.OP_FIXED2, _shared.OP_FIXED4,
    _shared.OP_FIXED8, _shared.OP_COUNT1, _shared.OP_COUNT4, _shared.OP_COUNT8, _shared.OP_LINE, _shared.OP_LINE2,
    _shared.OP_PUT_LINE, _shared.OP_PUT4, _shared.OP_FRAME, _shared.OP_NEXT_BUFFER)
assert (K_RESPONSE, K_STOP, K_WAKE, K_BATCH, NUM_KINDS, USER_KIND_BASE, RESPONSE_FLAGS, REQUEST_FLAGS) == (
    _shared.K_RESPONSE, _shared.K_STOP, _shared.K_WAKE, _shared.K_BATCH, _shared.NUM_KINDS, _shared.USER_KIND_BASE,
    _shared.RESPONSE_FLAGS, _shared.REQUEST_FLAGS)
assert _shared.HEADER.format == "<2sBBiiqiii" and len(RPC_WIRE_MAGIC) == 2

cdef uint8_t OP_CLASSES[256]
for _code in range(256):
    OP_CLASSES[_code] = _shared.OP_CLASSES[_code]
cdef uint8_t MAGIC0 = RPC_WIRE_MAGIC[0], MAGIC1 = RPC_WIRE_MAGIC[1]


def pack_header(int kind, int flags, int64_t mid, sizes, forks, meta, body, devices=(), int slot=0):
    """See :func:`distlab.reference.rpc_framing.pack_header`."""
    cdef Py_buffer meta_b, body_b
    cdef Py_ssize_t nbuf = len(sizes), nforks = len(forks), i, at, ndev = len(devices)
    cdef uint8_t* p
    if not 0 <= slot <= MAX_SLOT:
        raise bad_slot_number(slot)
    if ndev:
        if ndev != nbuf:
            raise bad_devices(devices, nbuf)
        flags |= FLAG_DEVICES
    PyObject_GetBuffer(meta, &meta_b, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(body, &body_b, PyBUF_SIMPLE)
        try:
            at = HEADER_SIZE + 8 * (nbuf + ndev) + 8 * FORK_INTS * nforks
            out = PyBytes_FromStringAndSize(NULL, at + meta_b.len + body_b.len)
            p = <uint8_t*>PyBytes_AS_STRING(out)
            p[0], p[1], p[2], p[3] = MAGIC0, MAGIC1, VERSION, <uint8_t>slot
            _put(p + 4, kind, 4)
            _put(p + 8, flags, 4)
            _put(p + 12, mid, 8)
            _put(p + 20, nbuf, 4)
            _put(p + 24, nforks, 4)
            _put(p + 28, meta_b.len, 4)
            for i in range(nbuf):
                _put(p + HEADER_SIZE + 8 * i, sizes[i], 8)
            for i in range(ndev):
                _put(p + HEADER_SIZE + 8 * (nbuf + i), devices[i], 8)
            i = HEADER_SIZE + 8 * (nbuf + ndev)
            for fork in forks:
                if len(fork) != FORK_INTS:
                    raise bad_fork_record(fork)
                for value in fork:
                    _put(p + i, value, 8)
                    i += 8
            memcpy(p + at, meta_b.buf, meta_b.len)
            memcpy(p + at + meta_b.len, body_b.buf, body_b.len)
        finally:
            PyBuffer_Release(&body_b)
    finally:
        PyBuffer_Release(&meta_b)
    return out


def unpack_header(data, int64_t max_bytes):
    """See :func:`distlab.reference.rpc_framing.unpack_header`."""
    cdef Py_buffer b
    cdef Py_ssize_t n
    PyObject_GetBuffer(data, &b, PyBUF_SIMPLE)
    try:
        kind, flags, mid, sizes, forks, meta_at, body_at = _parse_header(<const uint8_t*>b.buf, b.len, max_bytes)
        slot = (<const uint8_t*>b.buf)[3]
        n = b.len
        if n - <Py_ssize_t>body_at <= COPY_MAX:
            body = PyBytes_FromStringAndSize(<const char*>b.buf + <Py_ssize_t>body_at, n - <Py_ssize_t>body_at)
        else:
            body = None
    finally:
        PyBuffer_Release(&b)
    meta = memoryview(data)[meta_at:body_at] if body_at > meta_at else b""
    if body is None:
        body = memoryview(data)[body_at:]
    return kind, flags, mid, sizes, forks, meta, body, slot


def unpack_devices(data):
    """See :func:`distlab.reference.rpc_framing.unpack_devices`."""
    cdef Py_buffer b
    cdef const uint8_t* v
    cdef int32_t kind, flags, nbuf
    cdef int64_t mid, device
    cdef Py_ssize_t i
    cdef object value  # PyTuple_SET_ITEM steals the reference Py_INCREF took
    PyObject_GetBuffer(data, &b, PyBUF_SIMPLE)
    try:
        v = <const uint8_t*>b.buf
        if b.len < HEADER_SIZE:
            raise short_message(b.len)
        kind, flags, mid = <int32_t>_get(v + 4, 4), <int32_t>_get(v + 8, 4), <int64_t>_get(v + 12, 8)
        if not flags & FLAG_DEVICES:
            return ()
        nbuf = <int32_t>_get(v + 20, 4)
        if HEADER_SIZE + 16 * <Py_ssize_t>nbuf > b.len:
            raise too_short(HEADER_SIZE + 16 * nbuf, b.len, kind, flags, mid)
        devices = PyTuple_New(nbuf)
        for i in range(nbuf):
            device = <int64_t>_get(v + HEADER_SIZE + 8 * (nbuf + i), 8)
            if not HOST_DEVICE <= device < MAX_DEVICES:
                raise bad_device(i, device, kind, flags, mid)
            value = device
            Py_INCREF(value)
            PyTuple_SET_ITEM(devices, i, value)
        return devices
    finally:
        PyBuffer_Release(&b)


def pack_batch(frames):
    """See :func:`distlab.reference.rpc_framing.pack_batch`."""
    cdef list parts = []
    for frame in frames:
        parts.append(_shared.FRAME_LEN.pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def split_batch(data):
    """See :func:`distlab.reference.rpc_framing.split_batch`."""
    cdef Py_buffer b
    cdef Py_ssize_t end, pos = 0
    cdef int64_t size
    frames = []
    view = memoryview(data)
    PyObject_GetBuffer(data, &b, PyBUF_SIMPLE)
    try:
        end = b.len
        while pos < end:
            if pos + 4 > end:
                raise bad_batch(pos, -1, end)
            size = <int64_t>_get(<const uint8_t*>b.buf + pos, 4)
            if pos + 4 + size > end:
                raise bad_batch(pos, size, end)
            frames.append(view[pos + 4:pos + 4 + size])
            pos += 4 + size
    finally:
        PyBuffer_Release(&b)
    return frames


def check_pickle(data):
    """See :func:`distlab.reference.rpc_framing.check_pickle`."""
    cdef Py_buffer b
    PyObject_GetBuffer(data, &b, PyBUF_SIMPLE)
    try:
        return _walk_pickle(<const uint8_t*>b.buf, b.len, _PAYLOAD)
    finally:
        PyBuffer_Release(&b)


# --- core-only helpers ---

cdef tuple _PAYLOAD = ("payload", None, None, None)


cdef tuple _parse_header(const uint8_t* v, Py_ssize_t n, int64_t max_bytes):
    """unpack_header on raw bytes: (kind, flags, mid, sizes, forks, meta offset, body offset)."""
    cdef Py_ssize_t i, j, k, meta_at, body_at, taken
    cdef int32_t kind, flags, nbuf, nforks, nmeta, allowed
    cdef int64_t mid, size, total = 0
    cdef bint control
    cdef object value  # an object: PyTuple_SET_ITEM steals the reference Py_INCREF took on this very object
    if n < HEADER_SIZE:
        raise short_message(n)
    if v[0] != MAGIC0 or v[1] != MAGIC1:
        raise bad_magic(v[0:2])
    kind, flags, mid = <int32_t>_get(v + 4, 4), <int32_t>_get(v + 8, 4), <int64_t>_get(v + 12, 8)
    if v[2] != VERSION:
        raise bad_version(v[2], kind, flags, mid)
    if kind < 0 or NUM_KINDS <= kind < USER_KIND_BASE:
        raise unknown_kind(kind, flags, mid)
    control = kind == K_STOP or kind == K_WAKE or kind == K_BATCH
    if v[3] and (control or kind == K_RESPONSE):
        raise bad_slot(v[3], kind, flags, mid)
    allowed = RESPONSE_FLAGS if kind == K_RESPONSE else (0 if control else REQUEST_FLAGS)
    if flags & ~allowed:
        raise bad_flags(kind, flags, mid)
    nbuf, nforks, nmeta = <int32_t>_get(v + 20, 4), <int32_t>_get(v + 24, 4), <int32_t>_get(v + 28, 4)
    if not (0 <= nbuf <= MAX_BUFFERS and 0 <= nforks <= MAX_FORKS and nmeta >= 0):
        raise bad_counts(nbuf, nforks, nmeta, kind, flags, mid)
    # the device records (FLAG_DEVICES) follow the sizes
    meta_at = (HEADER_SIZE + (16 if flags & FLAG_DEVICES else 8) * <Py_ssize_t>nbuf
               + 8 * FORK_INTS * <Py_ssize_t>nforks)
    body_at = meta_at + nmeta
    if body_at > n:
        raise too_short(body_at, n, kind, flags, mid)
    sizes = PyTuple_New(nbuf)
    for i in range(nbuf):
        size = <int64_t>_get(v + HEADER_SIZE + 8 * i, 8)
        total += size  # |size| < 2**63 and total stays <= max_bytes < 2**62 until then: no overflow
        if size < 0 or total > max_bytes:
            raise bad_buffer_size(i, size, total, max_bytes, kind, flags, mid)
        value = size
        Py_INCREF(value)
        PyTuple_SET_ITEM(sizes, i, value)
    if control:
        if nbuf or nforks or nmeta or (kind != K_BATCH and body_at != n):
            raise with_sizes(bad_control(kind, nbuf, nforks, nmeta, n - body_at, flags, mid), sizes)
    else:
        if nmeta:
            try:
                taken = _walk_pickle(v + meta_at, nmeta, ("metadata", kind, flags, mid))
            except RpcMessageError as exc:
                raise with_sizes(exc, sizes) from None
            if taken:
                raise with_sizes(buffer_count("metadata", taken, 0, kind, flags, mid), sizes)
        try:
            taken = _walk_pickle(v + body_at, n - body_at, ("payload", kind, flags, mid))
        except RpcMessageError as exc:
            raise with_sizes(exc, sizes) from None
        if taken != nbuf:
            raise with_sizes(buffer_count("payload", taken, nbuf, kind, flags, mid), sizes)
    forks = []
    j = HEADER_SIZE + (16 if flags & FLAG_DEVICES else 8) * nbuf
    for i in range(nforks):
        record = PyTuple_New(FORK_INTS)
        for k in range(FORK_INTS):
            value = <int64_t>_get(v + j, 8)
            Py_INCREF(value)
            PyTuple_SET_ITEM(record, k, value)
            j += 8
        forks.append(record)
    return kind, flags, mid, sizes, forks, meta_at, body_at


cdef Py_ssize_t _walk_pickle(const uint8_t* v, Py_ssize_t n, tuple ctx) except -1:
    """check_pickle on raw bytes; ``ctx`` (part, kind, flags, mid) goes into a refusal."""
    cdef Py_ssize_t pos = 0, at, width, lines, digits
    cdef Py_ssize_t opcodes = 0, buffers = 0
    cdef uint8_t opcode, op
    cdef uint64_t count, index
    if n >= 2 and not (v[0] == 0x80 and 2 <= v[1] <= 5):
        raise _shared.bad_opening(PyBytes_FromStringAndSize(<const char*>v, 2), *ctx)
    while pos < n:
        at = pos
        opcode = v[pos]
        op = OP_CLASSES[opcode]
        pos += 1
        opcodes += 1
        if op == OP_PLAIN:
            continue
        if op == OP_NEXT_BUFFER:
            buffers += 1
            continue
        if op == OP_STOP:
            if pos != n:
                raise bad_pickle(at, opcode, f"{n - pos} bytes follow the STOP opcode", *ctx)
            return buffers
        if OP_FIXED1 <= op <= OP_FIXED8:
            pos += 1 << (op - OP_FIXED1)  # 1, 2, 4, 8 bytes
            if pos > n:
                raise bad_pickle(at, opcode, "its argument is cut off", *ctx)
        elif OP_COUNT1 <= op <= OP_COUNT8 or op == OP_FRAME:
            width = 1 if op == OP_COUNT1 else (4 if op == OP_COUNT4 else 8)
            if pos + width > n:
                raise bad_pickle(at, opcode, "its byte count is cut off", *ctx)
            count = _get(v + pos, width)
            pos += width
            if count > <uint64_t>(n - pos):
                raise bad_pickle(at, opcode, f"claims {count} bytes but only {n - pos} remain", *ctx)
            if op != OP_FRAME:
                pos += <Py_ssize_t>count
        elif op == OP_LINE or op == OP_LINE2:
            for lines in range(1 if op == OP_LINE else 2):
                while pos < n and v[pos] != 10:
                    pos += 1
                if pos >= n:
                    raise bad_pickle(at, opcode, "its argument has no newline", *ctx)
                pos += 1
        elif op == OP_PUT4:
            if pos + 4 > n:
                raise bad_pickle(at, opcode, "its argument is cut off", *ctx)
            index = _get(v + pos, 4)
            pos += 4
            if index >= <uint64_t>opcodes:
                raise bad_pickle(at, opcode, f"memo index {index} but only {opcodes} opcodes were read", *ctx)
        elif op == OP_PUT_LINE:
            index = 0
            digits = 0
            while pos < n and 48 <= v[pos] <= 57 and digits <= MAX_PUT_DIGITS:
                index = index * 10 + (v[pos] - 48)
                pos += 1
                digits += 1
            if not (0 < digits <= MAX_PUT_DIGITS and pos < n and v[pos] == 10):
                raise bad_pickle(at, opcode, f"a PUT index is 1 to {MAX_PUT_DIGITS} decimal digits", *ctx)
            pos += 1
            if index >= <uint64_t>opcodes:
                raise bad_pickle(at, opcode, f"memo index {index} but only {opcodes} opcodes were read", *ctx)
        else:
            raise bad_pickle(at, opcode, "not a pickle opcode", *ctx)
    raise bad_pickle(n, -1, "no STOP opcode", *ctx)

cdef inline void _put(uint8_t* p, int64_t value, int width) noexcept:
    """Store the low ``width`` bytes of ``value``, little-endian."""
    cdef int i
    cdef uint64_t u = <uint64_t>value
    for i in range(width):
        p[i] = <uint8_t>(u >> (8 * i))


cdef inline uint64_t _get(const uint8_t* p, int width) noexcept:
    """Load ``width`` bytes, little-endian, unsigned (the caller casts to a signed type where the field is)."""
    cdef int i
    cdef uint64_t u = 0
    for i in range(width):
        u |= (<uint64_t>p[i]) << (8 * i)
    return u
