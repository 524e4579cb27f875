"""What both twins of the negotiation engine (Horovod's controller and response cache) share, other than wire codes.

The codes and layouts that cross ranks live in :mod:`distlab._wire`, the exception and warning types in
:mod:`distlab.errors`. Here lives what runs at construction, on the coordinator's rare decisions, or to format an
error: the cache states, the dtype helpers, the fields messages are compared and printed by, and the text of every
message both twins produce, written once so that a reference rank and a core rank say exactly the same thing.
"""
from __future__ import annotations

import logging
import math
import zlib

import numpy as np

from distlab._wire import (
    CPU_DEVICE_ID,
    DTYPE_CODES,
    DTYPE_NAMES,
    DTYPE_SIZES,
    LIST_FLAGS,
    NEGOTIATED_REDUCE_OP_MAX,
    NO_GROUP,
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
    "list_repr", "format_error", "list_field_error", "request_field_error", "response_field_error",
    "process_set_error", "sender_error", "dimension_error", "MAX_TENSOR_BYTES", "shape_size_error", "device_error", "size_error", "cache_error", "check_capacity", "eviction_warning_text",
    "joined_phrase", "ranks_phrase", "response_error", "group_id_of", "group_name_of", "group_size_error",
    "group_mismatch_error", "group_member_error", "refused_list_reason", "coordinator_failed_reason", "shutdown_reason_text",
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
                  "device", "reduce_op", "prescale_factor", "postscale_factor", "group_id", "group_size")
RESPONSE_FIELDS = ("response_type", "tensor_names", "tensor_type", "error_message", "devices", "tensor_sizes",
                   "prescale_factor", "postscale_factor", "reduce_op", "last_joined_rank", "group_id")


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
    """``RequestList([...], shutdown=False, process_set_id=0)`` (and the same for a ResponseList)."""
    items = message_list.requests if hasattr(message_list, "requests") else message_list.responses
    text = f"{type(message_list).__name__}({items!r}, shutdown={bool(message_list.shutdown)}"
    if message_list.shutdown_reason:
        text += f", shutdown_reason={message_list.shutdown_reason!r}"
    return text + f", process_set_id={message_list.process_set_id})"


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
    "reason": "{what} is truncated inside its shutdown reason",
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


# Range checks of the decoded fields, in the order both parsers apply them: (field, test, what is allowed).
# A message that passes them cannot make the coordinator index past a table or allocate from a bogus count.
def _in(low, high):
    return (lambda v: low <= v <= high), f"{low} to {high}"


_AT_LEAST_0 = (lambda v: v >= 0), ">= 0"
_DEVICE = (lambda v: v >= CPU_DEVICE_ID), f">= {CPU_DEVICE_ID}"
_FINITE = (lambda v: math.isfinite(v)), "a finite number"
_GROUP = (lambda v: v >= NO_GROUP), f">= {NO_GROUP}"
_LIST_CHECKS = (("process_set_id", _AT_LEAST_0),)
_REQUEST_CHECKS = (
    ("request_rank", _AT_LEAST_0),
    ("request_type", _in(0, len(REQUEST_TYPE_NAMES) - 1)),
    ("tensor_type", _in(0, len(DTYPE_NAMES) - 1)),
    ("reduce_op", _in(0, NEGOTIATED_REDUCE_OP_MAX)),
    ("root_rank", _AT_LEAST_0),
    ("device", _DEVICE),
    ("group_id", _GROUP),
    ("group_size", _AT_LEAST_0),
    ("prescale_factor", _FINITE),
    ("postscale_factor", _FINITE),
)
_RESPONSE_CHECKS = (
    ("response_type", _in(0, len(RESPONSE_TYPE_NAMES) - 1)),
    ("tensor_type", _in(0, len(DTYPE_NAMES) - 1)),
    ("reduce_op", _in(0, NEGOTIATED_REDUCE_OP_MAX)),
    ("pad", _in(0, 0)),
    ("last_joined_rank", (lambda v: v >= -1, ">= -1")),
    ("group_id", _GROUP),
    ("prescale_factor", _FINITE),
    ("postscale_factor", _FINITE),
)


def _first_bad(what: str, checks, values) -> MessageFormatError | None:
    for (field, (ok, allowed)), value in zip(checks, values):
        if not ok(value):
            return MessageFormatError(f"{what}: {field} {value!r} is out of range ({allowed})")
    return None


def list_field_error(what: str, flags: int, process_set_id: int) -> MessageFormatError | None:
    """The first bad field of a list header (unknown flag bits, a negative process set), or None."""
    if flags & ~LIST_FLAGS:
        return MessageFormatError(f"{what}: flags {flags:#x} has unknown bits set (only {LIST_FLAGS:#x} is defined)")
    return _first_bad(what, _LIST_CHECKS, (process_set_id,))


def request_field_error(rank, request_type, tensor_type, reduce_op, root_rank, device, group_id, group_size,
                        prescale_factor, postscale_factor) -> MessageFormatError | None:
    """The first out-of-range field of a request's head (in the order of ``_REQUEST_CHECKS``), or None.

    Also refused: a group size without a group, or a group without members.
    """
    error = _first_bad("request list", _REQUEST_CHECKS, (rank, request_type, tensor_type, reduce_op, root_rank,
                                                          device, group_id, group_size, prescale_factor,
                                                          postscale_factor))
    if error is None and (group_id == NO_GROUP) != (group_size == 0):
        error = MessageFormatError(f"request list: group_id {group_id} with group_size {group_size} (a request "
                                   f"outside a group has group_id {NO_GROUP} and group_size 0)")
    return error


def response_field_error(response_type, tensor_type, reduce_op, pad, last_joined_rank, group_id, prescale_factor,
                         postscale_factor) -> MessageFormatError | None:
    """The first out-of-range field of a response's head (in the order of ``_RESPONSE_CHECKS``), or None."""
    return _first_bad("response list", _RESPONSE_CHECKS, (response_type, tensor_type, reduce_op, pad,
                                                           last_joined_rank, group_id, prescale_factor,
                                                           postscale_factor))


def process_set_error(what: str, got: int, expected: int) -> MessageFormatError:
    """A list for another process set reached this set's controller."""
    return MessageFormatError(f"{what} is for process set {got}, but this controller negotiates for process set "
                              f"{expected}")


def sender_error(sender: int, name: str, claimed: int) -> MessageFormatError:
    """A request list speaks for another rank than the one that sent it."""
    return MessageFormatError(f"the request for {name!r} claims to come from rank {claimed}, but rank {sender} "
                              "sent it: a rank may only submit its own requests")


def dimension_error(index: int, value: int) -> MessageFormatError:
    """A request's dimension ``index`` is negative."""
    return MessageFormatError(f"request list: dimension {index} is {value}, out of range (>= 0)")


#: The most bytes a request's shape may describe: element and byte counts are int64 on the wire and in the core.
MAX_TENSOR_BYTES = 2**63 - 1


def shape_size_error(name: str, shape, tensor_type: int) -> MessageFormatError:
    """A request's shape holds more bytes than a 64-bit count can (its element count or its byte count overflows).

    Honest ranks cannot build such an array; a corrupted or hostile request can, and would otherwise wrap.
    """
    count = math.prod(shape)
    itemsize = DTYPE_SIZES[tensor_type]
    return MessageFormatError(f"request list: tensor {name!r} of shape {tuple(shape)} holds {count} elements of "
                              f"{itemsize} bytes ({count * itemsize} bytes), more than a 64-bit size can count "
                              f"(at most {MAX_TENSOR_BYTES} bytes)")


def device_error(index: int, value: int) -> MessageFormatError:
    """A response's device ``index`` is below CPU_DEVICE_ID."""
    return MessageFormatError(f"response list: device {index} is {value}, out of range (>= {CPU_DEVICE_ID})")


def size_error(index: int, value: int, tensor_type: int) -> MessageFormatError:
    """A response's tensor size ``index`` is negative, or more elements than a 64-bit byte count can hold."""
    if value < 0:
        return MessageFormatError(f"response list: tensor size {index} is {value}, out of range (>= 0)")
    itemsize = DTYPE_SIZES[tensor_type]
    return MessageFormatError(f"response list: tensor size {index} is {value}, out of range (at most "
                              f"{MAX_TENSOR_BYTES // itemsize} elements of {itemsize} bytes, a 64-bit byte count)")


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


def ranks_phrase(ranks) -> str:
    """``"rank 2"`` / ``"ranks 1, 2"``."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


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
    (allreduce, adasum, broadcast, reducescatter); the reduce op and the scale factors (allreduce, adasum,
    reducescatter); for reducescatter, no joined rank and at least one dimension; for allgather and alltoall, no
    joined rank, at least one dimension and the same shape beyond the first dimension; for broadcast, no joined
    rank and the same root; finally the device. The message names each rank and what it sent.
    """
    first = requests[0]
    kind = first.request_type
    kind_name = REQUEST_TYPE_NAMES[kind]
    error = _first_mismatch(name, requests, [
        ("operations", lambda r: REQUEST_TYPE_NAMES[r.request_type]),
        ("data types", lambda r: dtype_name(r.tensor_type)),
    ])
    if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.BROADCAST,
                                  RequestType.REDUCESCATTER):
        error = _first_mismatch(name, requests, [("shapes", lambda r: _shape(r.tensor_shape))])
    if error is None and kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.REDUCESCATTER):
        error = _first_mismatch(name, requests, [
            ("reduce ops", lambda r: REDUCE_OPS[r.reduce_op] or "none"),
            ("prescale/postscale factors", lambda r: f"({r.prescale_factor:g}, {r.postscale_factor:g})"),
        ])
    if error is None and kind == RequestType.REDUCESCATTER:
        if joined_ranks:
            error = (f"reducescatter of {name!r} is not supported once a rank has joined "
                     f"({joined_phrase(joined_ranks)}); only allreduce works with join")
        elif len(first.tensor_shape) == 0:
            error = f"rank {first.request_rank} tried to reducescatter {name!r}, a 0-dimensional array"
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
                parts.append(f"{ranks_phrase(ranks)} sent {value}")
            kind = REQUEST_TYPE_NAMES[requests[0].request_type]
            return f"Mismatched {label} for tensor {name!r} ({kind}): " + "; ".join(parts) + "."
    return None


# -- groups (grouped_allreduce: one response for the group, all or nothing) -----------------------------------
def group_id_of(group_name: str) -> int:
    """The group id every rank derives from a group's name (a 31-bit CRC-32: the same on every rank and twin)."""
    return zlib.crc32(group_name.encode("utf-8")) & 0x7FFFFFFF


def group_name_of(member_name: str) -> str:
    """A group member is named ``<group>.<index>``: the group's name."""
    return member_name.rpartition(".")[0]


def group_size_error(group_name: str, sizes_by_rank: dict) -> str:
    """Ranks submitted the group with different numbers of tensors: who submitted how many."""
    by_size: dict[int, list[int]] = {}
    for rank in sorted(sizes_by_rank):
        by_size.setdefault(sizes_by_rank[rank], []).append(rank)
    parts = [f"{ranks_phrase(ranks)} submitted {size} tensor{'s' if size != 1 else ''}"
             for size, ranks in by_size.items()]
    return (f"grouped allreduce {group_name!r}: the ranks disagree on the group's members: " + "; ".join(parts)
            + ". Every rank must submit the same tensors in a group.")


def group_mismatch_error(group_name: str, responses) -> str | None:
    """Members of one group that cannot be reduced in one buffer (dtype, op, scale factors, devices), or None."""
    first = responses[0]
    for response in responses[1:]:
        for label, value in (("dtype", lambda r: dtype_name(r.tensor_type)),
                             ("reduce op", lambda r: REDUCE_OPS[r.reduce_op] or "none"),
                             ("prescale/postscale factors",
                              lambda r: f"({r.prescale_factor:g}, {r.postscale_factor:g})"),
                             ("devices", lambda r: str(r.devices))):
            if value(response) != value(first):
                return (f"grouped allreduce {group_name!r}: its tensors must share one {label}, but "
                        f"{first.tensor_names[0]!r} has {value(first)} and {response.tensor_names[0]!r} has "
                        f"{value(response)}")
    return None


def group_member_error(group_name: str, member_error: str) -> str:
    """One member of a group cannot run, so the whole group fails with this message."""
    return f"grouped allreduce {group_name!r} failed as a whole: {member_error}"


# -- shutdown ----------------------------------------------------------------------------------------------------
def refused_list_reason(sender: int, error) -> str:
    """Why the coordinator shuts everything down after refusing a rank's request list."""
    return f"the coordinator (rank 0) refused rank {sender}'s request list: {error}"


def coordinator_failed_reason(error: BaseException) -> str:
    """Why every rank stops when the coordinator itself failed in a cycle (the others wait in its broadcast).

    Logs the error with its traceback on rank 0 (logger ``distlab.collectives``), as the reason carries its text.
    """
    logging.getLogger("distlab.collectives").error("the coordinator failed in its negotiation cycle; every rank "
                                                   "stops", exc_info=error)
    text = f"{type(error).__name__}: {error}"
    if len(text) > 2000:
        text = text[:2000] + " [...]"
    return f"the coordinator (rank 0) failed in its negotiation cycle ({text}); see rank 0's log"


def shutdown_reason_text(reasons_by_rank: dict) -> str:
    """``"rank 1 called shutdown()"``: each reason with the ranks that gave it (a rank's reason is a predicate)."""
    by_reason: dict[str, list[int]] = {}
    for rank in sorted(reasons_by_rank):
        by_reason.setdefault(reasons_by_rank[rank] or "asked to shut down", []).append(rank)
    return "; ".join(f"{ranks_phrase(ranks)} {reason}" for reason, ranks in by_reason.items())


def trace_negotiation_start(timeline, name: str, request_type: int) -> None:
    """The coordinator saw the first request for ``name``: an instant on the timeline's negotiation lane."""
    if timeline is not None:
        timeline.instant(f"negotiate {name}", lane="negotiation", args={"type": REQUEST_TYPE_NAMES[request_type]})
