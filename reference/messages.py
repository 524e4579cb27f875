"""Negotiation messages: ``Request``, ``Response`` and their lists, with a compact binary wire format.

Twinned with ``core/_negotiation.pyx`` (through its include ``core/_negotiation_messages.pxi``).

Mirrors horovod/common/message.h and message.cc. A rank describes each collective it wants to run as a
``Request`` (name, type, dtype, shape, root, device, reduce op, scale factors); the coordinator answers with
``Response`` objects that say which tensors to run now, possibly several fused into one. Horovod serialises these
with FlatBuffers; we use a small fixed layout described in :mod:`distlab._wire`, written with
:mod:`struct`. The core twin writes the same bytes with C code; tests compare them byte for byte.
"""
from __future__ import annotations

from distlab._common.negotiation import (
    REQUEST_FIELDS,
    RESPONSE_FIELDS,
    format_error,
    list_repr,
    request_repr,
    response_repr,
)
from distlab._wire import (
    CPU_DEVICE_ID,
    FLAG_SHUTDOWN,
    LIST_HEADER,
    NEGOTIATION_WIRE_VERSION,
    REQUEST_HEAD,
    REQUEST_MAGIC,
    RESPONSE_HEAD,
    RESPONSE_MAGIC,
    RequestType,
    ResponseType,
)

__all__ = ["Request", "Response", "RequestList", "ResponseList"]


class Request:
    """One rank's wish to run one named collective (mirrors message.h ``Request``).

    Parameters
    ----------
    tensor_name : str
        The name every rank uses for this tensor.
    request_type : int
        A :class:`~distlab._wire.RequestType` code.
    tensor_type : int
        The dtype's wire code (:func:`~distlab._common.negotiation.dtype_code`).
    tensor_shape : tuple of int
    request_rank : int
        The submitting rank.
    root_rank : int
        Root of a broadcast.
    device : int
        ``CPU_DEVICE_ID`` (-1) or a GPU ordinal.
    reduce_op : int
        Index into :data:`~distlab._wire.REDUCE_OPS` (0 = not a reduction).
    prescale_factor, postscale_factor : float
    """

    __slots__ = ("tensor_name", "request_type", "tensor_type", "tensor_shape", "request_rank", "root_rank",
                 "device", "reduce_op", "prescale_factor", "postscale_factor")

    def __init__(self, tensor_name="", request_type=RequestType.ALLREDUCE, tensor_type=0, tensor_shape=(),
                 request_rank=0, root_rank=0, device=CPU_DEVICE_ID, reduce_op=0, prescale_factor=1.0,
                 postscale_factor=1.0):
        self.tensor_name = str(tensor_name)
        self.request_type = int(request_type)
        self.tensor_type = int(tensor_type)
        self.tensor_shape = tuple(int(d) for d in tensor_shape)
        self.request_rank = int(request_rank)
        self.root_rank = int(root_rank)
        self.device = int(device)
        self.reduce_op = int(reduce_op)
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)

    def to_bytes(self) -> bytes:
        """This request alone, in the wire layout of one list element."""
        name = self.tensor_name.encode("utf-8")
        if len(name) > 0xFFFF:
            raise ValueError(f"tensor name too long ({len(name)} bytes, at most 65535)")
        if len(self.tensor_shape) > 255:
            raise ValueError(f"tensor has {len(self.tensor_shape)} dimensions, at most 255 are supported")
        head = REQUEST_HEAD.pack(self.request_rank, self.request_type, self.tensor_type, self.reduce_op,
                                 len(self.tensor_shape), self.root_rank, self.device, self.prescale_factor,
                                 self.postscale_factor, len(name))
        return head + name + b"".join(int(d).to_bytes(8, "little", signed=True) for d in self.tensor_shape)

    @classmethod
    def _parse(cls, data, offset: int):
        _need(data, offset + REQUEST_HEAD.size, "request_head")
        (rank, rtype, dtype, op, ndim, root, device, pre, post,
         name_len) = REQUEST_HEAD.unpack_from(data, offset)
        offset += REQUEST_HEAD.size
        end = offset + name_len + 8 * ndim
        _need(data, end, "request_body")
        name = _decode_name(data[offset:offset + name_len])
        offset += name_len
        shape = tuple(int.from_bytes(data[offset + 8 * i: offset + 8 * i + 8], "little", signed=True)
                      for i in range(ndim))
        return cls(name, rtype, dtype, shape, rank, root, device, op, pre, post), end

    def _key(self):
        return tuple(getattr(self, field) for field in REQUEST_FIELDS)

    def __eq__(self, other):
        return isinstance(other, Request) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return request_repr(self)


class Response:
    """The coordinator's decision: run these tensors now, or raise this error (mirrors message.h ``Response``).

    Parameters
    ----------
    response_type : int
        A :class:`~distlab._wire.ResponseType` code.
    tensor_names : list of str
        More than one name means a fused response.
    tensor_type : int
        The dtype code (allreduce).
    error_message : str
        Set on ERROR responses.
    devices : list of int
        The device of each rank that took part (by rank); its length says how many ranks took part.
    tensor_sizes : list of int
        Allreduce: element count per tensor. Allgather: first dimension per rank.
    prescale_factor, postscale_factor : float
    reduce_op : int
    last_joined_rank : int
        Set on JOIN responses: the last rank that joined.
    """

    __slots__ = ("response_type", "tensor_names", "tensor_type", "error_message", "devices", "tensor_sizes",
                 "prescale_factor", "postscale_factor", "reduce_op", "last_joined_rank")

    def __init__(self, response_type=ResponseType.ALLREDUCE, tensor_names=(), tensor_type=0, error_message="",
                 devices=(), tensor_sizes=(), prescale_factor=1.0, postscale_factor=1.0, reduce_op=0,
                 last_joined_rank=-1):
        self.response_type = int(response_type)
        self.tensor_names = [str(n) for n in tensor_names]
        self.tensor_type = int(tensor_type)
        self.error_message = str(error_message)
        self.devices = [int(d) for d in devices]
        self.tensor_sizes = [int(s) for s in tensor_sizes]
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)
        self.reduce_op = int(reduce_op)
        self.last_joined_rank = int(last_joined_rank)

    def copy(self) -> "Response":
        """A deep copy (lists are copied)."""
        return Response(self.response_type, self.tensor_names, self.tensor_type, self.error_message, self.devices,
                        self.tensor_sizes, self.prescale_factor, self.postscale_factor, self.reduce_op,
                        self.last_joined_rank)

    def to_bytes(self) -> bytes:
        """This response alone, in the wire layout of one list element."""
        parts = [RESPONSE_HEAD.pack(self.response_type, self.tensor_type, self.reduce_op, 0, self.last_joined_rank,
                                    self.prescale_factor, self.postscale_factor, len(self.tensor_names))]
        for name in self.tensor_names:
            raw = name.encode("utf-8")
            if len(raw) > 0xFFFF:
                raise ValueError(f"tensor name too long ({len(raw)} bytes, at most 65535)")
            parts.append(len(raw).to_bytes(2, "little") + raw)
        parts.append(len(self.devices).to_bytes(4, "little"))
        parts.extend(d.to_bytes(4, "little", signed=True) for d in self.devices)
        parts.append(len(self.tensor_sizes).to_bytes(4, "little"))
        parts.extend(s.to_bytes(8, "little", signed=True) for s in self.tensor_sizes)
        error = self.error_message.encode("utf-8")
        parts.append(len(error).to_bytes(4, "little") + error)
        return b"".join(parts)

    @classmethod
    def _parse(cls, data, offset: int):
        _need(data, offset + RESPONSE_HEAD.size, "response_head")
        rtype, dtype, op, _pad, last_joined, pre, post, n_names = RESPONSE_HEAD.unpack_from(data, offset)
        offset += RESPONSE_HEAD.size
        names = []
        for _ in range(n_names):
            length = _read_uint(data, offset, 2)
            offset += 2
            _need(data, offset + length)
            names.append(_decode_name(data[offset:offset + length]))
            offset += length
        n_devices = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + 4 * n_devices)
        devices = [int.from_bytes(data[offset + 4 * i: offset + 4 * i + 4], "little", signed=True)
                   for i in range(n_devices)]
        offset += 4 * n_devices
        n_sizes = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + 8 * n_sizes)
        sizes = [int.from_bytes(data[offset + 8 * i: offset + 8 * i + 8], "little", signed=True)
                 for i in range(n_sizes)]
        offset += 8 * n_sizes
        error_len = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + error_len)
        error = _decode_name(data[offset:offset + error_len])
        offset += error_len
        return cls(rtype, names, dtype, error, devices, sizes, pre, post, op, last_joined), offset

    def _key(self):
        return tuple(getattr(self, field) for field in RESPONSE_FIELDS)

    def __eq__(self, other):
        return isinstance(other, Response) and self._key() == other._key()

    __hash__ = None

    def __repr__(self):
        return response_repr(self)


class RequestList:
    """The requests one rank sends the coordinator in one cycle, plus its shutdown flag (message.h)."""

    __slots__ = ("requests", "shutdown")

    def __init__(self, requests=(), shutdown=False):
        self.requests = list(requests)
        self.shutdown = bool(shutdown)

    def to_bytes(self) -> bytes:
        """Serialise (see the layout in :mod:`distlab._wire`)."""
        return _pack_list(REQUEST_MAGIC, self.shutdown, self.requests)

    @classmethod
    def from_bytes(cls, data) -> "RequestList":
        """Parse bytes written by either twin; raises MessageFormatError on malformed input."""
        return cls(*_parse_list(bytes(data), REQUEST_MAGIC, "request list", Request._parse))

    def __eq__(self, other):
        return isinstance(other, RequestList) and (self.requests, self.shutdown) == (other.requests, other.shutdown)

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


class ResponseList:
    """The coordinator's responses for one cycle, identical on every rank, plus the shutdown flag (message.h)."""

    __slots__ = ("responses", "shutdown")

    def __init__(self, responses=(), shutdown=False):
        self.responses = list(responses)
        self.shutdown = bool(shutdown)

    def to_bytes(self) -> bytes:
        """Serialise (see the layout in :mod:`distlab._wire`)."""
        return _pack_list(RESPONSE_MAGIC, self.shutdown, self.responses)

    @classmethod
    def from_bytes(cls, data) -> "ResponseList":
        """Parse bytes written by either twin; raises MessageFormatError on malformed input."""
        return cls(*_parse_list(bytes(data), RESPONSE_MAGIC, "response list", Response._parse))

    def __eq__(self, other):
        return (isinstance(other, ResponseList)
                and (self.responses, self.shutdown) == (other.responses, other.shutdown))

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


# -- parsing helpers -----------------------------------------------------------------------------------------
def _pack_list(magic: bytes, shutdown: bool, items) -> bytes:
    """A request or response list: the header (magic, version, flags, count), then each item's bytes."""
    head = LIST_HEADER.pack(magic, NEGOTIATION_WIRE_VERSION, FLAG_SHUTDOWN if shutdown else 0, len(items))
    return head + b"".join(item.to_bytes() for item in items)


def _parse_list(data: bytes, magic: bytes, what: str, parse_item):
    """The items and the shutdown flag of a list written by :func:`_pack_list` (either twin's)."""
    count, flags = _parse_header(data, magic, what)
    offset = LIST_HEADER.size
    items = []
    for _ in range(count):
        item, offset = parse_item(data, offset)
        items.append(item)
    _no_trailing(data, offset, what)
    return items, bool(flags & FLAG_SHUTDOWN)


def _parse_header(data: bytes, magic: bytes, what: str):
    if len(data) < LIST_HEADER.size:
        raise format_error("short_header", what=what, got=len(data), need=LIST_HEADER.size)
    got_magic, version, flags, count = LIST_HEADER.unpack_from(data, 0)
    if got_magic != magic:
        raise format_error("magic", what=what, got=got_magic, expected=magic)
    if version != NEGOTIATION_WIRE_VERSION:
        raise format_error("version", what=what, got=version, expected=NEGOTIATION_WIRE_VERSION)
    return count, flags


def _need(data: bytes, end: int, where: str = "response_body") -> None:
    """Refuse to read past the end of ``data`` (``where`` names the part being read, for the message)."""
    if end > len(data):
        raise format_error(where)


def _read_uint(data: bytes, offset: int, width: int) -> int:
    _need(data, offset + width)
    return int.from_bytes(data[offset:offset + width], "little")


def _decode_name(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise format_error("utf8", reason=exc) from None


def _no_trailing(data: bytes, offset: int, what: str) -> None:
    if offset != len(data):
        raise format_error("trailing", what=what, count=len(data) - offset)
