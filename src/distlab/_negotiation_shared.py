"""What both twins of the negotiation engine (Horovod's controller and response cache) share.

Codes that cross process boundaries (request and response types, dtype codes, reduce-op codes), the binary wire
format's layout, the cache's states and status bits, and the exception and warning types. They are defined once,
here, so that a reference rank and a core rank speak the same bytes and raise the same classes.

Wire format (version :data:`WIRE_VERSION`, every integer little-endian, no padding)::

    RequestList  := "DLRQ" version:u8 flags:u8 count:u32  Request*count
    Request      := rank:i32 type:u8 dtype:u8 reduce_op:u8 ndim:u8 root:i32 device:i32
                    prescale:f64 postscale:f64 name_len:u16  name:utf8  dims:i64*ndim
    ResponseList := "DLRS" version:u8 flags:u8 count:u32  Response*count
    Response     := type:u8 dtype:u8 reduce_op:u8 pad:u8 last_joined_rank:i32 prescale:f64 postscale:f64
                    n_names:u32 (name_len:u16 name:utf8)*n_names
                    n_devices:u32 device:i32*n_devices  n_sizes:u32 size:i64*n_sizes
                    error_len:u32 error:utf8

``flags`` bit 0 is the shutdown flag. A message that is truncated, has trailing bytes, a wrong magic or a
version other than :data:`WIRE_VERSION` raises :class:`MessageFormatError`.
"""
from __future__ import annotations

import struct

import numpy as np

from .errors import DistlabError

__all__ = [
    "WIRE_VERSION", "REQUEST_MAGIC", "RESPONSE_MAGIC", "FLAG_SHUTDOWN",
    "LIST_HEADER", "REQUEST_HEAD", "RESPONSE_HEAD",
    "RequestType", "ResponseType", "REQUEST_TYPE_NAMES", "RESPONSE_TYPE_NAMES", "CACHEABLE_RESPONSE_TYPES",
    "REDUCE_OPS", "REDUCE_OP_NAMES", "DTYPE_CODES", "DTYPE_NAMES", "DTYPE_SIZES", "dtype_code", "dtype_name",
    "CPU_DEVICE_ID", "MISS", "HIT", "INVALID", "CACHE_STATE_NAMES",
    "SHOULD_SHUT_DOWN", "UNCACHED_IN_QUEUE", "INVALID_IN_QUEUE", "NUM_STATUS_BITS", "JOIN_TENSOR_NAME",
    "MessageFormatError", "CacheStateError", "CollectiveError", "DuplicateNameError", "NotInitializedError",
    "StallShutdownError", "CacheEvictionWarning", "StallWarning", "eviction_warning_text", "joined_phrase",
]

#: Version of the binary format; a message of any other version is refused.
WIRE_VERSION = 1
REQUEST_MAGIC = b"DLRQ"
RESPONSE_MAGIC = b"DLRS"
FLAG_SHUTDOWN = 1

#: struct layouts (``<`` = little-endian, no padding).
LIST_HEADER = struct.Struct("<4sBBI")
REQUEST_HEAD = struct.Struct("<iBBBBiiddH")
RESPONSE_HEAD = struct.Struct("<BBBBiddI")


class RequestType:
    """Request type codes (mirror message.h ``Request::RequestType``)."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7


class ResponseType:
    """Response type codes (mirror message.h ``Response::ResponseType``); ERROR carries a message."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    ERROR = 8


REQUEST_TYPE_NAMES = ("allreduce", "allgather", "broadcast", "join", "adasum", "alltoall", "barrier",
                      "reducescatter")
RESPONSE_TYPE_NAMES = REQUEST_TYPE_NAMES + ("error",)
#: Only these responses are cached (and only when every rank took part): mirrors controller.cc.
CACHEABLE_RESPONSE_TYPES = frozenset({ResponseType.ALLREDUCE, ResponseType.ALLGATHER, ResponseType.ADASUM,
                                      ResponseType.ALLTOALL})

#: Reduce ops and their codes (index). "" = not a reduction.
REDUCE_OPS = ("", "sum", "avg", "min", "max", "product")
REDUCE_OP_NAMES = {i: name for i, name in enumerate(REDUCE_OPS)}

#: numpy dtype names and their wire codes (append only).
DTYPE_NAMES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool",
               "uint32", "uint64", "complex64", "complex128")
DTYPE_CODES = {name: i for i, name in enumerate(DTYPE_NAMES)}
DTYPE_SIZES = tuple(np.dtype(name).itemsize for name in DTYPE_NAMES)


def dtype_code(dtype) -> int:
    """The wire code of a numpy dtype; unsupported dtypes raise TypeError naming the supported ones."""
    name = np.dtype(dtype).name
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"dtype {name} is not supported by distlab.collectives; use one of "
                        f"{', '.join(DTYPE_NAMES)}") from None


def dtype_name(code: int) -> str:
    """The numpy name of a wire dtype code (``"?<code>"`` when unknown)."""
    return DTYPE_NAMES[code] if 0 <= code < len(DTYPE_NAMES) else f"?{code}"


CPU_DEVICE_ID = -1

#: ResponseCache.cached() results (mirror response_cache.h ``CacheState``).
MISS, HIT, INVALID = 0, 1, 2
CACHE_STATE_NAMES = ("MISS", "HIT", "INVALID")

#: Status bits at the start of the coordinator's bit vector, stored inverted (1 = "no").
SHOULD_SHUT_DOWN, UNCACHED_IN_QUEUE, INVALID_IN_QUEUE = 0, 1, 2
NUM_STATUS_BITS = 3

JOIN_TENSOR_NAME = "join.noname"


class MessageFormatError(DistlabError, ValueError):
    """A negotiation message could not be decoded: truncated, trailing bytes, wrong magic or version."""


class CacheStateError(DistlabError):
    """The response cache was used against its rules (e.g. overwriting an INVALID entry, an unknown bit)."""


class CollectiveError(DistlabError):
    """A negotiated collective failed on every rank (e.g. ranks submitted a tensor with different shapes).

    ``names`` lists the tensors the error response covered.
    """

    def __init__(self, message, *, names=()):
        super().__init__(message)
        self.names = list(names)


class DuplicateNameError(DistlabError, ValueError):
    """A tensor name was submitted while a collective of the same name is still in flight on this rank."""


class NotInitializedError(DistlabError):
    """distlab.collectives was used before ``init()`` or after ``shutdown()``."""


class StallShutdownError(DistlabError):
    """The stall inspector shut the collectives down (``DISTLAB_STALL_SHUTDOWN_TIME`` was exceeded)."""


class CacheEvictionWarning(RuntimeWarning):
    """The response cache evicted an entry because it was full (shown once per cache)."""


class StallWarning(RuntimeWarning):
    """Some ranks submitted a tensor and others have not, for longer than ``DISTLAB_STALL_CHECK_TIME``."""


def eviction_warning_text(capacity: int, evicted: str, added: str) -> str:
    """The eviction warning: what happened, what it costs, and what to set."""
    return (
        f"distlab response cache is full (capacity {capacity}): it evicted the least recently used tensor "
        f"{evicted!r} to make room for {added!r}. An evicted tensor is negotiated again through the coordinator "
        f"(the slow path: a gather of request lists and a broadcast of responses) the next time it is submitted, "
        f"instead of one bit-vector allreduce. If your program submits more than {capacity} distinct tensor names "
        f"per step, set DISTLAB_CACHE_CAPACITY to at least that number; set DISTLAB_CACHE_CAPACITY=0 to disable "
        f"the cache. (Shown once.)"
    )


def joined_phrase(ranks) -> str:
    """``"rank 2 has joined"`` / ``"ranks 1, 2 have joined"`` (for the join refusals of both twins)."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]} has joined"
    return f"ranks {', '.join(map(str, ranks))} have joined"
