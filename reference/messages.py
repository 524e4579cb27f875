"""Negotiation messages: ``Request``, ``Response`` and their lists, with a compact binary wire format.

Twinned with ``core/_messages.pxi`` (included by ``core/_negotiation.pyx``).

Mirrors horovod/common/message.h and message.cc. A rank describes each collective it wants to run as a
``Request`` (name, type, dtype, shape, root, device, reduce op, scale factors, group); the coordinator answers
with ``Response`` objects that say which tensors to run now, possibly several fused into one. Horovod serialises
these with FlatBuffers; we use a small fixed layout described in :mod:`distlab._wire`, written with
:mod:`struct`. The core twin writes the same bytes with C code; tests compare them byte for byte.

A message comes from another process, so the parser trusts nothing: every length is checked against the bytes
that are left before anything is read or allocated, and every decoded field is checked against its range (an
unknown type or dtype, a negative dimension, a NaN scale factor, an unknown flag bit), so that a corrupted or
hostile message raises :class:`~distlab.errors.MessageFormatError` here instead of breaking the coordinator later.
"""
from __future__ import annotations

from distlab._common.negotiation import (
    MAX_TENSOR_BYTES,
    REQUEST_FIELDS,
    RESPONSE_FIELDS,
    device_error,
    dimension_error,
    format_error,
    list_field_error,
    list_repr,
    request_field_error,
    request_repr,
    response_field_error,
    response_repr,
    shape_size_error,
    size_error,
)
from distlab._wire import (
    CPU_DEVICE_ID,
    DTYPE_SIZES,
    FLAG_SHUTDOWN,
    GLOBAL_PROCESS_SET_ID,
    LIST_HEADER,
    NEGOTIATION_WIRE_VERSION,
    NO_GROUP,
    REQUEST_HEAD,
    REQUEST_MAGIC,
    RESPONSE_HEAD,
    RESPONSE_MAGIC,
    VERSION_OFFSET,
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
        The submitting rank (its rank in the process set).
    root_rank : int
        Root of a broadcast.
    device : int
        ``CPU_DEVICE_ID`` (-1) or a GPU ordinal.
    reduce_op : int
        Index into :data:`~distlab._wire.REDUCE_OPS` (0 = not a reduction).
    prescale_factor, postscale_factor : float
    group_id : int
        The group of a grouped collective (``NO_GROUP`` = -1 outside a group); the same on every rank.
    group_size : int
        How many tensors this rank put in the group (0 outside a group).
    """

    __slots__ = REQUEST_FIELDS

    def __init__(self, tensor_name="", request_type=RequestType.ALLREDUCE, tensor_type=0, tensor_shape=(),
                 request_rank=0, root_rank=0, device=CPU_DEVICE_ID, reduce_op=0, prescale_factor=1.0,
                 postscale_factor=1.0, group_id=NO_GROUP, group_size=0):
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
        self.group_id = int(group_id)
        self.group_size = int(group_size)

    def to_bytes(self) -> bytes:
        """This request alone, in the wire layout of one list element."""
        name = self.tensor_name.encode("utf-8")
        if len(name) > 0xFFFF:
            raise ValueError(f"tensor name too long ({len(name)} bytes, at most 65535)")
        if len(self.tensor_shape) > 255:
            raise ValueError(f"tensor has {len(self.tensor_shape)} dimensions, at most 255 are supported")
        head = REQUEST_HEAD.pack(self.request_rank, self.request_type, self.tensor_type, self.reduce_op,
                                 len(self.tensor_shape), self.root_rank, self.device, self.group_id,
                                 self.group_size, self.prescale_factor, self.postscale_factor, len(name))
        return head + name + b"".join(int(d).to_bytes(8, "little", signed=True) for d in self.tensor_shape)

    @classmethod
    def _parse(cls, data, offset: int):
        _need(data, offset + REQUEST_HEAD.size, "request_head")
        (rank, rtype, dtype, op, ndim, root, device, group_id, group_size, pre, post,
         name_len) = REQUEST_HEAD.unpack_from(data, offset)
        error = request_field_error(rank, rtype, dtype, op, root, device, group_id, group_size, pre, post)
        if error is not None:
            raise error
        offset += REQUEST_HEAD.size
        end = offset + name_len + 8 * ndim
        _need(data, end, "request_body")
        name = _decode_name(data[offset:offset + name_len])
        offset += name_len
        shape = tuple(int.from_bytes(data[offset + 8 * i: offset + 8 * i + 8], "little", signed=True)
                      for i in range(ndim))
        for index, dim in enumerate(shape):
            if dim < 0:
                raise dimension_error(index, dim)
        count = 1
        for dim in shape:
            count *= dim
        if count * DTYPE_SIZES[dtype] > MAX_TENSOR_BYTES:   # what the core's int64 counts would wrap
            raise shape_size_error(name, shape, dtype)
        return cls(name, rtype, dtype, shape, rank, root, device, op, pre, post, group_id, group_size), end

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
    group_id : int
        The group the tensors belong to (``NO_GROUP`` = -1 when none): a group is always one response.
    """

    __slots__ = RESPONSE_FIELDS

    def __init__(self, response_type=ResponseType.ALLREDUCE, tensor_names=(), tensor_type=0, error_message="",
                 devices=(), tensor_sizes=(), prescale_factor=1.0, postscale_factor=1.0, reduce_op=0,
                 last_joined_rank=-1, group_id=NO_GROUP):
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
        self.group_id = int(group_id)

    def copy(self) -> "Response":
        """A deep copy (lists are copied)."""
        return Response(self.response_type, self.tensor_names, self.tensor_type, self.error_message, self.devices,
                        self.tensor_sizes, self.prescale_factor, self.postscale_factor, self.reduce_op,
                        self.last_joined_rank, self.group_id)

    def to_bytes(self) -> bytes:
        """This response alone, in the wire layout of one list element."""
        parts = [RESPONSE_HEAD.pack(self.response_type, self.tensor_type, self.reduce_op, 0, self.last_joined_rank,
                                    self.group_id, self.prescale_factor, self.postscale_factor,
                                    len(self.tensor_names))]
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
        (rtype, dtype, op, pad, last_joined, group_id, pre, post,
         n_names) = RESPONSE_HEAD.unpack_from(data, offset)
        error = response_field_error(rtype, dtype, op, pad, last_joined, group_id, pre, post)
        if error is not None:
            raise error
        offset += RESPONSE_HEAD.size
        names = []
        for _ in range(n_names):        # each name needs 2 bytes at least: a bogus count runs out of bytes
            length = _read_uint(data, offset, 2)
            offset += 2
            _need(data, offset + length)
            names.append(_decode_name(data[offset:offset + length]))
            offset += length
        n_devices = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + 4 * n_devices)     # before the list is built
        devices = [int.from_bytes(data[offset + 4 * i: offset + 4 * i + 4], "little", signed=True)
                   for i in range(n_devices)]
        for index, device in enumerate(devices):
            if device < CPU_DEVICE_ID:
                raise device_error(index, device)
        offset += 4 * n_devices
        n_sizes = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + 8 * n_sizes)
        sizes = [int.from_bytes(data[offset + 8 * i: offset + 8 * i + 8], "little", signed=True)
                 for i in range(n_sizes)]
        for index, size in enumerate(sizes):
            if size < 0 or size * DTYPE_SIZES[dtype] > MAX_TENSOR_BYTES:
                raise size_error(index, size, dtype)
        offset += 8 * n_sizes
        error_len = _read_uint(data, offset, 4)
        offset += 4
        _need(data, offset + error_len)
        error = _decode_name(data[offset:offset + error_len])
        offset += error_len
        return cls(rtype, names, dtype, error, devices, sizes, pre, post, op, last_joined, group_id), offset

    def _key(self):
        return tuple(getattr(self, field) for field in RESPONSE_FIELDS)

    def __eq__(self, other):
        return isinstance(other, Response) and self._key() == other._key()

    __hash__ = None

    def __repr__(self):
        return response_repr(self)


class RequestList:
    """The requests one rank sends the coordinator in one cycle, plus its shutdown flag (message.h).

    Parameters
    ----------
    requests : sequence of Request
    shutdown : bool
        This rank asks every rank to stop.
    shutdown_reason : str
        Why (a predicate of the rank: ``"called shutdown()"``), so that the others can say it.
    process_set_id : int
        The process set whose coordinator the list is for (0: every rank).
    """

    __slots__ = ("requests", "shutdown", "shutdown_reason", "process_set_id")

    def __init__(self, requests=(), shutdown=False, shutdown_reason="", process_set_id=GLOBAL_PROCESS_SET_ID):
        self.requests = list(requests)
        self.shutdown = bool(shutdown)
        self.shutdown_reason = str(shutdown_reason)
        self.process_set_id = int(process_set_id)

    def to_bytes(self) -> bytes:
        """Serialise (see the layout in :mod:`distlab._wire`)."""
        return _pack_list(REQUEST_MAGIC, self, self.requests)

    @classmethod
    def from_bytes(cls, data) -> "RequestList":
        """Parse bytes written by either twin; raises MessageFormatError on malformed input."""
        return cls(*_parse_list(bytes(data), REQUEST_MAGIC, "request list", Request._parse))

    def __eq__(self, other):
        return isinstance(other, RequestList) and _list_key(self) == _list_key(other)

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


class ResponseList:
    """The coordinator's responses for one cycle, identical on every rank, plus the shutdown flag (message.h).

    Parameters
    ----------
    responses : sequence of Response
    shutdown : bool
        Every rank stops after this cycle.
    shutdown_reason : str
        Why, naming the ranks that asked (``"rank 1 called shutdown()"``).
    process_set_id : int
        The process set the responses are for.
    """

    __slots__ = ("responses", "shutdown", "shutdown_reason", "process_set_id")

    def __init__(self, responses=(), shutdown=False, shutdown_reason="", process_set_id=GLOBAL_PROCESS_SET_ID):
        self.responses = list(responses)
        self.shutdown = bool(shutdown)
        self.shutdown_reason = str(shutdown_reason)
        self.process_set_id = int(process_set_id)

    def to_bytes(self) -> bytes:
        """Serialise (see the layout in :mod:`distlab._wire`)."""
        return _pack_list(RESPONSE_MAGIC, self, self.responses)

    @classmethod
    def from_bytes(cls, data) -> "ResponseList":
        """Parse bytes written by either twin; raises MessageFormatError on malformed input."""
        return cls(*_parse_list(bytes(data), RESPONSE_MAGIC, "response list", Response._parse))

    def __eq__(self, other):
        return isinstance(other, ResponseList) and _list_key(self) == _list_key(other)

    __hash__ = None

    def __repr__(self):
        return list_repr(self)


# -- packing and parsing helpers -----------------------------------------------------------------------------
def _pack_list(magic: bytes, message_list, items) -> bytes:
    """A request or response list: the header (magic, version, flags, process set, count, reason), the items."""
    reason = message_list.shutdown_reason.encode("utf-8")[:0xFFFF]
    head = LIST_HEADER.pack(magic, NEGOTIATION_WIRE_VERSION, FLAG_SHUTDOWN if message_list.shutdown else 0,
                            message_list.process_set_id, len(items), len(reason))
    return head + reason + b"".join(item.to_bytes() for item in items)


def _parse_list(data: bytes, magic: bytes, what: str, parse_item):
    """The items, shutdown flag, reason and process set of a list written by :func:`_pack_list` (either twin's)."""
    count, flags, process_set_id, reason_len = _parse_header(data, magic, what)
    offset = LIST_HEADER.size
    if offset + reason_len > len(data):
        raise format_error("reason", what=what)
    reason = _decode_name(data[offset:offset + reason_len])
    offset += reason_len
    items = []
    for _ in range(count):          # each item needs its head at least: a bogus count runs out of bytes
        item, offset = parse_item(data, offset)
        items.append(item)
    _no_trailing(data, offset, what)
    return items, bool(flags & FLAG_SHUTDOWN), reason, process_set_id


def _parse_header(data: bytes, magic: bytes, what: str):
    # The version comes first (it sits at the same offset in every version), so that a rank running another
    # distlab gets "wire version 1, this distlab speaks version 2", not a misleading truncation.
    if (len(data) > VERSION_OFFSET and data[:VERSION_OFFSET] == magic
            and data[VERSION_OFFSET] != NEGOTIATION_WIRE_VERSION):
        raise format_error("version", what=what, got=data[VERSION_OFFSET], expected=NEGOTIATION_WIRE_VERSION)
    if len(data) < LIST_HEADER.size:
        raise format_error("short_header", what=what, got=len(data), need=LIST_HEADER.size)
    got_magic, _version, flags, process_set_id, count, reason_len = LIST_HEADER.unpack_from(data, 0)
    if got_magic != magic:
        raise format_error("magic", what=what, got=got_magic, expected=magic)
    error = list_field_error(what, flags, process_set_id)
    if error is not None:
        raise error
    return count, flags, process_set_id, reason_len


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


def _list_key(message_list):
    items = message_list.requests if isinstance(message_list, RequestList) else message_list.responses
    return items, message_list.shutdown, message_list.shutdown_reason, message_list.process_set_id
