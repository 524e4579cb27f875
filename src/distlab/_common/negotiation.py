"""What both twins of the negotiation engine (Horovod's controller and response cache) share, other than wire codes.

The codes and layouts that cross ranks live in :mod:`distlab._wire`, the exception and warning types in
:mod:`distlab.errors`. Here lives what runs at construction, on the coordinator's rare decisions, or to format an
error: the cache states, the dtype helpers, the fields messages are compared and printed by, and the text of every
message both twins produce, written once so that a reference rank and a core rank say exactly the same thing.
"""
from __future__ import annotations

import numpy as np

from distlab._wire import (
    CPU_DEVICE_ID,
    DTYPE_CODES,
    DTYPE_NAMES,
    REDUCE_OPS,
    REQUEST_TYPE_NAMES,
    RESPONSE_TYPE_NAMES,
    RequestType,
    ResponseType,
)
from distlab.errors import CacheStateError, MessageFormatError

__all__ = [
    "MISS", "HIT", "INVALID", "CACHE_STATE_NAMES", "CACHEABLE_RESPONSE_TYPES", "COUNTERS",
    "REQUEST_FIELDS", "RESPONSE_FIELDS", "dtype_code", "dtype_name", "request_repr", "response_repr",
    "list_repr", "format_error", "cache_error", "check_capacity", "eviction_warning_text", "joined_phrase",
    "response_error",
    "trace_negotiation_start",
]

#: ResponseCache.cached() results (mirror response_cache.h ``CacheState``).
MISS, HIT, INVALID = 0, 1, 2
CACHE_STATE_NAMES = ("MISS", "HIT", "INVALID")

#: Only these responses are cached (and only when every rank took part): mirrors controller.cc.
CACHEABLE_RESPONSE_TYPES = frozenset({ResponseType.ALLREDUCE, ResponseType.ALLGATHER, ResponseType.ADASUM,
                                      ResponseType.ALLTOALL})

#: The controller's counters, in the order ``Controller.counters`` lists them.
COUNTERS = ("cycles", "fast_path", "slow_path", "idle", "hits", "misses", "invalid", "requeued", "responses",
            "fused_tensors")

#: The fields of a Request and of a Response, in constructor order (what equality compares).
REQUEST_FIELDS = ("tensor_name", "request_type", "tensor_type", "tensor_shape", "request_rank", "root_rank",
                  "device", "reduce_op", "prescale_factor", "postscale_factor")
RESPONSE_FIELDS = ("response_type", "tensor_names", "tensor_type", "error_message", "devices", "tensor_sizes",
                   "prescale_factor", "postscale_factor", "reduce_op", "last_joined_rank")


# -- dtypes ----------------------------------------------------------------------------------------------------
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


# -- printing messages -----------------------------------------------------------------------------------------
def _type_name(names, code: int) -> str:
    return names[code] if 0 <= code < len(names) else "?"


def request_repr(request) -> str:
    """``Request('grad.w', allreduce, rank=1, dtype=7, shape=(2, 3))``."""
    return (f"Request({request.tensor_name!r}, {_type_name(REQUEST_TYPE_NAMES, request.request_type)}, "
            f"rank={request.request_rank}, dtype={request.tensor_type}, shape={tuple(request.tensor_shape)})")


def list_repr(message_list) -> str:
    """``RequestList([...], shutdown=False)`` / ``ResponseList([...], shutdown=False)``."""
    items = message_list.requests if hasattr(message_list, "requests") else message_list.responses
    return f"{type(message_list).__name__}({items!r}, shutdown={bool(message_list.shutdown)})"


def response_repr(response) -> str:
    """``Response(allreduce, ['a', 'b'], sizes=[6, 2])``."""
    return (f"Response({_type_name(RESPONSE_TYPE_NAMES, response.response_type)}, {response.tensor_names!r}, "
            f"sizes={response.tensor_sizes})")


# -- errors ----------------------------------------------------------------------------------------------------
_FORMAT_ERRORS = {
    "short_header": "{what} is truncated: {got} bytes, the header alone needs {need}",
    "magic": "not a distlab {what}: magic {got!r}, expected {expected!r}",
    "version": ("{what} has wire version {got}, this distlab speaks version {expected}: every rank must run the "
                "same distlab version"),
    "request_head": "request list is truncated inside a request header",
    "request_body": "request list is truncated inside a request's name or shape",
    "response_head": "response list is truncated inside a response header",
    "response_body": "response list is truncated inside a response",
    "utf8": "a name in the message is not valid UTF-8: {reason}",
    "trailing": "{what} has {count} unexpected trailing bytes",
}


def format_error(kind: str, **fields) -> MessageFormatError:
    """The MessageFormatError both parsers raise for ``kind`` (a key of the table above) with ``fields``."""
    return MessageFormatError(_FORMAT_ERRORS[kind].format(**fields))


_CACHE_ERRORS = {
    "capacity": "cache capacity must be >= 0, got {capacity}",
    "not_cached": "tensor {name!r} is not in the response cache",
    "no_entry": "cache bit {bit} holds no entry (active bits: {active})",
    "uncacheable": ("responses of type {response_type} are not cacheable; only allreduce, allgather, adasum and "
                    "alltoall are"),
    "no_request": "cannot cache {name!r}: this rank has no request for it",
    "overwrite_invalid": ("refusing to overwrite the cached response of {name!r}: the entry is INVALID (same name, "
                          "different parameters) and must be erased first (erase_response)"),
    "synced": "this CacheCoordinator has already synced; make a new one each cycle",
    "bit_range": "cache bit {bit} is out of range (active bits: {active})",
}


def cache_error(kind: str, **fields) -> CacheStateError:
    """The CacheStateError both caches raise for ``kind`` with ``fields``."""
    return CacheStateError(_CACHE_ERRORS[kind].format(**fields))


def check_capacity(capacity) -> int:
    """A cache capacity as an int; a negative one raises ValueError."""
    capacity = int(capacity)
    if capacity < 0:
        raise ValueError(_CACHE_ERRORS["capacity"].format(capacity=capacity))
    return capacity


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


# -- the coordinator's validation (mirrors controller.cc ConstructResponse's checks) ----------------------------
def response_error(name: str, requests, joined_ranks) -> str | None:
    """Why the requests of every rank for ``name`` cannot run together, or None when they can.

    ``requests`` are sorted by rank. The checks, in Horovod's order: the operation and the dtype; the shape
    (allreduce, adasum, broadcast); the reduce op and the scale factors (allreduce, adasum); for allgather and
    alltoall, no joined rank, at least one dimension and the same shape beyond the first dimension; for
    broadcast, no joined rank and the same root; finally the device. The message names each rank and what it
    sent.
    """
    first = requests[0]
    kind = first.request_type
    kind_name = REQUEST_TYPE_NAMES[kind]
    error = _first_mismatch(name, requests, [
        ("operations", lambda r: REQUEST_TYPE_NAMES[r.request_type]),
        ("data types", lambda r: dtype_name(r.tensor_type)),
    ])
    if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.BROADCAST):
        error = _first_mismatch(name, requests, [("shapes", lambda r: _shape(r.tensor_shape))])
    if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM):
        error = _first_mismatch(name, requests, [
            ("reduce ops", lambda r: REDUCE_OPS[r.reduce_op] or "none"),
            ("prescale/postscale factors", lambda r: f"({r.prescale_factor:g}, {r.postscale_factor:g})"),
        ])
    if error is None and kind in (RequestType.ALLGATHER, RequestType.ALLTOALL):
        if joined_ranks:
            error = (f"{kind_name} of {name!r} is not supported once a rank has joined "
                     f"({joined_phrase(joined_ranks)}); only allreduce works with join")
        elif len(first.tensor_shape) == 0:
            error = f"rank {first.request_rank} tried to {kind_name} {name!r}, a 0-dimensional array"
        else:
            error = _first_mismatch(name, requests, [
                ("shapes beyond the first dimension",
                 lambda r: f"[*, {', '.join(map(str, tuple(r.tensor_shape)[1:]))}]")])
    if error is None and kind == RequestType.BROADCAST:
        if joined_ranks:
            error = (f"broadcast of {name!r} is not supported once a rank has joined "
                     f"({joined_phrase(joined_ranks)})")
        else:
            error = _first_mismatch(name, requests, [("root ranks", lambda r: f"root {r.root_rank}")])
    if error is None:
        error = _first_mismatch(name, requests, [
            ("devices", lambda r: "CPU" if r.device == CPU_DEVICE_ID else f"GPU {r.device}")])
    return error


def _shape(shape) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _first_mismatch(name, requests, checks):
    """The first check (label, describe) on which the ranks disagree, as a message naming who sent what."""
    for label, describe in checks:
        groups: dict[str, list[int]] = {}
        for r in requests:
            groups.setdefault(describe(r), []).append(r.request_rank)
        if len(groups) > 1:
            parts = []
            for value, ranks in groups.items():
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                parts.append(f"{who} sent {value}")
            kind = REQUEST_TYPE_NAMES[requests[0].request_type]
            return f"Mismatched {label} for tensor {name!r} ({kind}): " + "; ".join(parts) + "."
    return None


def trace_negotiation_start(timeline, name: str, request_type: int) -> None:
    """The coordinator saw the first request for ``name``: an instant on the timeline's negotiation lane."""
    if timeline is not None:
        timeline.instant(f"negotiate {name}", lane="negotiation", args={"type": REQUEST_TYPE_NAMES[request_type]})
