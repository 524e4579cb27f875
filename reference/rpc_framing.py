"""The RPC wire codec (reference twin): the bytes of a message's header, batches, and the pickle check.

Twinned with ``core/_rpc_framing.pyx``. :mod:`distlab.rpc.framing` uses the active twin for every message it
packs and parses; what it means is explained there. The header message is::

    fixed header      HEADER (distlab._wire.RPC_HEADER_FORMAT): magic b"dR", wire version, reply slot (a
                      request's, else 0), kind, flags, message id, nbuf, nforks, nmeta
    int64 * nbuf      byte size of each out-of-band buffer (they follow as MPI messages of their own)
    int64 * nbuf      only with FLAG_DEVICES: the device each buffer lands on at the receiver (HOST_DEVICE: host)
    int64 * 6 * nforks  RRef fork records (distlab._wire.RFD_TUPLE_SIZE ints each)
    nmeta bytes       the pickled request metadata (absent when there is none)
    body              the pickled payload (the rest of the message)

Nothing a message *claims* is trusted: the wire version, the kind (one of distlab.rpc's own or a registered
kind's range) and the flags that kind may carry, then counts, lengths and sizes are checked against the limits in
``distlab._common.rpc_framing`` and against the bytes actually received, before anything is allocated. The
same goes for a pickle: CPython's unpickler allocates the byte count a ``BINBYTES8`` opcode claims before it
reads the bytes, and grows its memo to twice the index a ``PUT`` names, so a 12-byte pickle can make it ask for
a terabyte. :func:`check_pickle` walks the opcodes first (without running any) and refuses such claims.
:func:`unpack_header` walks the metadata and the body that way too: each must be exactly one pickle, and the
body must take exactly the out-of-band buffers the header announces. So a message is refused whole, before any
of its pickles is loaded (a pickle can run code as it loads). What is not refused is a well-formed message whose
pickle runs code: that is the trust model of RPC (see docs).

Every error is a :class:`~distlab.errors.RpcMessageError` with the same words in both twins
(``distlab._common.rpc_framing``).
"""
from __future__ import annotations

import struct

from distlab._common import rpc_framing as shared
from distlab._common.rpc_framing import (COPY_MAX, FLAG_DEVICES, FORK_RECORD_BYTES, FRAME_LEN, HEADER,
                                         HOST_DEVICE, K_BATCH, K_RESPONSE, K_STOP, K_WAKE, MAGIC, MAX_BUFFERS,
                                         MAX_DEVICES, MAX_FORKS, MAX_PUT_DIGITS, MAX_SLOT, NUM_KINDS,
                                         OP_CLASSES, OP_COUNT1, OP_COUNT4, OP_COUNT8, OP_FIXED1, OP_FIXED2,
                                         OP_FIXED4, OP_FIXED8, OP_FRAME, OP_LINE, OP_LINE2, OP_NEXT_BUFFER,
                                         OP_PLAIN, OP_PUT4, OP_PUT_LINE, OP_STOP, REQUEST_FLAGS, RESPONSE_FLAGS,
                                         USER_KIND_BASE, VERSION)
from distlab._wire import RFD_TUPLE_SIZE
from distlab.errors import RpcMessageError

__all__ = ["pack_header", "unpack_header", "unpack_devices", "pack_batch", "split_batch", "check_pickle"]

#: How many bytes follow an opcode of each fixed-size class, and how wide each byte count is.
_FIXED = {OP_FIXED1: 1, OP_FIXED2: 2, OP_FIXED4: 4, OP_FIXED8: 8}
_COUNT_WIDTH = {OP_COUNT1: 1, OP_COUNT4: 4, OP_COUNT8: 8, OP_FRAME: 8}


def pack_header(kind: int, flags: int, mid: int, sizes, forks, meta: bytes, body, devices=(),
                slot: int = 0) -> bytes:
    """The header message: fixed header, buffer sizes, device records, fork records, metadata bytes, body.

    ``sizes`` are the out-of-band buffers' byte sizes; ``forks`` the fork data tuples of the RRefs in the body
    (a tuple that is not ``RFD_TUPLE_SIZE`` ints is a ValueError); ``devices``, when not empty, one device index
    per buffer (where the receiver rebuilds it; ``HOST_DEVICE`` for host memory): it sets ``FLAG_DEVICES``;
    ``slot``, a request's reply slot (0 to 255; 0: the reply goes to the caller's listener, else to the thread
    that waits for it, on its own tag).
    """
    if not 0 <= slot <= MAX_SLOT:
        raise shared.bad_slot_number(slot)
    for fork in forks:
        if len(fork) != RFD_TUPLE_SIZE:
            raise shared.bad_fork_record(fork)
    if devices:
        if len(devices) != len(sizes):
            raise shared.bad_devices(devices, len(sizes))
        flags |= FLAG_DEVICES  # mirrors tensorpipe's message descriptor: each tensor names its target device
    fixed = HEADER.pack(MAGIC, VERSION, slot, kind, flags, mid, len(sizes), len(forks), len(meta))
    sizes_bytes = struct.pack(f"<{len(sizes)}q", *sizes)
    if devices:
        sizes_bytes += struct.pack(f"<{len(devices)}q", *devices)
    fork_bytes = struct.pack(f"<{RFD_TUPLE_SIZE * len(forks)}q", *[x for fork in forks for x in fork])
    return b"".join((fixed, sizes_bytes, fork_bytes, meta, body))


def unpack_header(data, max_bytes: int) -> tuple:
    """Parse and check a header message; return ``(kind, flags, mid, sizes, forks, meta, body, slot)``.

    ``meta`` and ``body`` are still pickled (``meta`` is ``b""`` when there is none; ``body`` a copy when it has at
    most ``COPY_MAX`` bytes, else a memoryview into ``data``): nothing is unpickled here, and the checks come
    first, in this order (PyTorch's utils.cpp ``deserializeRequest`` too decides the message type before it
    deserializes anything): wire version, kind, the reply slot (a request's only), the flags that kind may carry,
    counts, lengths, buffer sizes (``max_bytes`` bounds them together), then the walk of the metadata and of the body
    (:func:`check_pickle`): each exactly one pickle, the metadata taking no out-of-band buffer and the body
    exactly ``nbuf``. stop, wake and batch messages carry no buffers, forks, metadata or flags (stop and wake no
    body either). Raises RpcMessageError, which carries kind, flags and message id once the magic and the version
    are right (so the agent can answer the sender), and the buffer sizes once they were checked (so the listener
    can receive those buffers into nothing).
    """
    view = memoryview(data)
    n = len(view)
    if n < HEADER.size:
        raise shared.short_message(n)
    magic, version, slot, kind, flags, mid, nbuf, nforks, nmeta = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise shared.bad_magic(magic)
    if version != VERSION:
        raise shared.bad_version(version, kind, flags, mid)
    if kind < 0 or NUM_KINDS <= kind < USER_KIND_BASE:
        raise shared.unknown_kind(kind, flags, mid)
    control = kind == K_STOP or kind == K_WAKE or kind == K_BATCH
    if slot and (control or kind == K_RESPONSE):
        raise shared.bad_slot(slot, kind, flags, mid)
    allowed = RESPONSE_FLAGS if kind == K_RESPONSE else (0 if control else REQUEST_FLAGS)
    if flags & ~allowed:
        raise shared.bad_flags(kind, flags, mid)
    if not (0 <= nbuf <= MAX_BUFFERS and 0 <= nforks <= MAX_FORKS and nmeta >= 0):
        raise shared.bad_counts(nbuf, nforks, nmeta, kind, flags, mid)
    sizes_at = HEADER.size
    forks_at = sizes_at + (16 if flags & FLAG_DEVICES else 8) * nbuf  # the device records follow the sizes
    meta_at = forks_at + FORK_RECORD_BYTES * nforks
    body_at = meta_at + nmeta
    if body_at > n:
        raise shared.too_short(body_at, n, kind, flags, mid)
    sizes = struct.unpack_from(f"<{nbuf}q", view, sizes_at)
    total = 0
    for index, size in enumerate(sizes):
        total += size
        if size < 0 or total > max_bytes:
            raise shared.bad_buffer_size(index, size, total, max_bytes, kind, flags, mid)
    # The sizes are sound: from here on a refusal carries them (the listener must still take those buffers).
    if control:
        if nbuf or nforks or nmeta or (kind != K_BATCH and body_at != n):
            raise shared.with_sizes(shared.bad_control(kind, nbuf, nforks, nmeta, n - body_at, flags, mid), sizes)
    else:
        for part, start, end, expected in (("metadata", meta_at, body_at, 0), ("payload", body_at, n, nbuf)):
            if part == "metadata" and start == end:
                continue  # no metadata
            try:
                taken = _walk(view[start:end], part, kind, flags, mid)
            except RpcMessageError as exc:
                raise shared.with_sizes(exc, sizes) from None
            if taken != expected:
                raise shared.with_sizes(shared.buffer_count(part, taken, expected, kind, flags, mid), sizes)
    flat = struct.unpack_from(f"<{RFD_TUPLE_SIZE * nforks}q", view, forks_at)
    forks = [flat[i:i + RFD_TUPLE_SIZE] for i in range(0, len(flat), RFD_TUPLE_SIZE)]
    meta = view[meta_at:body_at] if nmeta else b""
    body = bytes(view[body_at:]) if n - body_at <= COPY_MAX else view[body_at:]
    return kind, flags, mid, sizes, forks, meta, body, slot


def unpack_devices(data) -> tuple:
    """The device record of each out-of-band buffer of a header message that ``unpack_header`` accepted: a tuple
    of device indices (``HOST_DEVICE`` for host memory), empty when the message has no ``FLAG_DEVICES``.

    RpcMessageError for a record that names no device (below ``HOST_DEVICE``, or ``MAX_DEVICES`` or more).
    """
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise shared.short_message(len(view))
    _magic, _version, _slot, kind, flags, mid, nbuf, _nforks, _nmeta = HEADER.unpack_from(view, 0)
    if not flags & FLAG_DEVICES:
        return ()
    if HEADER.size + 16 * nbuf > len(view):
        raise shared.too_short(HEADER.size + 16 * nbuf, len(view), kind, flags, mid)
    devices = struct.unpack_from(f"<{nbuf}q", view, HEADER.size + 8 * nbuf)
    for index, device in enumerate(devices):
        if not HOST_DEVICE <= device < MAX_DEVICES:
            raise shared.bad_device(index, device, kind, flags, mid)
    return devices


def pack_batch(frames) -> bytes:
    """Several small messages as one: each frame's length (uint32) then the frame."""
    return b"".join(FRAME_LEN.pack(len(frame)) + bytes(frame) for frame in frames)


def split_batch(data) -> list:
    """The frames of a batch (memoryviews into ``data``), in order; RpcMessageError if a length overruns."""
    view = memoryview(data)
    end = len(view)
    frames = []
    pos = 0
    while pos < end:
        if pos + FRAME_LEN.size > end:
            raise shared.bad_batch(pos, -1, end)
        (size,) = FRAME_LEN.unpack_from(view, pos)
        if pos + FRAME_LEN.size + size > end:
            raise shared.bad_batch(pos, size, end)
        pos += FRAME_LEN.size
        frames.append(view[pos:pos + size])
        pos += size
    return frames


def check_pickle(data) -> int:
    """Walk a pickle's opcodes without running them; return how many out-of-band buffers it takes.

    Refused (RpcMessageError): a pickle that does not open with PROTO 2 to 5, a byte that is no pickle opcode, an argument cut off by the end, a byte count
    (or frame length) larger than the bytes that remain, a PUT / LONG_BINPUT memo index no pickler could have
    written (one at least as large as the number of opcodes read so far), a pickle without STOP, and bytes after
    its STOP. So what the unpickler allocates while it reads stays within a small multiple of ``len(data)``. The
    count is of ``NEXT_BUFFER`` opcodes: each takes the next out-of-band buffer (pickle protocol 5).
    """
    return _walk(data, "payload", None, None, None)


def _walk(data, part, kind, flags, mid) -> int:
    """check_pickle; a refusal names ``part`` and carries the message's kind, flags and id."""
    raw = bytes(data)
    n = len(raw)
    pos = 0
    opcodes = 0
    buffers = 0
    ctx = (part, kind, flags, mid)
    if n >= 2 and (refused := shared.bad_opening(raw, *ctx)) is not None:
        raise refused
    while pos < n:
        at, opcode = pos, raw[pos]
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
                raise shared.bad_pickle(at, opcode, f"{n - pos} bytes follow the STOP opcode", *ctx)
            return buffers
        if op in _FIXED:
            pos += _FIXED[op]
            if pos > n:
                raise shared.bad_pickle(at, opcode, "its argument is cut off", *ctx)
        elif op in _COUNT_WIDTH:
            width = _COUNT_WIDTH[op]
            if pos + width > n:
                raise shared.bad_pickle(at, opcode, "its byte count is cut off", *ctx)
            count = int.from_bytes(raw[pos:pos + width], "little")
            pos += width
            if count > n - pos:
                raise shared.bad_pickle(at, opcode, f"claims {count} bytes but only {n - pos} remain", *ctx)
            if op != OP_FRAME:  # a frame's bytes are opcodes, read on; other counted bytes are data
                pos += count
        elif op == OP_LINE or op == OP_LINE2:
            for _ in range(1 if op == OP_LINE else 2):
                newline = raw.find(b"\n", pos)
                if newline < 0:
                    raise shared.bad_pickle(at, opcode, "its argument has no newline", *ctx)
                pos = newline + 1
        elif op == OP_PUT_LINE or op == OP_PUT4:
            if op == OP_PUT4:
                if pos + 4 > n:
                    raise shared.bad_pickle(at, opcode, "its argument is cut off", *ctx)
                index = int.from_bytes(raw[pos:pos + 4], "little")
                pos += 4
            else:
                newline = raw.find(b"\n", pos)
                digits = raw[pos:newline] if newline >= 0 else b""
                if not (0 < len(digits) <= MAX_PUT_DIGITS and digits.isdigit()):
                    raise shared.bad_pickle(at, opcode, f"a PUT index is 1 to {MAX_PUT_DIGITS} decimal digits", *ctx)
                index = int(digits)
                pos = newline + 1
            if index >= opcodes:
                raise shared.bad_pickle(at, opcode, f"memo index {index} but only {opcodes} opcodes were read", *ctx)
        else:
            raise shared.bad_pickle(at, opcode, "not a pickle opcode", *ctx)
    raise shared.bad_pickle(n, -1, "no STOP opcode", *ctx)
