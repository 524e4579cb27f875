"""Process groups over MPI: the collectives every distlab component communicates with.

A :class:`ProcessGroup` wraps an mpi4py communicator (a ``Dup`` of ``COMM_WORLD`` by default, so distlab's
traffic never matches a user's own MPI calls). Its collectives work in place on the array they are given, as
``torch.distributed``'s do::

    from distlab import comm
    pg = comm.world()
    a = np.full(4, pg.rank, np.float32)
    pg.allreduce(a)                         # a now holds the sum over ranks
    work = pg.allreduce(a, op="avg", async_op=True)
    ...                                     # compute while it runs
    work.wait()

Three promises hold for every call:

* **No hang.** Every wait is bounded by ``DISTLAB_TIMEOUT`` (default 300 s), group set-up included. On timeout
  the error names the operation, its sequence number, the tensor, and the ranks that had not entered it, read
  through a side channel (each rank posts the last collective it entered on its node's shared-memory board;
  ranks on other nodes are asked), not guessed.
* **Mismatches are named.** With ``DISTLAB_DEBUG=DETAIL`` every collective's fingerprint (sequence number, op,
  shape, dtype, root) is compared across ranks first; a mismatch raises the same
  :class:`~distlab.errors.CollectiveMismatchError` on every rank, naming who sent what.
* **Arrays are never pickled.** numpy arrays go to MPI as buffers; cupy arrays go through the group's device
  transport (:mod:`distlab.comm.transports`), or to MPI directly when the MPI is CUDA-aware and through host memory
  otherwise (see :mod:`distlab.comm.device`).

MPI nonblocking operations only progress inside MPI calls. A caller that overlaps communication with compute
should call :func:`progress` (or ``work.is_completed()``) now and then; the reducer does so from every autograd
hook.

The package, one job per module: :mod:`~distlab.comm.group` (``ProcessGroup``, :func:`world`, :func:`new_group`),
:mod:`~distlab.comm.steps` (``GroupSteps``: what every call of a group takes, numbering, arrival, issue, wait,
the one object the group and its device transport share; and the argument checks), the call families the group
combines, :mod:`~distlab.comm.operations` (the collectives and point to point), :mod:`~distlab.comm.rooted`
(reduce, gather, scatter and their object variants) and :mod:`~distlab.comm.exchange` (all_to_all_single with
split sizes, object lists point to point, isend/irecv), :mod:`~distlab.comm.monitor` (monitored_barrier),
:mod:`~distlab.comm.functions` (torch.distributed's module functions for these, with global ranks),
:mod:`~distlab.comm.work` (``Work``, ``InFlight``, the one owner of every group's work in flight, the poll loop,
:func:`progress`), :mod:`~distlab.comm.reduce_ops` (reduce ops and dtype checks), :mod:`~distlab.comm.device`
(numpy and cupy buffers, CUDA-aware detection, staging), :mod:`~distlab.comm.transports` (the device transports
behind one interface, ``Transport``, chosen per group), :mod:`~distlab.comm.shared` (shared-memory arenas),
:mod:`~distlab.comm.pieces` (large allreduces across nodes in pieces, each group's ``PieceSize``),
:mod:`~distlab.comm.board` and :mod:`~distlab.comm.missing` (the side channel naming missing ranks),
:mod:`~distlab.comm.setup` (bounded set-up: :func:`bounded_dup`, :func:`bounded_barrier`), :mod:`~distlab.comm.ulfm`
(process failures under ULFM: detection, revoke, agree, shrink) and :mod:`~distlab.comm.recovery` (the world
rebuilt on the survivors).
"""
from __future__ import annotations

from .._types import ReduceOp
from .functions import (P2POp, all_to_all_single, batch_isend_irecv, gather, gather_object, irecv, isend,
                        monitored_barrier, recv_object_list, reduce, scatter, scatter_object_list, send_object_list)
from .group import ProcessGroup, debug_level, new_group, world
from .setup import bounded_barrier, bounded_dup
from .work import Work, progress

__all__ = ["ProcessGroup", "Work", "world", "new_group", "progress", "debug_level", "ReduceOp", "bounded_dup",
           "bounded_barrier", "reduce", "gather", "scatter", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list", "isend", "irecv", "P2POp", "batch_isend_irecv",
           "monitored_barrier", "all_to_all_single"]
