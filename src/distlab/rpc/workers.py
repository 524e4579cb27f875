"""The RPC agent's workers: names and ids, the registry that resolves them, and the MPI thread-level check.

Shared plumbing of :mod:`distlab.rpc` (not twinned). A worker's id is its rank in the agent's communicator.
"""
from __future__ import annotations

from typing import NamedTuple

from distlab._wire import RREF_WORKER_ID_BITS
from distlab.errors import RpcThreadLevelError

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

    Collective over ``world``: :func:`distlab.comm.setup.dup_within` first (each rank sends every other a notice
    and waits for theirs), so a rank that never calls ``init_rpc`` makes the others raise DistTimeoutError naming
    it after ``timeout`` seconds instead of hanging in ``MPI_Comm_dup``; then, every rank being there, the names
    are gathered on the new communicator. Returns ``(comm, names)``.
    """
    from distlab.comm.setup import dup_within

    size = world.Get_size()
    if size > MAX_WORKERS:
        raise ValueError(f"distlab.rpc supports at most {MAX_WORKERS} workers, the world has {size} ranks")
    comm = dup_within(world, f"init_rpc (worker {name!r})", timeout)
    return comm, comm.allgather(name)
