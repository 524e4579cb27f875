"""Device transports: how a process group moves device arrays, chosen once per group when it is made.

MPI stays the control plane (sequence numbers, arrival, fingerprints, timeouts naming ranks, Join); a transport
moves the bytes of the four collectives device arrays meet most (allreduce, broadcast, allgather,
reduce_scatter). The other calls (alltoall, send/recv, objects) stay on :func:`~distlab.comm.device.mpi_buffer`.

Every transport implements :class:`~.base.Transport` (the interface the group calls: ``takes`` and the four
collectives, given the group's :class:`~distlab.comm.steps.GroupSteps`, never the group). Each rank posts its
placement (:func:`local_placement`: node, device identity, which peer devices it can reach,
whether NCCL and a CUDA-aware MPI are at hand, and its ``DISTLAB_DEVICE_COMM``), the group gathers them, and the
pure function :func:`choose` maps the table to one transport, the same on every rank:

================  =============================================================================================
``ipc``           every rank on one node, on one device or on devices that reach each other (peer access):
                  buffers every local rank maps (CUDA IPC on a GPU, POSIX shared memory on the stand-in);
                  :mod:`.ipc`.
``hierarchical``  otherwise, ranks on several nodes, as many on each, each on a device of its own with NCCL,
                  where every rank opts in (``DISTLAB_HIERARCHICAL_ALLREDUCE=1``, Horovod's
                  ``HOROVOD_HIERARCHICAL_ALLREDUCE``) or NCCL has no network between the nodes
                  (``DISTLAB_NCCL_NET=0``): allreduce by an NCCL reduce-scatter inside each node, host MPI across
                  the nodes, an NCCL all-gather; :mod:`.hierarchical`.
``nccl``          otherwise, when every rank has NCCL (``cupy.cuda.nccl``, or the stand-in's), no two ranks share
                  a device (NCCL before 2.30 refuses that: "Duplicate GPU detected") and NCCL reaches every node:
                  one NCCL communicator per group, bootstrapped over MPI; :mod:`.nccl`.
``mpi``           otherwise, when every rank's MPI is CUDA-aware (``MPIX_Query_cuda_support``): device pointers go
                  to MPI directly.
``staged``        the fallback: a pinned host arena, chunked and pipelined on copy streams; :mod:`.staged`.
``none``          no transport: the plain path (:func:`~distlab.comm.device.mpi_buffer`; a CUDA-aware MPI takes
                  the device pointer, else the array is staged through pageable host memory).
================  =============================================================================================

``auto`` chooses among them only for a device whose transport code has run on that kind of device: today the
stand-in (``distlab.fakegpu``, with its NCCL stand-in that reduces with MPI), on which CI runs every transport.
On a real GPU the IPC slots, the NCCL communicators, the pinned arena and the stream ordering have not run yet,
so ``auto`` keeps cupy arrays on the path a GPU run has shown to work (``none``: staged through host memory by
:func:`~distlab.comm.device.mpi_buffer`) until the device check proves them; ``DISTLAB_DEVICE_COMM=ipc``,
``nccl``, ``hierarchical`` or ``staged`` takes them on a GPU now. Ranks spanning nodes go through NCCL as a whole
(NCCL's own network transport), or through ``hierarchical`` on the opt-in or where NCCL has no network.

``DISTLAB_DEVICE_COMM=auto|ipc|nccl|hierarchical|staged|mpi|none`` overrides ``auto`` (``none`` keeps the plain
path anywhere: the baseline ``benchmarks/bench_gpu.py`` compares the transports with); every rank must set the
same word, and a transport the placement cannot serve is a ValueError on every rank that names the ranks in the
way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass

import numpy as np

from ..._env import choice
from ...autograd._array import device_array_types
from ..device import cuda_aware
from .base import Transport

__all__ = ["Transport", "Placement", "choose", "local_placement", "select", "DEVICE_COMM_VAR", "SETTINGS", "PLACEMENT_WORDS",
           "NCCL_NET_VAR", "HIERARCHICAL_VAR"]

DEVICE_COMM_VAR = "DISTLAB_DEVICE_COMM"
SETTINGS = ("auto", "ipc", "nccl", "hierarchical", "staged", "mpi", "none")
#: ``0``: NCCL has no network between nodes (no InfiniBand, sockets refused): it can serve only ranks of one node.
NCCL_NET_VAR = "DISTLAB_NCCL_NET"
#: ``1``: ``auto`` takes the hierarchical allreduce across nodes (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``).
HIERARCHICAL_VAR = "DISTLAB_HIERARCHICAL_ALLREDUCE"
PLACEMENT_WORDS = 10
#: NCCL from this version lets several ranks share one GPU; before it, ``ncclCommInitRank`` refuses them.
NCCL_SHARED_DEVICE_VERSION = 23000


@dataclass(frozen=True)
class Placement:
    """Where one rank's device is, and what it can use (one row of the table :func:`choose` reads).

    ``node`` is the group's node key; ``device`` identifies the physical device (a hash of the GPU's UUID; 0
    when the rank has no device); ``device_id`` its index on the node; ``peers`` a bit mask of the device
    indices it can reach by peer access; ``nccl`` the NCCL version code at hand (``get_version()``: 22809 for
    2.28.9; 0: no NCCL, a true value of unknown version counts as an old one); ``setting`` the rank's
    ``DISTLAB_DEVICE_COMM``; ``proven`` whether the transports have run on this kind of device (the stand-in: yes;
    a real GPU: not yet), which ``auto`` needs; ``nccl_net`` whether NCCL reaches other nodes (``DISTLAB_NCCL_NET``,
    default yes); ``hierarchical`` whether the rank opts in to the hierarchical allreduce across nodes
    (``DISTLAB_HIERARCHICAL_ALLREDUCE=1``).
    """

    node: int
    device: int = 0
    device_id: int = 0
    peers: int = 0
    nccl: int = 0
    cuda_aware: bool = False
    setting: str = "auto"
    proven: bool = True
    nccl_net: bool = True
    hierarchical: bool = False

    def row(self) -> np.ndarray:
        """The placement as ``PLACEMENT_WORDS`` int64 words (what the group gathers)."""
        return np.array([self.node, self.device, self.device_id, self.peers, self.nccl, self.cuda_aware,
                         SETTINGS.index(self.setting), self.proven, self.nccl_net, self.hierarchical], dtype=np.int64)

    @classmethod
    def from_row(cls, row) -> "Placement":
        words = [int(w) for w in row]
        return cls(words[0], words[1], words[2], words[3], words[4], bool(words[5]), SETTINGS[words[6]],
                   bool(words[7]), bool(words[8]), bool(words[9]))


def choose(placements: list[Placement]) -> tuple[str, str]:
    """``(transport, why)`` for a group whose ranks are placed as ``placements`` (pure: same table, same answer).

    Raises ValueError when the ranks asked for different transports, or for one their placement cannot serve.
    """
    settings = {p.setting for p in placements}
    if len(settings) > 1:
        by = {s: [k for k, p in enumerate(placements) if p.setting == s] for s in sorted(settings)}
        raise ValueError(f"{DEVICE_COMM_VAR} differs between ranks ({'; '.join(f'ranks {r}: {s}' for s, r in by.items())}); "
                         "every rank must set the same transport")
    setting = settings.pop()
    if setting == "nccl":
        why_not = _nccl_impossible(placements)
        if why_not:
            raise ValueError(f"{DEVICE_COMM_VAR}=nccl: {why_not}")
        return "nccl", f"{DEVICE_COMM_VAR}=nccl"
    if setting == "hierarchical":
        why_not = _hierarchical_impossible(placements)
        if why_not:
            raise ValueError(f"{DEVICE_COMM_VAR}=hierarchical: {why_not}")
        return "hierarchical", f"{DEVICE_COMM_VAR}=hierarchical"
    if setting == "staged":
        return "staged", f"{DEVICE_COMM_VAR}=staged"
    if setting == "none":
        return "none", f"{DEVICE_COMM_VAR}=none"
    if setting == "mpi":
        unaware = [k for k, p in enumerate(placements) if not p.cuda_aware]
        if unaware:
            raise ValueError(f"{DEVICE_COMM_VAR}=mpi: the MPI library of ranks {unaware} is not CUDA-aware "
                             "(MPIX_Query_cuda_support says no, or DISTLAB_CUDA_AWARE=0); handing it device pointers "
                             "would crash: use auto, ipc or staged")
        return "mpi", f"{DEVICE_COMM_VAR}=mpi"
    ipc, why_not = _ipc_possible(placements)
    if setting == "ipc":
        if not ipc:
            raise ValueError(f"{DEVICE_COMM_VAR}=ipc: {why_not}; use auto or staged")
        return "ipc", f"{DEVICE_COMM_VAR}=ipc"
    if not any(p.device for p in placements):
        return "none", "no rank had a device when the group was made"
    unproven = [k for k, p in enumerate(placements) if p.device and not p.proven]
    if unproven:
        return "none", (f"auto: the device transports have not run on the devices of ranks {unproven} yet; "
                        f"{DEVICE_COMM_VAR}=ipc, nccl or staged takes them")
    if len(placements) < 2:
        return "staged", "one rank"
    if ipc:
        return "ipc", "every rank on one node, its devices mapped by every rank"
    opted = [k for k, p in enumerate(placements) if p.hierarchical]
    if opted and len(opted) < len(placements):
        raise ValueError(f"{HIERARCHICAL_VAR} differs between ranks (ranks {opted} set it, the others not); every "
                         "rank must set the same")
    no_net = [k for k, p in enumerate(placements) if not p.nccl_net]
    if len({p.node for p in placements}) > 1 and (opted or no_net) \
            and not _hierarchical_impossible(placements, shared_ok=False):
        return "hierarchical", (f"the ranks span nodes, each with its own device and NCCL, and "
                                f"{f'{HIERARCHICAL_VAR}=1' if opted else f'ranks {no_net} have no NCCL network'}")
    if not _nccl_impossible(placements, shared_ok=False):
        return "nccl", f"every rank has NCCL and a device of its own ({why_not})"
    if all(p.cuda_aware for p in placements):
        return "mpi", "every rank's MPI is CUDA-aware"
    return "staged", why_not


def _ipc_possible(placements: list[Placement]) -> tuple[bool, str]:
    """Whether every rank can map every other rank's device buffers, and if not, why not (naming ranks)."""
    bare = [k for k, p in enumerate(placements) if not p.device]
    if bare:
        return False, f"ranks {bare} have no device"
    nodes = sorted({p.node for p in placements})
    if len(nodes) > 1:
        return False, f"the ranks span {len(nodes)} nodes"
    for a, pa in enumerate(placements):
        for b, pb in enumerate(placements):
            if pa.device != pb.device and not pa.peers >> pb.device_id & 1:
                return False, f"rank {a}'s device cannot reach rank {b}'s (no peer access)"
    return True, ""


def _nccl_impossible(placements: list[Placement], shared_ok: bool = True, across: bool = True) -> str:
    """Why NCCL cannot serve the group (naming ranks), or "" when it can; ``shared_ok``: whether ranks may share a
    device when every rank's NCCL allows it (asked for explicitly; ``auto`` leaves such ranks to ipc); ``across``:
    whether one NCCL communicator must span the nodes (the hierarchical allreduce keeps NCCL inside each)."""
    bare = [k for k, p in enumerate(placements) if not p.device]
    if bare:
        return f"ranks {bare} have no device; use auto or staged"
    lacking = [k for k, p in enumerate(placements) if not p.nccl]
    if lacking:
        return (f"ranks {lacking} have no NCCL (cupy.cuda.nccl did not load libnccl: install the nvidia-nccl wheel "
                "of your CUDA, see the cuda extra); use auto, ipc or staged")
    by_device: dict[int, list[int]] = {}
    for k, p in enumerate(placements):
        by_device.setdefault(p.device, []).append(k)
    shared = [ranks for ranks in by_device.values() if len(ranks) > 1]
    old = [k for ranks in shared for k in ranks if placements[k].nccl < NCCL_SHARED_DEVICE_VERSION]
    if old or shared and not shared_ok:
        return (f"ranks {', '.join(str(r) for r in shared)} share one device, which NCCL before 2.30 refuses "
                "(\"Duplicate GPU detected\"); use auto or ipc, which serves ranks sharing a device")
    no_net = [k for k, p in enumerate(placements) if not p.nccl_net]
    nodes = len({p.node for p in placements})
    if across and nodes > 1 and no_net:
        return (f"the ranks span {nodes} nodes and NCCL has no network between them on ranks {no_net} "
                f"({NCCL_NET_VAR}=0); use hierarchical (NCCL inside each node, host MPI across) or staged")
    return ""


def _hierarchical_impossible(placements: list[Placement], shared_ok: bool = True) -> str:
    """Why the hierarchical allreduce cannot serve the group (naming ranks and nodes), or "" when it can: NCCL
    inside every node, and every node holding as many ranks (Horovod's homogeneity)."""
    why_not = _nccl_impossible(placements, shared_ok, across=False)
    if why_not:
        return why_not
    by_node: dict[int, list[int]] = {}
    for k, p in enumerate(placements):
        by_node.setdefault(p.node, []).append(k)
    if len({len(ranks) for ranks in by_node.values()}) > 1:
        return ("every node must hold as many ranks, and they differ: "
                + "; ".join(f"node {node}: ranks {ranks}" for node, ranks in sorted(by_node.items()))
                + "; use nccl or staged")
    return ""


def reducer_mode(placements: list[Placement]) -> str:
    """``"leader"`` when every rank shares one device (one rank reduces: ranks taking turns on one GPU must
    never spin on each other), else ``"split"`` (each rank reduces its block of the buffer)."""
    return "leader" if len({p.device for p in placements}) == 1 else "split"


def _device_module():
    """The device array module this process uses: a registered stand-in, else cupy when installed; or None."""
    modules = list(dict.fromkeys(device_array_types().values()))
    if modules:
        return modules[0]
    if "cupy" in sys.modules or importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy
        except Exception:  # noqa: BLE001 - a cupy without a driver or device: no device here
            return None
    return None


def local_placement(node: int, setting: str | None = None) -> Placement:
    """This rank's placement on ``node`` (``setting``: default ``DISTLAB_DEVICE_COMM``)."""
    setting = choice(DEVICE_COMM_VAR, "auto", SETTINGS) if setting is None else setting
    aware = cuda_aware()
    xp = _device_module()
    if xp is None:
        return Placement(node, cuda_aware=aware, setting=setting)
    runtime = xp.cuda.runtime
    device_id = runtime.getDevice()
    count = runtime.getDeviceCount()
    properties = getattr(runtime, "getDeviceProperties", None)
    uuid = bytes((properties(device_id) if properties else {}).get("uuid", b"") or b"")
    ident = uuid or f"{xp.__name__}:{node}:{device_id}".encode()
    device = int.from_bytes(hashlib.blake2b(ident, digest_size=7).digest(), "little") | 1
    can = getattr(runtime, "deviceCanAccessPeer", None)
    peers = sum(1 << k for k in range(min(count, 62)) if k != device_id and can and can(device_id, k))
    nccl = _nccl_version(xp)
    return Placement(node, device, device_id, peers, nccl, aware, setting, xp.__name__ != "cupy",
                     choice(NCCL_NET_VAR, "1", ("0", "1")) == "1", choice(HIERARCHICAL_VAR, "0", ("0", "1")) == "1")


def _nccl_version(xp) -> int:
    """The NCCL version code this rank's device module has (0: none, or a library that does not load)."""
    from .nccl import nccl_module

    module = nccl_module(xp)
    if module is None:
        return 0
    try:
        return max(int(module.get_version()), 1)
    except Exception:  # noqa: BLE001 - a cupy whose libnccl fails to answer: no NCCL here
        return 0


def select(steps, wait):
    """Collective: gather the placements of the ranks of the group whose :class:`~distlab.comm.steps.GroupSteps`
    ``steps`` is, and return its transport (None: ``mpi``, the plain path) made with those steps, the name shown in
    the group's repr, and why it was chosen; ``wait(request, what)`` completes a request under the set-up
    deadline."""
    mine = local_placement(int(steps.node_keys[steps.rank])).row()
    table = np.empty((steps.size, PLACEMENT_WORDS), dtype=np.int64)
    wait(steps.comm.Iallgather(mine, table), "device placements")
    placements = [Placement.from_row(row) for row in table]
    name, why = choose(placements)
    if name == "ipc":
        from .ipc import IpcTransport

        return IpcTransport(steps, reducer_mode(placements), _device_module()), name, why
    if name == "staged":
        from .staged import StagedTransport

        return StagedTransport(steps), name, why
    if name == "nccl":
        from .nccl import NcclTransport

        return NcclTransport(steps, _device_module(), wait), name, why
    if name == "hierarchical":
        from .hierarchical import HierarchicalTransport

        return HierarchicalTransport(steps, _device_module(), wait), name, why
    return None, name, why
