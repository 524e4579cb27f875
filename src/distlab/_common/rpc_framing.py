"""Shared by both twins of the RPC wire codec (``distlab.reference.rpc_framing``, ``distlab.core._rpc_framing``).

Written once: the header layout (from ``distlab._wire``), the limits every decoder enforces, which kinds and flags a
header may carry, the classes of pickle opcodes the pickle check walks, and every error the codec raises (same
class, same words in both twins).

Limits (a message that breaks one is refused before anything is allocated or waited for):

``MAX_BUFFERS``
    out-of-band buffers per message (65,536).
``MAX_FORKS``
    RRef fork records per message (65,536).
``MAX_DEVICES``
    a device record names a device index below this (65,536), or ``HOST_DEVICE`` (-1) for host memory.
``max_message_bytes()``
    the largest header message, and the largest total of a message's out-of-band buffers:
    ``DISTLAB_RPC_MAX_MESSAGE_BYTES`` (default 16 GiB).
"""
from __future__ import annotations

import os
import pickletools
import struct

from distlab._wire import (RFD_TUPLE_SIZE, RPC_FLAG_DEVICES, RPC_FLAG_ERROR, RPC_FLAG_INLINE, RPC_FLAG_NOREPLY,
                           RPC_HEADER_FORMAT, RPC_HOST_DEVICE, RPC_KIND_CODES, RPC_KINDS, RPC_REPLY_SLOTS,
                           RPC_USER_KIND_BASE,
                           RPC_WIRE_MAGIC, RPC_WIRE_VERSION)
from distlab.errors import RpcMessageError

__all__ = [
    "HEADER", "MAGIC", "VERSION", "FORK_RECORD_BYTES", "FRAME_LEN", "MAX_BUFFERS", "MAX_FORKS", "MAX_DEVICES", "MAX_SLOT", "COPY_MAX", "bad_slot_number",
    "FLAG_DEVICES", "HOST_DEVICE", "bad_devices", "bad_device",
    "DEFAULT_MAX_MESSAGE_BYTES", "max_message_bytes", "NUM_KINDS", "USER_KIND_BASE", "K_RESPONSE", "K_STOP",
    "K_WAKE", "K_BATCH", "RESPONSE_FLAGS", "REQUEST_FLAGS", "OP_CLASSES", "OP_UNKNOWN", "OP_PLAIN", "OP_STOP",
    "OP_FIXED1", "OP_FIXED2", "OP_FIXED4", "OP_FIXED8", "OP_COUNT1", "OP_COUNT4", "OP_COUNT8", "OP_LINE",
    "OP_LINE2", "OP_PUT_LINE", "OP_PUT4", "OP_FRAME", "OP_NEXT_BUFFER", "MAX_PUT_DIGITS", "OPENINGS",
    "bad_opening", "short_message",
    "bad_magic", "bad_version", "bad_slot", "unknown_kind", "bad_flags", "bad_counts", "too_short",
    "bad_buffer_size", "bad_control", "bad_batch", "bad_pickle", "buffer_count", "with_sizes",
]

HEADER = struct.Struct(RPC_HEADER_FORMAT)
MAGIC = RPC_WIRE_MAGIC
VERSION = RPC_WIRE_VERSION
FORK_RECORD_BYTES = 8 * RFD_TUPLE_SIZE   # one fork record: RFD_TUPLE_SIZE int64
FRAME_LEN = struct.Struct("<I")          # a batch is frames, each a little-endian uint32 length then a message
MAX_BUFFERS = 1 << 16
MAX_FORKS = 1 << 16
MAX_DEVICES = 1 << 16
MAX_SLOT = RPC_REPLY_SLOTS        # a request's reply slot is 0 (through the listener) or 1 to MAX_SLOT
#: ``unpack_header`` returns a body of at most this many bytes as a copy (``bytes``), a larger one as a view into the
#: message: copying a small body costs less than making a view, and a copy may outlive the receive buffer.
COPY_MAX = 1 << 16
FLAG_DEVICES = RPC_FLAG_DEVICES  # the header carries one device record per out-of-band buffer
HOST_DEVICE = RPC_HOST_DEVICE
DEFAULT_MAX_MESSAGE_BYTES = 1 << 34


def max_message_bytes() -> int:
    """``DISTLAB_RPC_MAX_MESSAGE_BYTES`` (default 16 GiB): the bound on a header message and on a message's
    out-of-band buffers together."""
    value = os.environ.get("DISTLAB_RPC_MAX_MESSAGE_BYTES", str(DEFAULT_MAX_MESSAGE_BYTES))
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"DISTLAB_RPC_MAX_MESSAGE_BYTES={value!r} is not a number of bytes") from None
    if not 0 < limit < 1 << 62:
        raise ValueError(f"DISTLAB_RPC_MAX_MESSAGE_BYTES must be positive (and below 2**62), got {limit}")
    return limit


# -- kinds and flags (a header with another kind, or flags its kind does not take, is refused before anything) ------
#: Kinds ``[0, NUM_KINDS)`` are distlab.rpc's own; ``[NUM_KINDS, USER_KIND_BASE)`` exist nowhere (refused by the
#: codec); kinds at or above ``USER_KIND_BASE`` are refused by the listener unless a handler is registered.
NUM_KINDS = len(RPC_KINDS)
USER_KIND_BASE = RPC_USER_KIND_BASE
K_RESPONSE = RPC_KIND_CODES["response"]
K_STOP = RPC_KIND_CODES["stop"]        # stop, wake and batch: no buffers, forks, metadata or flags; stop and wake
K_WAKE = RPC_KIND_CODES["wake"]        # carry no body either (a batch's body is its frames)
K_BATCH = RPC_KIND_CODES["batch"]
RESPONSE_FLAGS = RPC_FLAG_ERROR | RPC_FLAG_DEVICES                     # the flags a response may carry
REQUEST_FLAGS = RPC_FLAG_INLINE | RPC_FLAG_NOREPLY | RPC_FLAG_DEVICES  # the flags a request may carry


# -- pickle opcodes, by what follows them (what the pickle check needs to know to step over them) ----------------
OP_UNKNOWN = 0    # not a pickle opcode: refused
OP_PLAIN = 1      # no argument
OP_STOP = 2       # the end of the pickle
OP_FIXED1, OP_FIXED2, OP_FIXED4, OP_FIXED8 = 3, 4, 5, 6    # a fixed-size argument
OP_COUNT1, OP_COUNT4, OP_COUNT8 = 7, 8, 9  # a little-endian byte count, then that many bytes (pickle may allocate them first)
OP_LINE = 10      # an argument ending at a newline
OP_LINE2 = 11     # two newline-terminated arguments (GLOBAL, INST)
OP_PUT_LINE = 12  # PUT: a decimal memo index, newline-terminated (pickle grows its memo to twice the index)
OP_PUT4 = 13      # LONG_BINPUT: a 4-byte memo index (likewise)
OP_FRAME = 14     # FRAME: an 8-byte frame length
OP_NEXT_BUFFER = 15  # NEXT_BUFFER: takes the next out-of-band buffer (counted: the header must announce as many)
#: A PUT index has at most this many decimal digits (and nothing but digits): both twins parse it alike.
MAX_PUT_DIGITS = 18
#: The first two bytes a pickle may open with: PROTO and a protocol from 2 to 5, as every pickle distlab and
#: cloudpickle write does. The walk reads opcodes, not the unpickler's stack, so without this a count that shifts
#: a part onto the tail of another pickle (its strings are mostly opcodes too) could pass it.
OPENINGS = frozenset(bytes([0x80, protocol]) for protocol in range(2, 6))

_BY_ARGUMENT = {
    "uint1": OP_FIXED1, "uint2": OP_FIXED2, "int4": OP_FIXED4, "uint4": OP_FIXED4, "float8": OP_FIXED8,
    "string1": OP_COUNT1, "bytes1": OP_COUNT1, "unicodestring1": OP_COUNT1, "long1": OP_COUNT1,
    "string4": OP_COUNT4, "bytes4": OP_COUNT4, "unicodestring4": OP_COUNT4, "long4": OP_COUNT4,
    "bytes8": OP_COUNT8, "unicodestring8": OP_COUNT8, "bytearray8": OP_COUNT8,
    "decimalnl_short": OP_LINE, "decimalnl_long": OP_LINE, "stringnl": OP_LINE, "stringnl_noescape": OP_LINE,
    "unicodestringnl": OP_LINE, "floatnl": OP_LINE, "stringnl_noescape_pair": OP_LINE2,
}


def _op_classes() -> bytes:
    table = bytearray(256)
    for op in pickletools.opcodes:
        code = ord(op.code)
        if op.name == "STOP":
            table[code] = OP_STOP
        elif op.name == "PUT":
            table[code] = OP_PUT_LINE
        elif op.name == "LONG_BINPUT":
            table[code] = OP_PUT4
        elif op.name == "FRAME":
            table[code] = OP_FRAME
        elif op.name == "NEXT_BUFFER":
            table[code] = OP_NEXT_BUFFER
        elif op.arg is None:
            table[code] = OP_PLAIN
        else:
            table[code] = _BY_ARGUMENT[op.arg.name]
    return bytes(table)


#: ``OP_CLASSES[opcode]``: the class of each of the 256 byte values as a pickle opcode.
OP_CLASSES = _op_classes()


# -- errors (both twins raise exactly these) --------------------------------------------------------------------
def bad_fork_record(fork) -> ValueError:
    """A fork record handed to ``pack_header`` that is not ``RFD_TUPLE_SIZE`` ints (a caller's bug, not a message's)."""
    return ValueError(f"an RRef fork record has {RFD_TUPLE_SIZE} ints, got {fork!r}")


def short_message(n) -> RpcMessageError:
    return RpcMessageError(f"malformed RPC message: {n} bytes, shorter than the {HEADER.size}-byte header")


def bad_magic(magic) -> RpcMessageError:
    return RpcMessageError(f"malformed RPC message: it does not start with distlab's magic {MAGIC!r} "
                           f"(got {bytes(magic)!r})")


def bad_version(version, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"RPC message of wire version {version}, but this worker speaks version {VERSION}: every rank of a job "
        f"must run the same distlab", kind=kind, flags=flags, mid=mid)


def bad_slot_number(slot) -> ValueError:
    """A reply slot handed to ``pack_header`` outside 0 to MAX_SLOT (a caller's bug, not a message's)."""
    return ValueError(f"pack_header: a reply slot is 0 to {MAX_SLOT}, got {slot!r}")


def bad_slot(value, kind, flags, mid) -> RpcMessageError:
    """A reply slot on a message that is no request (only a request names where its reply goes)."""
    name = RPC_KINDS[kind] if 0 <= kind < NUM_KINDS else f"kind {kind}"
    return RpcMessageError(f"malformed RPC message: a {name} message names reply slot {value} (only a request "
                           "may; its other messages carry 0)", kind=kind, flags=flags, mid=mid)


def unknown_kind(kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"malformed RPC message: unknown message kind {kind} (distlab.rpc's kinds are 0 to {NUM_KINDS - 1}, "
        f"registered kinds {USER_KIND_BASE} and above)", kind=kind, flags=flags, mid=mid)


def bad_flags(kind, flags, mid) -> RpcMessageError:
    allowed = (RESPONSE_FLAGS if kind == K_RESPONSE else 0 if kind in (K_STOP, K_WAKE, K_BATCH)
               else REQUEST_FLAGS)
    name = RPC_KINDS[kind] if 0 <= kind < NUM_KINDS else "request"
    return RpcMessageError(f"malformed RPC message: flags {flags:#x} on a {name} message (it may carry "
                           f"{allowed:#x} at most)", kind=kind, flags=flags, mid=mid)


def bad_counts(nbuf, nforks, nmeta, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"malformed RPC message: header says {nbuf} out-of-band buffers, {nforks} RRef fork records and "
        f"{nmeta} metadata bytes (at most {MAX_BUFFERS} buffers and {MAX_FORKS} fork records, none negative)",
        kind=kind, flags=flags, mid=mid)


def too_short(need, n, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(f"malformed RPC message: its header needs {need} bytes but the message has {n}",
                           kind=kind, flags=flags, mid=mid)


def bad_buffer_size(index, size, total, limit, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"malformed RPC message: out-of-band buffer {index} of {size} bytes (total so far {total}): sizes must "
        f"be >= 0 and add up to at most {limit} bytes (DISTLAB_RPC_MAX_MESSAGE_BYTES)", kind=kind, flags=flags,
        mid=mid)


def bad_control(kind, nbuf, nforks, nmeta, nbody, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"malformed RPC message: a {RPC_KINDS[kind]} message with {nbuf} out-of-band buffers, {nforks} RRef fork "
        f"records, {nmeta} metadata bytes and a {nbody}-byte body (it carries none"
        f"{', its body is its frames' if kind == K_BATCH else ''})", kind=kind, flags=flags, mid=mid)


def bad_devices(devices, nbuf) -> ValueError:
    """Device records handed to ``pack_header`` that are not one int per buffer (a caller's bug)."""
    return ValueError(f"pack_header: {len(devices)} device records for {nbuf} out-of-band buffers (one each)")


def bad_device(index, device, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(
        f"malformed RPC message: out-of-band buffer {index} is for device {device}, but a device record is a "
        f"device index from 0 to {MAX_DEVICES - 1} or {HOST_DEVICE} (host memory)", kind=kind, flags=flags,
        mid=mid)


def bad_batch(pos, size, end) -> RpcMessageError:
    if size < 0:
        return RpcMessageError(f"malformed RPC batch: truncated frame length at byte {pos} of {end}")
    return RpcMessageError(f"malformed RPC batch: frame of {size} bytes at byte {pos} overruns the {end}-byte batch")


def bad_pickle(offset, opcode, reason, part="payload", kind=None, flags=None, mid=None) -> RpcMessageError:
    """A pickle refused by the walk; ``part`` names where it sits (a message's ``payload`` or ``metadata``)."""
    name = f"opcode {opcode:#04x}" if opcode >= 0 else "the end"
    return RpcMessageError(f"malformed RPC {part}: pickle {name} at byte {offset}: {reason}", kind=kind,
                           flags=flags, mid=mid)


def bad_opening(data, part="payload", kind=None, flags=None, mid=None):
    """None when ``data`` (bytes, two at least) opens as :data:`OPENINGS` says, else the refusal to raise."""
    if data[:2] in OPENINGS:
        return None
    return bad_pickle(0, data[0], "a pickle opens with PROTO 2 to 5 (protocol 2 or later)", part, kind, flags, mid)


def buffer_count(part, taken, nbuf, kind, flags, mid) -> RpcMessageError:
    return RpcMessageError(f"malformed RPC message: its {part} takes {taken} out-of-band buffers but its header "
                           f"announces {nbuf} for it", kind=kind, flags=flags, mid=mid)


def with_sizes(exc, sizes) -> RpcMessageError:
    """``exc`` with the buffer sizes its (otherwise refused) header announced, once they were checked: the
    listener then receives those buffers into nothing, so they are not taken for the next message's."""
    exc.sizes = tuple(sizes)
    return exc
