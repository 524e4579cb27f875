"""Device arrays over RPC: device maps, their checks, and how a device array travels (shared plumbing, not twinned).

Mirrors PyTorch's CUDA RPC (TensorPipe agent):

- :class:`RpcBackendOptions` mirrors ``torch.distributed.rpc.TensorPipeRpcBackendOptions``: ``device_maps`` (and
  ``set_device_map(to, device_map)``) says, per callee, where this worker's device arrays land there
  (``{0: 1}``: an array on this worker's device 0 arrives on the callee's device 1); ``devices`` lists the
  devices this worker's agent uses. A map must be one-to-one (``options.py`` ``_to_device_map``).
- :func:`check_device_maps` mirrors ``backend_registry._validate_device_maps``: at ``init_rpc`` every worker
  learns every worker's maps, devices and device count, and every worker raises the same ValueError
  (:class:`~distlab.errors.RpcDeviceError`) for a map that names an unknown worker, a device a worker lacks, or
  devices outside a worker's ``devices``.
- :class:`Placement` mirrors ``tensorpipe_agent.cpp`` ``getDevicesForRemote``: a request follows the caller's
  map to the callee, a response the inverse of the caller's map (the *reverse map*), so a result comes back to
  the device its arguments came from. A device array that no map covers is refused on the sender, with what
  to set.

A device array travels as an out-of-band buffer (pickle protocol 5, like a numpy array): the sender waits for
its stream and copies it to host memory (no PyPI MPI is CUDA-aware), the header's device record (wire flag
``RPC_FLAG_DEVICES``) names the device it lands on, and the receiver rebuilds it there (``cupy.cuda.Device(n)``).
The kinds of device array are those :func:`distlab.autograd.register_device_array` knows (a stand-in registers on
import) and cupy's once the program imported cupy (distlab never imports a GPU stack on its own).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from distlab._wire import RPC_HOST_DEVICE
from distlab.autograd._array import device_array_types
from distlab.errors import RpcDeviceError

__all__ = ["RpcBackendOptions", "DeviceKind", "device_kinds", "kind_named",
           "to_device", "to_device_map", "local_device_count", "check_device_maps", "reverse_device_maps",
           "Placement", "DeviceBuffer", "rebuild_device_array", "exchange"]


def to_device(device) -> int:
    """A device index from ``1``, ``"cuda:1"``, or a device object with an ``id`` (``cupy.cuda.Device(1)``).

    ValueError for anything else (``"cpu"`` included: a map moves device arrays between devices).
    """
    if isinstance(device, bool):
        raise ValueError(f"a device is an index, 'cuda:N' or a device object, got {device!r}")
    if isinstance(device, (int, np.integer)) and device >= 0:
        return int(device)
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    ident = getattr(device, "id", None)
    if isinstance(ident, int) and not isinstance(device, (str, int)) and ident >= 0:
        return ident
    raise ValueError(f"device maps take CUDA devices (an index, 'cuda:N' or cupy.cuda.Device(N)), got {device!r}")


def _name(index: int) -> str:
    return f"cuda:{index}"


def to_device_map(device_map) -> dict:
    """``{this worker's device: the callee's device}`` as indices; one-to-one (mirrors options.py
    ``_to_device_map``), else ValueError."""
    if not isinstance(device_map, dict):
        raise ValueError(f"a device map is a dict {{local device: remote device}}, got {type(device_map).__name__}")
    full, reverse = {}, {}
    for key, value in device_map.items():
        k, v = to_device(key), to_device(value)
        if v in reverse and reverse[v] != k:
            raise RpcDeviceError(f"`device_map` only supports 1-to-1 mapping, trying to map {_name(k)} and "
                                 f"{_name(reverse[v])} to {_name(v)}")
        full[k] = v
        reverse[v] = k
    return full


class RpcBackendOptions:
    """The options of :func:`distlab.rpc.init_rpc` (mirrors ``TensorPipeRpcBackendOptions``).

    Parameters
    ----------
    num_worker_threads : int, optional
        Threads running the requests this worker receives (``init_rpc``'s ``num_threads`` when None).
    rpc_timeout : float, optional
        The default timeout of every RPC, in seconds (``init_rpc``'s ``rpc_timeout`` when None).
    device_maps : dict, optional
        ``{callee name: {this worker's device: callee's device}}``; devices are indices, ``"cuda:N"`` or
        ``cupy.cuda.Device(N)``. Each map must be one-to-one.
    devices : list, optional
        The devices this worker's agent uses; when given, every source device of this worker's maps and every
        target device of the maps to it must be among them. By default: the devices its maps and the maps to it
        name.
    """

    def __init__(self, *, num_worker_threads=None, rpc_timeout=None, device_maps=None, devices=None):
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.device_maps: dict = {}
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        self.devices: list = []
        if devices is not None:
            self.set_devices(devices)

    def set_device_map(self, to: str, device_map) -> None:
        """Add ``device_map`` (``{this worker's device: callee's device}``) for callee ``to``; may be called
        again for the same callee, but a device already mapped elsewhere is a ValueError (mirrors
        ``TensorPipeRpcBackendOptions.set_device_map``)."""
        if not isinstance(to, str) or not to:
            raise ValueError(f"set_device_map: the callee is a worker name, got {to!r}")
        full = to_device_map(device_map)
        current = self.device_maps.get(to, {})
        for k, v in full.items():
            if k in current and current[k] != v:
                raise RpcDeviceError(f"`set_device_map` only supports 1-to-1 mapping, trying to map {_name(k)} "
                                     f"to {_name(v)} and {_name(current[k])}")
        self.device_maps[to] = to_device_map({**current, **full})

    def set_devices(self, devices) -> None:
        """The devices this worker's agent uses (mirrors ``TensorPipeRpcBackendOptions.set_devices``)."""
        self.devices = [to_device(d) for d in devices]

    def __repr__(self) -> str:
        return (f"RpcBackendOptions(num_worker_threads={self.num_worker_threads}, rpc_timeout={self.rpc_timeout}, "
                f"device_maps={self.device_maps}, devices={self.devices})")


# -- kinds of device array --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceKind:
    """One kind of device array RPC can carry: an array type and its cupy-like array module.

    Attributes
    ----------
    name : str
        The module's name; travels with the array, so the receiver rebuilds the same kind (``"cupy"``).
    type : type
        The array type (matched exactly when pickling).
    module : module
        ``cupy``, or a stand-in with cupy's API (``distlab.fakegpu``): ``asnumpy``, ``asarray``,
        ``cuda.Device(n)``, ``cuda.runtime.getDeviceCount()``; an array's ``device.id`` is its device.
    """

    name: str
    type: type
    module: Any

    def device_of(self, array) -> int:
        return array.device.id

    def to_host(self, array) -> np.ndarray:
        """A host copy, once the array's stream is done (``asnumpy`` on the current stream)."""
        return self.module.asnumpy(array)

    def from_host(self, host, device: int):
        """A new array on ``device`` holding ``host``."""
        with self.module.cuda.Device(device):
            return self.module.asarray(host)

    def device_count(self) -> int:
        try:
            return int(self.module.cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001 - cupy without a driver or a device: none
            return 0


_REGISTERED = device_array_types()  # a live, read-only view: its length grows as device array types register
_kinds_cache: list = [None, []]  # [(registered types, cupy imported), the kinds]: dumps asks for every message


def device_kinds() -> list:
    """The kinds of device array this process knows: those registered with
    :func:`distlab.autograd.register_device_array` (the stand-in on import), and cupy's once cupy is imported."""
    cupy = sys.modules.get("cupy")
    key = (len(_REGISTERED), cupy is not None)  # _REGISTERED: device_array_types()'s live view, read per message
    if key == _kinds_cache[0]:
        return _kinds_cache[1]
    registered = device_array_types()
    found = {module.__name__: DeviceKind(module.__name__, array_type, module)
             for array_type, module in list(registered.items())}
    if cupy is not None and "cupy" not in found:
        found["cupy"] = DeviceKind("cupy", cupy.ndarray, cupy)
    _kinds_cache[:] = [key, list(found.values())]
    return _kinds_cache[1]


def kind_named(name: str) -> DeviceKind:
    """The kind a received array names (cupy is imported here if the program has not yet)."""
    if name == "cupy" and "cupy" not in sys.modules:
        import cupy  # noqa: F401 - device_kinds() finds it now
    for kind in device_kinds():
        if kind.name == name:
            return kind
    raise RpcDeviceError(f"received a device array of kind {name!r}, which this worker cannot rebuild "
                         f"(it knows {[k.name for k in device_kinds()] or 'none'})")


def local_device_count(probe_cupy: bool = False) -> int | None:
    """The devices this process sees: the most any registered kind sees; None when no kind is registered (and
    ``probe_cupy`` is False, or cupy is not installed)."""
    kinds = device_kinds()
    if not kinds and probe_cupy:
        try:
            import cupy  # noqa: F401 - registers cupy's kind through device_kinds()
        except ImportError:
            return 0
        kinds = device_kinds()
    return max((k.device_count() for k in kinds), default=None)


# -- checks at init_rpc ------------------------------------------------------------------------------------------
def check_device_maps(names, counts, maps, devices) -> None:
    """Raise RpcDeviceError unless every worker's device maps and devices are consistent (mirrors
    backend_registry._validate_device_maps). Every argument but ``names`` is a dict keyed by worker name."""
    for node in names:
        if len(set(devices[node])) != len(devices[node]):
            raise RpcDeviceError(f"worker {node!r} has duplicated devices: devices = {devices[node]}")
        bad = [d for d in devices[node] if d >= counts[node]]
        if bad:
            raise RpcDeviceError(f"worker {node!r} lists devices it lacks: devices = {devices[node]}, but it sees "
                                 f"{counts[node]} device(s)")
    for source in names:
        unknown = sorted(set(maps[source]) - set(names))
        if unknown:
            raise RpcDeviceError(f"worker {source!r} has device maps for unknown workers {unknown}; the workers "
                                 f"are {list(names)}")
        for target, device_map in maps[source].items():
            if len(set(device_map.values())) != len(device_map):
                raise RpcDeviceError(f"worker {source!r} maps two devices to one in its device map for "
                                     f"{target!r}: {device_map}")
            for side, node, wanted in (("source", source, device_map.keys()), ("target", target,
                                                                                  device_map.values())):
                if devices[node]:
                    extra = sorted(set(wanted) - set(devices[node]))
                    if extra:
                        raise RpcDeviceError(
                            f"worker {source!r} has {side} devices {[_name(d) for d in extra]} in its device map "
                            f"for {target!r} that are not among worker {node!r}'s devices {devices[node]}: "
                            f"device map = {device_map}")
                else:
                    extra = sorted(d for d in wanted if d >= counts[node])
                    if extra:
                        raise RpcDeviceError(
                            f"worker {source!r} has {side} devices {[_name(d) for d in extra]} in its device map "
                            f"for {target!r}, but worker {node!r} sees {counts[node]} device(s): "
                            f"device map = {device_map}")


def reverse_device_maps(me: str, names, maps) -> dict:
    """``{caller: {my device: caller's device}}``: the inverse of each caller's map to ``me`` (what its
    responses follow; mirrors backend_registry._create_reverse_mapping)."""
    return {node: {v: k for k, v in maps[node][me].items()} for node in names if me in maps[node]}


# -- sending and receiving ---------------------------------------------------------------------------------------
class Placement:
    """Where this worker's device arrays land on each peer.

    Parameters
    ----------
    me : str
        This worker's name.
    names : list of str
        Every worker's name, by id.
    own : dict
        This worker's maps, ``{callee name: {my device: callee device}}``.
    reverse : dict
        :func:`reverse_device_maps` for this worker.
    """

    def __init__(self, me: str, names, own: dict, reverse: dict):
        self.me = me
        self.names = list(names)
        self._own = [own.get(n) for n in self.names]
        self._reverse = [reverse.get(n) for n in self.names]

    def for_peer(self, dst: int, mode: str = "request"):
        """The map an array follows to worker ``dst``: ``"request"`` this worker's own map (a call),
        ``"reply"`` the reverse map (a response), ``"either"`` the own map, else the reverse one (gradients of
        distributed autograd, which flow both ways). Returns ``(device_map or None, mode)``."""
        if mode == "request":
            return self._own[dst], mode
        if mode == "reply":
            return self._reverse[dst], mode
        own = self._own[dst]
        return (own, "request") if own is not None else (self._reverse[dst], "reply")

    def target(self, dst: int, mode: str, device: int) -> int:
        """The device an array on this worker's ``device`` lands on at ``dst``; RpcDeviceError (what to set)
        when no map covers it (mirrors tensorpipe_utils getDevicesForTensors)."""
        device_map, mode = self.for_peer(dst, mode)
        if device_map is not None and device in device_map:
            return device_map[device]
        peer = self.names[dst]
        if mode == "reply":
            setting = (f"worker {peer!r} set no device map for worker {self.me!r}" if device_map is None else
                       f"worker {peer!r}'s device map for worker {self.me!r} ({device_map}, inverted here) has "
                       f"no {_name(device)}")
            raise RpcDeviceError(
                f"a device array on device {_name(device)} is sent back to worker {peer!r} (a response follows "
                f"the inverse of the caller's device map), but {setting}: return host arrays (.get()), or set "
                f"it on worker {peer!r}: RpcBackendOptions.set_device_map({self.me!r}, {{...: {device}}})")
        setting = ("no device map is set for worker" if device_map is None else
                   f"the device map for worker {peer!r} ({device_map}) has no {_name(device)}; see worker")
        raise RpcDeviceError(
            f"a device array is on device {_name(device)} but {setting} {peer!r}: move it to the host (.get()) "
            f"before sending it over RPC, or call RpcBackendOptions.set_device_map({peer!r}, {{{device}: N}}) "
            f"(init_rpc(..., rpc_backend_options=...)) to say which of {peer!r}'s devices it lands on")


class DeviceBuffer:
    """An out-of-band buffer of a device array: its bytes (host memory) and a device index. Sending, the device
    it lands on at the receiver (the header's device record); received, the device that record names (what
    :func:`rebuild_device_array` gets from the unpickler)."""

    __slots__ = ("data", "device", "nbytes")

    def __init__(self, data, device: int):
        self.data = data
        self.device = device
        self.nbytes = memoryview(data).nbytes


def rebuild_device_array(kind_name: str, buffer, dtype: str, shape: tuple):
    """Unpickle side of a device array: a new array of that kind on the device the header names."""
    if not isinstance(buffer, DeviceBuffer) or buffer.device == RPC_HOST_DEVICE:
        raise RpcDeviceError("a device array arrived without its device record (it must travel out of band)")
    host = np.frombuffer(buffer.data, dtype=np.dtype(dtype)).reshape(shape)
    return kind_named(kind_name).from_host(host, buffer.device)


def exchange(comm, me: str, names, options) -> tuple:
    """``init_rpc``'s device step, collective over the agent's communicator: gather every worker's device maps,
    devices and device count, check them (the same RpcDeviceError on every worker), and return ``(placement,
    device_count)`` for this worker. Costs one allgather when no worker sets a map (cupy is then not probed)."""
    own = dict(options.device_maps) if options is not None else {}
    mine = list(options.devices) if options is not None else []
    gathered = comm.allgather((own, mine, local_device_count(probe_cupy=bool(own or mine))))
    maps = {n: g[0] for n, g in zip(names, gathered)}
    devices = {n: g[1] for n, g in zip(names, gathered)}
    counts = {n: g[2] for n, g in zip(names, gathered)}
    if any(maps.values()) or any(devices.values()):
        if any(c is None for c in counts.values()):  # the same on every worker: they all gather again
            counts = dict(zip(names, comm.allgather(local_device_count(probe_cupy=True))))
        check_device_maps(names, counts, maps, devices)
    return Placement(me, names, own, reverse_device_maps(me, names, maps)), counts[me]
