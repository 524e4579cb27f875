"""The arrival board: where each rank of a group posts the last collective it entered, for its node to read.

Each rank writes ``[seq, op code]`` into its own slot when it enters a collective: two stores into memory shared
by the ranks of its node, the only cost the side channel adds to a collective. When a wait times out, the waiting
rank reads its node peers' slots with plain loads, which works while those peers compute outside MPI (an RMA
``Get`` would need their MPI progress). Ranks on other nodes are asked through :mod:`distlab.comm.missing`.

The board is a small file in ``/dev/shm`` mapped by the ranks of one node, not an MPI window: freeing an MPI
window is collective (``MPI_Win_free`` waits for every rank of the node), so a group dropped by one rank, or
destroyed while a peer is gone, would hang; unmapping a file is local. The node's first rank creates the file
and unlinks it as soon as every rank has mapped it, so nothing is left behind when the job ends, however it ends.

Which ranks share a node is MPI's call (``MPI_Comm_split_type(COMM_TYPE_SHARED)``), asked once per group built
from a raw communicator; a sub-group made by ``new_group`` inherits it from its parent. Set-up exchanges go
through nonblocking collectives polled like every other wait (a blocking MPI call busy-waits and starves an
oversubscribed peer).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import tempfile

import numpy as np
from mpi4py import MPI

from .._wire import COMM_SLOT_WORDS

__all__ = ["ArrivalBoard", "node_keys", "map_node_file", "RANKS_PER_NODE_VAR", "machine_id", "core_mask",
           "machine_oversubscribed"]

#: Test switch: pretend every ``N`` consecutive world ranks form a node of their own (each fake node gets its own
#: board), so the side channel between nodes can be exercised on one host. Unset: MPI's notion of a node.
RANKS_PER_NODE_VAR = "DISTLAB_RANKS_PER_NODE"
_SLOT_BYTES = 8 * COMM_SLOT_WORDS
MASK_WORDS = 64  # core masks cover cores 0 to 4095
_PATH_BYTES = 256


def node_keys(comm, wait) -> tuple[np.ndarray, bool]:
    """``(node key of every rank of comm, whether this rank's machine is oversubscribed)``; collective.

    A node's key is the smallest world rank on it. ``wait(request, what)`` completes a nonblocking request
    under the set-up deadline. Oversubscription is a property of the machine, not of MPI's node: the hosts of
    a virtual cluster (network namespaces) are nodes to MPI but share one kernel's cores, so every rank also
    posts its machine (the kernel's boot id) and the cores it may run on (:func:`machine_oversubscribed`).
    """
    real = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        world_ranks = _world_ranks(real)
    finally:
        real.Free()
    per_node = _simulated_ranks_per_node()
    mine = MPI.COMM_WORLD.Get_rank() // per_node * per_node if per_node else min(world_ranks)
    row = np.concatenate([np.array([mine, machine_id()], dtype=np.int64), core_mask()])
    table = np.empty((comm.Get_size(), row.size), dtype=np.int64)
    wait(comm.Iallgather(row, table), "node keys")
    return table[:, 0].copy(), machine_oversubscribed(table[:, 1], table[:, 2:], comm.Get_rank())


def machine_id() -> int:
    """This machine as a number: a hash of the running kernel's boot id (the host name where there is none).

    Network namespaces, containers and virtual-cluster hosts on one kernel share its boot id, and its cores.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            identity = f.read().strip()
    except OSError:
        identity = socket.gethostname().encode()
    return int.from_bytes(hashlib.blake2b(identity, digest_size=8).digest(), "little") >> 1


def core_mask(cores=None) -> np.ndarray:
    """``cores`` (default: those this process may run on) as a bit mask of ``MASK_WORDS`` 64-bit words (cores 0
    to 4095)."""
    if cores is None:
        try:
            cores = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            cores = range(os.cpu_count() or 1)
    bits = np.zeros(MASK_WORDS * 64, dtype=bool)
    bits[[core for core in cores if core < bits.size]] = True
    return np.packbits(bits, bitorder="little").view(np.int64)


def machine_oversubscribed(machines: np.ndarray, masks: np.ndarray, rank: int) -> bool:
    """Whether more ranks run on ``rank``'s machine than the cores they may use together.

    ``machines``: every rank's :func:`machine_id`; ``masks``: every rank's :func:`core_mask`, one row each.
    Two ranks pinned to a core each are not oversubscribed; four ranks on two shared cores are.
    """
    same = machines == machines[rank]
    cores = np.bitwise_or.reduce(masks[same], axis=0)
    return int(same.sum()) > int(np.unpackbits(cores.view(np.uint8)).sum())


class ArrivalBoard:
    """This rank's slot and its node peers' slots, for the ranks of ``comm``.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The group's communicator (collective: every rank of it constructs its board together).
    keys : numpy.ndarray
        The node key of every rank of ``comm`` (:func:`node_keys`, or the parent group's for a sub-group).
    wait : callable
        ``wait(request, what)``: completes a nonblocking request under the set-up deadline.

    Attributes
    ----------
    my_slot : memoryview
        This rank's two int64 words ``[last seq entered, op code]`` (item stores are cheap).
    readable : dict
        Group rank -> numpy view of that rank's slot, for every rank whose slot this rank can read (its node).
    """

    def __init__(self, comm, keys: np.ndarray, wait):
        me = comm.Get_rank()
        node = [int(rank) for rank in np.flatnonzero(keys == keys[me])]  # group ranks on this node, in order
        nbytes = _SLOT_BYTES * len(node)

        def all_gather(mine: np.ndarray, what: str) -> np.ndarray:
            table = np.empty((comm.Get_size(),) + mine.shape, dtype=mine.dtype)
            wait(comm.Iallgather(mine, table), what)
            return table

        memory, mapped = map_node_file(all_gather, node[0] == me, node[0], nbytes, "board")
        shared = memory is not None
        if not shared:  # no shared file (full /dev/shm, another mount namespace): the side channel asks for us
            memory = mmap.mmap(-1, nbytes)
        index = node.index(me)
        self.my_slot = memoryview(memory)[index * _SLOT_BYTES:(index + 1) * _SLOT_BYTES].cast("q")
        self.readable: dict[int, np.ndarray] = {}
        for index, rank in enumerate(node):
            if rank == me or (shared and mapped[rank]):
                self.readable[rank] = np.frombuffer(memory, np.int64, COMM_SLOT_WORDS, index * _SLOT_BYTES)

    def snapshot(self) -> list[tuple[int, int, int]]:
        """``(group rank, last seq entered, op code)`` for every readable rank, in rank order."""
        return [(rank, int(slot[0]), int(slot[1])) for rank, slot in sorted(self.readable.items())]


def _world_ranks(comm) -> list[int]:
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, None, world)]
    finally:
        group.Free()
        world.Free()


def _simulated_ranks_per_node() -> int:
    value = os.environ.get(RANKS_PER_NODE_VAR, "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_NODE_VAR}={value!r}: expected a positive number of ranks per node")
    return int(value)


def map_node_file(all_gather, leader: bool, leader_rank: int, nbytes: int, kind: str, reserve: bool = False):
    """Map one file of ``nbytes`` on every rank of a node: ``(mmap or None, whether each rank mapped it)``.

    Collective over the ranks ``all_gather(array, what)`` gathers from (it returns the table, one row per rank).
    The ``leader`` creates the file; everyone maps it; the leader unlinks it once every rank has, so nothing is
    left behind however the job ends. ``reserve`` allocates the file's pages now: tmpfs pages are otherwise
    allocated on first touch, and a full ``/dev/shm`` would then kill the toucher with SIGBUS instead of
    failing here.
    """
    path = _create(nbytes, kind, reserve) if leader else None
    mine = np.zeros(_PATH_BYTES, dtype=np.uint8)
    if path:
        encoded = path.encode()
        mine[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    paths = all_gather(mine, f"{kind} files")
    leader_path = paths[leader_rank].tobytes().rstrip(b"\0").decode()
    memory = _attach(leader_path, nbytes) if leader_path else None
    mapped = all_gather(np.array([memory is not None], dtype=np.int8), f"{kind} mapping")[:, 0]  # all mapped now
    if path:
        os.unlink(path)
    return memory, mapped


def _create(nbytes: int, kind: str, reserve: bool) -> str | None:
    """Create a zero-filled file of ``nbytes`` in ``/dev/shm``; its path, or None when none can be made."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(folder, f"distlab-{kind}-{os.getpid()}-{secrets.token_hex(6)}")
    if len(path.encode()) > _PATH_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def _attach(path: str, nbytes: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, nbytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
