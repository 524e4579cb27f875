"""Message framing and serialization for the RPC agent (shared plumbing, not twinned).

A message is one MPI message on ``TAG_HEADER`` followed by zero or more MPI messages on ``TAG_BUFFER`` (the
out-of-band buffers, sent from the arrays' own memory: pickle protocol 5 with ``buffer_callback``, never copied
through the pickle bytes). The header message is::

    struct  <iiqii  kind, flags, message id, number of buffers, length of the "outer" pickle
    int64 * nbuf    byte size of each out-of-band buffer
    outer pickle    (meta, forks): request metadata (any picklable object, or None) and the RRef fork data
                    carried by the body (a list of ``RFD_TUPLE_SIZE`` tuples); absent when both are empty
    body            the pickled payload, whose RRefs are placeholders resolved from ``forks`` on the receiver

RRefs are pickled in two phases (so the receiver can act on them before running any user code): while the body
is pickled, each RRef's ``__reduce__`` calls the *fork hook* installed by :func:`dumps` (the RRef context's
``prepare_child_fork``) and leaves a placeholder holding its index in ``forks``. The receiver first turns every
fork data tuple into an RRef (``receive_fork``), waits for their confirmations, then unpickles the body with the
placeholders resolved (:func:`loads`).

Functions defined in ``__main__`` (and lambdas, local functions) travel by value through cloudpickle; the
bytes are cached per function object.
"""
from __future__ import annotations

import pickle
import struct
import threading
import weakref

import cloudpickle

__all__ = [
    "HEADER", "FLAG_ERROR", "FLAG_INLINE", "FLAG_NOREPLY", "INBAND_MAX",
    "dumps", "loads", "pack_header", "unpack_header", "by_value", "current_forks",
]

HEADER = struct.Struct("<iiqii")
FLAG_ERROR = 1      # response: the body is a remote exception description
FLAG_INLINE = 2     # request: cheap, run on the listener thread
FLAG_NOREPLY = 4    # request: no response expected

#: Buffers at most this big travel in-band: an extra MPI message costs more than the copy. Measured here
#: (2 ranks, rpc_sync echo of a 4000-byte array): out-of-band 540-630 us, in-band 140-235 us.
INBAND_MAX = 4096

_local = threading.local()


def current_forks():
    """The fork list being filled by :func:`dumps` on this thread (None outside a dumps call)."""
    return getattr(_local, "forks", None)


def _fork_placeholder(index):
    resolved = getattr(_local, "resolved", None)
    if resolved is None:
        raise pickle.UnpicklingError("an RRef placeholder was unpickled outside distlab.rpc framing.loads")
    return resolved[index]


class _ByValue:
    """Wraps cloudpickle bytes of a function so plain pickle carries it by value."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return cloudpickle.loads, (self.data,)


_by_value_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _resolve_main(name, data):
    import sys

    fn = getattr(sys.modules.get("__main__"), name, None) if name else None
    if fn is not None:
        return fn
    if data is None:
        raise pickle.UnpicklingError(
            f"function {name!r} is not defined in this worker's __main__ and could not travel by value")
    return cloudpickle.loads(data)


class _MainFunction:
    """A top-level ``__main__`` function: the receiver's own ``__main__.<name>`` (every rank runs the same
    script, and the function must see the receiver's globals), else the cloudpickled copy."""

    __slots__ = ("name", "data")

    def __init__(self, name, data):
        self.name = name
        self.data = data

    def __reduce__(self):
        return _resolve_main, (self.name, self.data)


def by_value(fn):
    """Return ``fn`` if pickle can name it everywhere, else a (cached) wrapper that carries it.

    Top-level ``__main__`` functions resolve to the receiver's ``__main__`` function of that name (falling
    back to a cloudpickled copy); lambdas and local functions travel by value (cloudpickle).
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module != "__main__" and "<" not in qualname:
        return fn
    try:
        wrapped = _by_value_cache.get(fn)
    except TypeError:
        wrapped = None
    if wrapped is None:
        try:
            data = cloudpickle.dumps(fn, protocol=5)
        except Exception:  # noqa: BLE001 - e.g. it references a lock: by name only
            data = None
        if module == "__main__" and "." not in qualname and "<" not in qualname:
            wrapped = _MainFunction(qualname, data)
        elif data is None:
            raise pickle.PicklingError(f"cannot send {fn!r}: it is not importable and cloudpickle failed")
        else:
            wrapped = _ByValue(data)
        try:
            _by_value_cache[fn] = wrapped
        except TypeError:
            pass
    return wrapped


def rref_reduce(fork_data):
    """What an RRef's ``__reduce__`` returns after forking: a placeholder for ``fork_data`` (see module doc)."""
    forks = getattr(_local, "forks", None)
    if forks is None:
        raise pickle.PicklingError(
            "an RRef can only be pickled by distlab.rpc while sending it (rpc_sync/rpc_async/remote arguments "
            "or return values)")
    forks.append(fork_data)
    return _fork_placeholder, (len(forks) - 1,)


def dumps(obj, fork_hook=None):
    """Pickle ``obj`` (protocol 5). Return ``(body, buffers, forks)``.

    ``buffers`` are ``pickle.PickleBuffer`` views of the arrays' memory (out-of-band, larger than
    ``INBAND_MAX``); ``forks`` holds the fork data of every RRef in ``obj`` (``fork_hook(rref)`` made each).
    """
    buffers = []

    def callback(pb):
        raw = pb.raw()
        if raw.nbytes <= INBAND_MAX:
            return True  # in-band
        buffers.append(raw)
        return False

    outer_forks = getattr(_local, "forks", None)
    outer_hook = getattr(_local, "hook", None)
    _local.forks = forks = []
    _local.hook = fork_hook
    try:
        try:
            body = pickle.dumps(obj, protocol=5, buffer_callback=callback)
        except (pickle.PicklingError, AttributeError, TypeError):
            if forks:
                raise
            buffers.clear()
            body = cloudpickle.dumps(obj, protocol=5, buffer_callback=callback)
    finally:
        _local.forks = outer_forks
        _local.hook = outer_hook
    return body, buffers, forks


def fork_hook():
    """The fork hook of the running :func:`dumps` (what an RRef's ``__reduce__`` calls)."""
    return getattr(_local, "hook", None)


def loads(body, buffers=(), resolved=None):
    """Unpickle ``body`` with its out-of-band ``buffers``; RRef placeholders become ``resolved[i]``."""
    previous = getattr(_local, "resolved", None)
    _local.resolved = resolved
    try:
        return pickle.loads(body, buffers=buffers)
    finally:
        _local.resolved = previous


def pack_header(kind, flags, mid, buffers, meta, forks, body):
    """Build the header message bytes (see the module docstring)."""
    outer = pickle.dumps((meta, forks), protocol=5) if (meta is not None or forks) else b""
    sizes = struct.pack(f"<{len(buffers)}q", *[b.nbytes for b in buffers]) if buffers else b""
    return b"".join((HEADER.pack(kind, flags, mid, len(buffers), len(outer)), sizes, outer, body))


def unpack_header(data):
    """Parse header message bytes: return ``(kind, flags, mid, sizes, meta, forks, body)`` (body is a view)."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise ValueError(f"malformed RPC message: {len(view)} bytes, shorter than the {HEADER.size}-byte header")
    kind, flags, mid, nbuf, nouter = HEADER.unpack_from(view, 0)
    pos = HEADER.size
    if nbuf < 0 or nouter < 0 or pos + 8 * nbuf + nouter > len(view):
        raise ValueError(f"malformed RPC message: header says {nbuf} buffers and {nouter} outer bytes "
                         f"but the message has {len(view)} bytes")
    sizes = struct.unpack_from(f"<{nbuf}q", view, pos) if nbuf else ()
    pos += 8 * nbuf
    if nouter:
        meta, forks = pickle.loads(view[pos:pos + nouter])
    else:
        meta, forks = None, ()
    pos += nouter
    return kind, flags, mid, sizes, meta, forks, view[pos:]
