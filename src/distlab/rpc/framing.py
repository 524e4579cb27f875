"""Message framing and serialization for the RPC agent (shared plumbing; the byte codec is twinned).

A message is one MPI message on ``TAG_HEADER`` followed by zero or more MPI messages on ``TAG_BUFFER`` (the
out-of-band buffers, sent from the arrays' own memory: pickle protocol 5 with ``buffer_callback``, never copied
through the pickle bytes). The header message is (layout and checks in the codec,
:mod:`distlab.reference.rpc_framing` / ``distlab.core._rpc_framing``, the active twin)::

    fixed header    magic b"dR", wire version (distlab._wire.RPC_WIRE_VERSION), kind, flags, message id,
                    number of buffers, number of RRef fork records, length of the metadata
    int64 * nbuf    byte size of each out-of-band buffer
    fork records    the RRef fork data carried by the body (``RFD_TUPLE_SIZE`` int64 each)
    metadata        the request metadata, pickled (any picklable object; absent when None)
    body            the pickled payload, whose RRefs are placeholders resolved from the fork records

Nothing a message claims is trusted (limits in ``distlab._common.rpc_framing``): the wire version, a kind that
exists and the flags it may carry, at most 65,536 buffers and 65,536 fork records, a header message and a
message's buffers each at most ``DISTLAB_RPC_MAX_MESSAGE_BYTES`` (16 GiB), every length checked against the bytes
received, the metadata and the body each exactly one pickle, walked by the codec (CPython's unpickler allocates
what a pickle claims before reading it), the body taking exactly the buffers the header announces. Any violation
is a :class:`~distlab.errors.RpcMessageError`, raised by :func:`unpack_header` before anything is unpickled; the
listener then refuses a kind no handler is registered for (still nothing unpickled), and only then are the
metadata (:func:`load_meta`) and the body (:func:`loads`) unpickled. A well-formed pickle can still run code
when loaded: RPC trusts the workers of its job (see the trust model in the docs).

RRefs are pickled in two phases (so the receiver can act on them before running any user code): while the body
is pickled, each RRef's ``__reduce__`` calls the *fork hook* installed by :func:`dumps` (the RRef context's
``prepare_child_fork``) and leaves a placeholder holding its index in ``forks``. The receiver first turns every
fork data tuple into an RRef (``receive_fork``), waits for their confirmations, then unpickles the body with the
placeholders resolved (:func:`loads`).

Device arrays (cupy, or a registered stand-in) travel out of band too, each buffer with a device record in the
header: ``dumps(..., place=...)`` asks ``place(device)`` where each lands (the device map; see
:mod:`distlab.rpc.devices`), and refuses them when it is None.

Functions defined in ``__main__`` (and lambdas, local functions) travel by value through cloudpickle; the
bytes are cached per function object. A call names a top-level ``__main__`` function (the receiver runs its own
``__main__``'s function of that name), and its by-value copy travels with the calls to a worker only until that
worker has answered one of them (:func:`main_ref`): the receiver keeps the copies it loaded, by digest.
"""
from __future__ import annotations

import collections.abc
import copyreg
import functools
import hashlib
import importlib
import io
import pickle
import sys
import threading
import types
import weakref

import cloudpickle
import numpy as np

from distlab import _backend
from distlab._common.rpc_framing import HEADER, HOST_DEVICE, MAX_BUFFERS, MAX_FORKS, max_message_bytes
from distlab._wire import RPC_FLAG_ERROR, RPC_FLAG_INLINE, RPC_FLAG_NOREPLY
from distlab.errors import RpcDeviceError, RpcMessageError

from . import devices as _devices

__all__ = [
    "HEADER", "FLAG_ERROR", "FLAG_INLINE", "FLAG_NOREPLY", "INBAND_MAX", "MAX_BUFFERS", "MAX_FORKS",
    "MAX_MESSAGE_BYTES", "dumps", "loads", "pack_header", "unpack_header", "load_meta", "pack_batch", "split_batch",
    "by_value", "call_payload", "function_ref", "main_ref", "resolve_ref", "current_forks", "buffer_devices", "device_records", "place_buffers", "codec",
    "NONE_BODY",
]

FLAG_ERROR = RPC_FLAG_ERROR      # response: the body is a remote exception description
FLAG_INLINE = RPC_FLAG_INLINE    # request: cheap, run on the listener thread
FLAG_NOREPLY = RPC_FLAG_NOREPLY  # request: no response expected

#: Buffers at most this big travel in-band: an extra MPI message costs more than the copy (docs/measurements.md,
#: "RPC: in-band buffers and the buffer spin").
INBAND_MAX = 4096
#: ``DISTLAB_RPC_MAX_MESSAGE_BYTES`` when distlab.rpc was imported.
MAX_MESSAGE_BYTES = max_message_bytes()
#: The pickle of None (what :func:`dumps` returns for it without pickling, and :func:`loads` reads back as None).
NONE_BODY = pickle.dumps(None, protocol=5)

_codec = _backend.load("rpc_framing")
#: the active twin of the wire codec (:mod:`distlab.reference.rpc_framing` or its core twin)
codec = _codec


class _Local(threading.local):
    """This thread's framing state: the running :func:`dumps` (its forks, fork hook and device placement) and the
    RRefs :func:`loads` resolves placeholders to. Class-level defaults: reading a thread-local attribute that was
    never set raises (and formats) an AttributeError inside ``getattr``, thousands of instructions per call."""

    dumping = None
    resolved = None


_local = _Local()


def current_forks():
    """The fork list being filled by :func:`dumps` on this thread (None outside a dumps call)."""
    dumping = _local.dumping
    return dumping[0] if dumping is not None else None


def _fork_placeholder(index):
    resolved = _local.resolved
    if resolved is None:
        raise pickle.UnpicklingError("an RRef placeholder was unpickled outside distlab.rpc framing.loads")
    return resolved[index]


def _load_by_value(data):
    """Load a function's cloudpickle bytes, checked first like any pickle a message carries (they are a pickle
    inside the body's pickle, which the body's check skips as plain bytes)."""
    _codec.check_pickle(data)
    return cloudpickle.loads(data)


class _ByValue:
    """Wraps cloudpickle bytes of a function so plain pickle carries it by value."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return _load_by_value, (self.data,)


_by_value_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_received: dict = {}  # digest -> the __main__ function a caller's by-value copy made here (main_ref)


def _resolve_main(name, data, digest=None):
    fn = getattr(sys.modules.get("__main__"), name, None) if name else None
    if fn is not None:
        return fn
    if digest is not None:
        fn = _received.get(digest)
        if fn is not None:
            return fn
    if data is None:
        if digest is not None:
            raise pickle.UnpicklingError(
                f"function {name!r} is not defined in this worker's __main__, and the by-value copy its caller "
                "sends once per worker has not reached this worker (was it restarted?); the caller sends the copy "
                "again with its next call")
        raise pickle.UnpicklingError(
            f"function {name!r} is not defined in this worker's __main__ and could not travel by value")
    fn = _load_by_value(data)
    if digest is not None:
        _received[digest] = fn
    return fn


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
    forks = current_forks()
    if forks is None:
        raise pickle.PicklingError(
            "an RRef can only be pickled by distlab.rpc while sending it (rpc_sync/rpc_async/remote arguments "
            "or return values)")
    forks.append(fork_data)
    return _fork_placeholder, (len(forks) - 1,)


def _reduce_device_array(kind, array):
    """Pickle a device array as a host buffer (out of band) whose device record says where it lands."""
    place, pending = _local.dumping[2]  # those of the running dumps
    if place is None:
        raise RpcDeviceError(f"a {kind.name} device array can only travel as an RPC argument or result")
    target = place(kind.device_of(array))  # RpcDeviceError when no device map covers it
    host = kind.to_host(array)  # waits for the array's stream (mirrors the agent's stream sync)
    pb = pickle.PickleBuffer(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    pending[id(pb)] = (pb, target)
    return _devices.rebuild_device_array, (kind.name, pb, host.dtype.str, tuple(host.shape))


_picklers: dict = {}  # (pickle module, device kinds, copyreg entries) -> its Pickler reducing those device arrays


def _pickle(module, obj, callback, kinds) -> bytes:
    """``module.dumps`` (pickle or cloudpickle, protocol 5), with device arrays reduced when any kind is known."""
    if not kinds:
        return module.dumps(obj, protocol=5, buffer_callback=callback)
    key = (module, tuple(kinds), len(copyreg.dispatch_table))
    pickler_class = _picklers.get(key)
    if pickler_class is None:
        # A class attribute: the C pickler reads dispatch_table once, in __init__ (cloudpickle's Pickler has its own
        # as a class attribute, so setting one on an instance afterwards would be ignored).
        base = getattr(module.Pickler, "dispatch_table", None)  # cloudpickle's own; the C pickler has a slot
        table = dict(base if isinstance(base, collections.abc.Mapping) else copyreg.dispatch_table)
        for kind in kinds:
            table[kind.type] = functools.partial(_reduce_device_array, kind)
        pickler_class = _picklers[key] = type("DevicePickler", (module.Pickler,), {"dispatch_table": table})
    file = io.BytesIO()
    pickler_class(file, protocol=5, buffer_callback=callback).dump(obj)
    return file.getvalue()


def dumps(obj, fork_hook=None, place=None):
    """Pickle ``obj`` (protocol 5). Return ``(body, buffers, forks)``.

    ``buffers`` are ``pickle.PickleBuffer`` views of the arrays' memory (out-of-band, larger than
    ``INBAND_MAX``), and a :class:`~distlab.rpc.devices.DeviceBuffer` for each device array (always out of band:
    ``place(device)`` names the receiver's device it lands on, and raises RpcDeviceError when no device map
    covers it; without ``place`` a device array is refused); ``forks`` holds the fork data of every RRef in
    ``obj`` (``fork_hook(rref)`` made each).
    """
    if obj is None:
        return NONE_BODY, [], []  # the commonest answer: no pickler at all
    buffers = []
    pending = {}  # id(PickleBuffer) -> (PickleBuffer, target device) of the device arrays being pickled

    def callback(pb):
        device = pending.pop(id(pb), None) if pending else None
        if device is not None:
            buffers.append(_devices.DeviceBuffer(pb.raw(), device[1]))
            return False
        raw = pb.raw()
        if raw.nbytes <= INBAND_MAX:
            return True  # in-band
        buffers.append(raw)
        return False

    kinds = _devices.device_kinds()  # none unless cupy or a stand-in is in use: then nothing more is done
    forks = []
    outer = _local.dumping
    _local.dumping = (forks, fork_hook, (place, pending) if kinds else None)
    try:
        try:
            body = (_pickle(pickle, obj, callback, kinds) if kinds else
                    pickle.dumps(obj, protocol=5, buffer_callback=callback))
        except (pickle.PicklingError, AttributeError, TypeError):
            if forks:
                raise
            buffers.clear()
            body = _pickle(cloudpickle, obj, callback, kinds)
    finally:
        _local.dumping = outer
    return body, buffers, forks


def fork_hook():
    """The fork hook of the running :func:`dumps` (what an RRef's ``__reduce__`` calls)."""
    dumping = _local.dumping
    return dumping[1] if dumping is not None else None


def loads(body, buffers=(), resolved=None, checked=False):
    """Unpickle ``body`` with its out-of-band ``buffers``; RRef placeholders become ``resolved[i]``.

    The pickle is checked first (``check_pickle``; ``checked=True``: the body of a message :func:`unpack_header`
    returned, which the codec walked already); a malformed one, or one that fails to load, raises RpcMessageError
    (chained to the unpickler's own error).
    """
    if not checked:
        _codec.check_pickle(body)
    if body == NONE_BODY:
        return None
    previous = _local.resolved
    if previous is not resolved:
        _local.resolved = resolved
    try:
        return pickle.loads(body, buffers=buffers)
    except Exception as exc:  # noqa: BLE001 - a payload that cannot be rebuilt here is a message error
        raise RpcMessageError(f"could not unpickle the RPC payload: {type(exc).__name__}: {exc}") from exc
    finally:
        if previous is not resolved:
            _local.resolved = previous


def call_payload(func, args, kwargs) -> tuple:
    """The payload of a call: ``(ref, args, kwargs)``, ``ref`` what travels for ``func`` (:func:`function_ref`)."""
    ref = _refs.get(func) if type(func) is types.FunctionType else None
    if ref is None:
        if not callable(func):
            raise TypeError(f"rpc: func must be callable, got {type(func).__name__}")
        ref = function_ref(func)
    return (ref, args if type(args) is tuple else tuple(args), dict(kwargs) if kwargs else None)


_refs: dict = {}  # function -> its reference (module-level functions only: they live as long as their module)


def function_ref(func):
    """What travels for ``func``: its name, when the receiver can find it by name, else ``func`` made sendable.

    A module-level function of an importable module travels as ``"module:qualname"``, a top-level ``__main__``
    function as ``(name, its cloudpickle bytes or None, their digest or None)`` (:func:`main_ref` drops the bytes
    for a worker that has them): the receiver finds each by name (:func:`resolve_ref`, through a cache), with no
    global for the pickler to look up on either side (that lookup is most of the cost of pickling a call).
    Anything else travels as :func:`by_value` makes it (lambdas and local functions by value, methods, builtins
    and other callables as pickle pickles them).
    """
    if type(func) is types.FunctionType and "<" not in func.__qualname__:
        module, qualname = func.__module__, func.__qualname__
        if module == "__main__":
            if "." not in qualname:
                data = by_value(func).data
                digest = hashlib.blake2b(data, digest_size=16).digest() if data is not None else None
                ref = _refs[func] = (qualname, data, digest)
                if digest is not None:
                    _without_copy[digest] = (qualname, None, digest)
                return ref
        elif module and _named(module, qualname) is func:
            ref = _refs[func] = f"{module}:{qualname}"
            return ref
    return by_value(func)


_without_copy: dict = {}  # digest -> the ref of a __main__ function without its by-value copy


def main_ref(ref, seen):
    """A top-level ``__main__`` function's ref (:func:`function_ref`) as a call to one worker sends it:
    ``(ref, fresh)``, without the by-value copy once that worker has it (its digest in ``seen``, the digests of the
    copies it answered a call with), else with it (``fresh``: True when the copy travels)."""
    digest = ref[2]
    if digest is None:
        return ref, False   # no copy (cloudpickle failed): the receiver's own __main__ function, or an error
    if digest in seen:
        return _without_copy[digest], False
    return ref, True


def _named(module: str, qualname: str):
    target = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


_resolved: dict = {}  # "module:qualname" -> the function (what resolve_ref found)


def resolve_ref(ref):
    """The function a call's ``ref`` names (:func:`function_ref`); a callable is returned as it is."""
    if type(ref) is str:
        fn = _resolved.get(ref)
        if fn is None:
            module, _, qualname = ref.partition(":")
            importlib.import_module(module)  # as the unpickler would (the trust model of RPC: the workers of a job)
            fn = _named(module, qualname)
            if not callable(fn):
                raise RpcMessageError(f"a call names {ref!r}, which is not a function on this worker")
            _resolved[ref] = fn
        return fn
    if type(ref) is tuple:
        return _resolve_main(*ref)
    return ref


def buffer_devices(buffers) -> tuple:
    """The device record of each buffer (``HOST_DEVICE`` for host memory); empty when none is a device array."""
    if not any(type(b) is _devices.DeviceBuffer for b in buffers):
        return ()
    return tuple(b.device if type(b) is _devices.DeviceBuffer else HOST_DEVICE for b in buffers)


def device_records(data, count, kind, flags, mid) -> tuple:
    """The device records of a header message with ``FLAG_DEVICES``, checked against ``count``, this worker's
    devices (None: none known): a record for a device it lacks is an RpcMessageError (answered to the sender)."""
    records = _codec.unpack_devices(data)
    for device in records:
        if device != HOST_DEVICE and (count is None or device >= count):
            raise RpcMessageError(
                f"RPC message #{mid} carries a device array for device cuda:{device}, but this worker sees "
                f"{count or 0} device(s); fix the sender's device map (RpcBackendOptions.set_device_map)",
                kind=kind, flags=flags, mid=mid)
    return records


def place_buffers(buffers, records) -> list:
    """Receiving: each buffer whose device record names a device, wrapped in a DeviceBuffer (what :func:`loads`
    rebuilds the device array from)."""
    return [b if device == HOST_DEVICE else _devices.DeviceBuffer(b, device) for b, device in zip(buffers, records)]


def pack_header(kind, flags, mid, buffers, meta, forks, body, slot=0) -> bytes:
    """Build the header message bytes (see the module docstring); ``slot``: a request's reply slot."""
    meta_bytes = pickle.dumps(meta, protocol=5) if meta is not None else b""
    return _codec.pack_header(kind, flags, mid, [b.nbytes for b in buffers] if buffers else (), forks, meta_bytes,
                              body, buffer_devices(buffers) if buffers else (), slot)


def unpack_header(data) -> tuple:
    """Parse and check header message bytes: ``(kind, flags, mid, sizes, meta, forks, body, slot)``; nothing
    unpickled (``slot``: a request's reply slot).

    ``meta`` and ``body`` are views, still pickled (both walked by the codec: :func:`load_meta` and
    ``loads(body, ..., checked=True)`` unpickle them). Raises RpcMessageError (with the message's kind, flags and
    id when its header could be read, and its buffer sizes once they were checked).
    """
    kind, flags, mid, sizes, forks, meta, body, slot = _codec.unpack_header(data, MAX_MESSAGE_BYTES)
    return kind, flags, mid, sizes, meta, forks, body, slot


def load_meta(meta, kind, flags, mid):
    """Unpickle the metadata :func:`unpack_header` returned (None when there is none); RpcMessageError, with the
    message's kind, flags and id, when it does not load."""
    if not len(meta):
        return None
    try:
        return loads(meta, checked=True)
    except RpcMessageError as exc:
        raise RpcMessageError(f"malformed RPC message metadata: {exc}", kind=kind, flags=flags, mid=mid) from exc


def pack_batch(frames) -> bytes:
    """Several header messages as the body of one ``batch`` message."""
    return _codec.pack_batch(frames)


def split_batch(body) -> list:
    """The header messages of a ``batch`` body (RpcMessageError when a frame length overruns)."""
    return _codec.split_batch(body)
