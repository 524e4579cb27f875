"""torch.distributed's module functions for the rooted, point-to-point and monitored calls: ``reduce``,
``gather``, ``scatter``, ``gather_object``, ``scatter_object_list``, ``send_object_list``/``recv_object_list``,
``isend``/``irecv``, ``batch_isend_irecv`` with :class:`P2POp`, ``monitored_barrier`` and ``all_to_all_single``.

As in torch, ``group=None`` means the default (world) group and the ranks a function takes or returns (``dst``,
``src``, ``peer``, the sender of ``recv_object_list``) are *global* ranks, translated to the group's own; a global
rank outside the group is a ``ValueError``. The methods of :class:`~distlab.comm.ProcessGroup` of the same names
take group ranks and do the work.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._types import ReduceOp
from .group import check_usable, world
from .reduce_ops import check_movable
from .steps import check_rank, check_tag

__all__ = ["reduce", "gather", "scatter", "gather_object", "scatter_object_list", "send_object_list",
           "recv_object_list", "isend", "irecv", "P2POp", "batch_isend_irecv", "monitored_barrier",
           "all_to_all_single"]


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """``torch.distributed.reduce``: reduce ``tensor`` into global rank ``dst``'s, in place."""
    pg = _group(group)
    return pg.reduce(tensor, _local(pg, group, dst, "reduce dst"), op, async_op)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    """``torch.distributed.gather``: every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    pg = _group(group)
    return pg.gather(tensor, gather_list, _local(pg, group, dst, "gather dst"), async_op)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    """``torch.distributed.scatter``: ``scatter_list[r]`` of global rank ``src`` into group rank ``r``'s
    ``tensor``."""
    pg = _group(group)
    return pg.scatter(tensor, scatter_list, _local(pg, group, src, "scatter src"), async_op)


def gather_object(obj, object_gather_list=None, dst: int = 0, group=None):
    """``torch.distributed.gather_object``: every rank's ``obj`` into ``object_gather_list`` on ``dst``."""
    pg = _group(group)
    return pg.gather_object(obj, object_gather_list, _local(pg, group, dst, "gather_object dst"))


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src: int = 0, group=None):
    """``torch.distributed.scatter_object_list``: ``scatter_object_input_list[r]`` of ``src`` into group rank
    ``r``'s ``scatter_object_output_list[0]``."""
    pg = _group(group)
    return pg.scatter_object_list(scatter_object_output_list, scatter_object_input_list,
                                  _local(pg, group, src, "scatter_object_list src"))


def send_object_list(object_list, dst=None, group=None) -> None:
    """``torch.distributed.send_object_list``: the objects of ``object_list`` to global rank ``dst``."""
    pg = _group(group)
    if dst is None:
        raise ValueError("send_object_list: dst (the global rank to send to) must be specified")
    pg.send_object_list(object_list, _local(pg, group, dst, "send_object_list dst"))


def recv_object_list(object_list, src=None, group=None) -> int:
    """``torch.distributed.recv_object_list``: fill ``object_list`` from global rank ``src`` (any when None);
    returns the sender's global rank."""
    pg = _group(group)
    sender = pg.recv_object_list(object_list, None if src is None else _local(pg, group, src, "recv_object_list src"))
    return _global(pg, group, sender)


def isend(tensor, dst=None, group=None, tag: int = 0):
    """``torch.distributed.isend``: start sending ``tensor`` to global rank ``dst``; returns a Work."""
    pg = _group(group)
    if dst is None:
        raise ValueError("isend: dst (the global rank to send to) must be specified")
    return pg.isend(tensor, _local(pg, group, dst, "isend dst"), tag)


def irecv(tensor, src=None, group=None, tag: int = 0):
    """``torch.distributed.irecv``: start receiving into ``tensor`` from global rank ``src`` (any when None);
    returns a Work (its ``result()`` is the sender's group rank)."""
    pg = _group(group)
    return pg.irecv(tensor, None if src is None else _local(pg, group, src, "irecv src"), tag)


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (``torch.distributed.P2POp``).

    Parameters
    ----------
    op : callable
        :func:`distlab.comm.isend` or :func:`distlab.comm.irecv`.
    tensor : array
        The array to send, or to receive into.
    peer : int
        The global rank to send to or receive from.
    group : ProcessGroup, optional
        Default: the world group.
    tag : int, optional
        Matches a send with a receive (below distlab's reserved tags).
    """

    def __init__(self, op, tensor, peer=None, group=None, tag: int = 0):
        if op is not isend and op is not irecv:
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``distlab.comm.isend`` or "
                             f"``distlab.comm.irecv``, got {op!r}")
        dtype = getattr(tensor, "dtype", None)
        if dtype is None:
            raise TypeError(f"P2POp: tensor must be a numpy or cupy array, got {type(tensor).__name__}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    def __repr__(self) -> str:
        kind = "isend" if self.op is isend else "irecv"
        return f"P2POp({kind}, peer={self.peer}, {self.tensor.dtype}{list(self.tensor.shape)}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list) -> list:
    """``torch.distributed.batch_isend_irecv``: start every operation of ``p2p_op_list``; returns their Works.

    Every operation is checked before any starts (a bad one starts none), and all use the same group.
    """
    if not isinstance(p2p_op_list, list) or not p2p_op_list or \
            not all(isinstance(p2p_op, P2POp) for p2p_op in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to be of type ``distlab.comm.P2POp`` "
                         f"(a non-empty list), got {p2p_op_list!r}")
    group = p2p_op_list[0].group
    if not all(p2p_op.group is group for p2p_op in p2p_op_list):
        raise ValueError("batch_isend_irecv: all ops need to use the same group")
    pg = _group(group)
    check_usable(pg)
    peers = []
    for index, p2p_op in enumerate(p2p_op_list):
        what = f"batch_isend_irecv op {index} ({'isend' if p2p_op.op is isend else 'irecv'})"
        if p2p_op.peer is None and p2p_op.op is isend:
            raise ValueError(f"{what}: peer must be specified")
        peer = None if p2p_op.peer is None else _local(pg, group, p2p_op.peer, f"{what} peer")
        if peer is not None:
            check_rank(peer, pg.size, pg.name, f"{what} peer")
        check_tag(p2p_op.tag, what)
        check_movable(p2p_op.tensor.dtype, what)
        peers.append(peer)
    return [pg.isend(p2p_op.tensor, peer, p2p_op.tag) if p2p_op.op is isend else
            pg.irecv(p2p_op.tensor, peer, p2p_op.tag) for p2p_op, peer in zip(p2p_op_list, peers)]


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier``: a barrier whose rank 0 names the ranks that did not reach it
    within ``timeout`` (the first of them, or all with ``wait_all_ranks``)."""
    _group(group).monitored_barrier(timeout, wait_all_ranks)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                      async_op: bool = False):
    """``torch.distributed.all_to_all_single``, with uneven split sizes."""
    return _group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)


# -- ranks ------------------------------------------------------------------------------------------------------
def _group(group):
    return world() if group is None else group


def _local(pg, group, rank, what: str) -> int:
    """Global ``rank`` as a rank of ``pg`` (the same for the world group); a ValueError if it is not a member."""
    if group is None or isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        return rank  # the group's own check names a bad value
    local = _translate(MPI.COMM_WORLD, pg.comm, int(rank))
    if local == MPI.UNDEFINED:
        raise ValueError(f"{what}: global rank {rank} is not part of group {pg.name!r}")
    return local


def _global(pg, group, rank: int) -> int:
    return rank if group is None else _translate(pg.comm, MPI.COMM_WORLD, rank)


def _translate(source, target, rank: int) -> int:
    if not 0 <= rank < source.Get_size():
        return MPI.UNDEFINED
    first, second = source.Get_group(), target.Get_group()
    try:
        return int(MPI.Group.Translate_ranks(first, [rank], second)[0])
    finally:
        first.Free()
        second.Free()
