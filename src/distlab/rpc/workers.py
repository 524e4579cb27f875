"""The RPC agent's workers: names and ids, the registry that resolves them, and the MPI thread-level check.

Shared plumbing of :mod:`distlab.rpc` (not twinned). A worker's id is its rank in the agent's communicator.
"""
from __future__ import annotations

import time
from typing import NamedTuple

from distlab._wire import RPC_TAG_HELLO, RREF_WORKER_ID_BITS
from distlab.errors import DistTimeoutError, RpcThreadLevelError

__all__ = ["WorkerInfo", "WorkerRegistry", "check_thread_level", "check_name", "join_workers", "MAX_WORKERS"]

#: Worker ids are RRef ``created_on`` ids too (``distlab._wire.RREF_WORKER_ID_BITS``).
MAX_WORKERS = 1 << RREF_WORKER_ID_BITS


class WorkerInfo(NamedTuple):
    """A worker's name and id (its rank in the RPC communicator)."""

    name: str
    id: int


def check_thread_level() -> None:
    """Raise RpcThreadLevelError unless MPI runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        raise RpcThreadLevelError(
            "distlab.rpc needs MPI_THREAD_MULTIPLE (its listener thread calls MPI while other threads send), "
            f"but MPI was initialized with {names.get(level, level)}; do not lower mpi4py.rc.thread_level "
            "(or MPI4PY_RC_THREAD_LEVEL), or use an MPI library built with thread support")


def check_name(name) -> str:
    """A worker name must be a non-empty string (ValueError otherwise)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"worker name must be a non-empty string, got {name!r}")
    return name


class WorkerRegistry:
    """Every worker's :class:`WorkerInfo`, by id and by name.

    Parameters
    ----------
    names : list of str
        The name of each worker, indexed by id (what every worker announced at ``init_rpc``).
    rank : int
        This worker's id.
    """

    def __init__(self, names: list, rank: int):
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"worker names must be unique; {dup} used by ranks "
                             f"{[i for i, n in enumerate(names) if n in dup]}")
        self.workers = [WorkerInfo(n, i) for i, n in enumerate(names)]
        self.size = len(self.workers)
        self.info = self.workers[rank]
        self._by_name = {w.name: w for w in self.workers}

    def resolve(self, to=None) -> WorkerInfo:
        """Resolve a worker name, id or WorkerInfo (None: this worker); ValueError for an unknown worker."""
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            try:
                return self._by_name[to]
            except KeyError:
                raise ValueError(f"unknown worker name {to!r}; workers are {sorted(self._by_name)}") from None
        if isinstance(to, int) and 0 <= to < self.size:
            return self.workers[to]
        raise ValueError(f"unknown worker {to!r}; workers are ids 0..{self.size - 1} or names "
                         f"{sorted(self._by_name)}")

    def id_of(self, to) -> int:
        """The id of ``to`` (a plain id in range is returned as is: the per-message fast path)."""
        return to if type(to) is int and 0 <= to < self.size else self.resolve(to).id

    def name_of(self, worker_id: int) -> str:
        """The name of worker ``worker_id``."""
        return self.workers[worker_id].name


def join_workers(world, name: str, timeout: float):
    """Make the agent's communicator (a duplicate of ``world``) and learn every worker's name, bounded.

    Collective over ``world``. Each worker first sends its name to every other worker (tag ``RPC_TAG_HELLO`` on
    ``world``), then starts a non-blocking ``MPI_Comm_idup``; both are polled with back-off until every name
    has arrived and the duplicate is made. After ``timeout`` seconds it raises DistTimeoutError naming the ranks
    whose name never came: the ones that have not called ``init_rpc``. Returns ``(comm, names)``.
    """
    from mpi4py import MPI

    rank, size = world.Get_rank(), world.Get_size()
    if size > MAX_WORKERS:
        raise ValueError(f"distlab.rpc supports at most {MAX_WORKERS} workers, the world has {size} ranks")
    hello = name.encode("utf-8")
    sends = [world.Isend([hello, MPI.BYTE], dst, RPC_TAG_HELLO) for dst in range(size) if dst != rank]
    comm, dup = world.Idup()
    names: dict[int, str] = {rank: name}
    status = MPI.Status()
    deadline = time.monotonic() + timeout
    delay = 1e-4
    dup_done = False
    while True:
        # One hello per missing rank only: a fast peer's hello for its next init_rpc stays queued for that one.
        for src in [r for r in range(size) if r not in names]:
            message = world.Improbe(src, RPC_TAG_HELLO, status)
            if message is not None:
                data = bytearray(status.Get_count(MPI.BYTE))
                message.Recv([data, MPI.BYTE])
                names[src] = data.decode("utf-8", errors="replace")
        dup_done = dup_done or dup.Test()
        if dup_done and len(names) == size:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(size)) - set(names))
            for request in sends:  # unreceived hellos: the job is failing, leave nothing pending
                request.Cancel()
            raise DistTimeoutError(
                f"init_rpc on worker {name!r} (rank {rank}): ranks {missing} did not call init_rpc within "
                f"{timeout:g} s (every rank of the job must call it; raise the timeout with init_rpc(timeout=...) "
                f"or DISTLAB_TIMEOUT)" if missing else
                f"init_rpc on worker {name!r} (rank {rank}): every rank called init_rpc but the agent's "
                f"communicator was not made within {timeout:g} s", op="init_rpc", missing_ranks=missing,
                timeout=timeout)
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)
    MPI.Request.Waitall(sends)  # every peer received its hello: these are complete
    return comm, [names[i] for i in range(size)]
