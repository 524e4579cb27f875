"""Exchanges beyond one array per rank: ``all_to_all_single`` with split sizes, point-to-point object lists,
``isend``/``irecv``, and ``monitored_barrier`` (in :mod:`distlab.comm.monitor`).

``all_to_all_single`` splits its arrays along their first dimension, as torch's does: rank ``i`` sends rows
``input_split_sizes[j]`` of its ``input`` to rank ``j``, and receives ``output_split_sizes[i]`` rows from rank
``i``. Split sizes must agree across ranks (what ``i`` sends to ``j`` is what ``j`` expects from ``i``); MPI
cannot tell when they do not (a short receive is an error on one rank, a long one is silently truncated or
hangs), so with ``DISTLAB_DEBUG=DETAIL`` every rank gathers the split sizes of all and refuses a disagreement
with the same :class:`~distlab.errors.CollectiveMismatchError` everywhere, naming the pair of ranks.

``send_object_list``/``recv_object_list`` send one message on a tag of distlab's own (never matched by a user's
``recv``): the objects' count and sizes, then their pickles. The receiver learns its length from a matched probe,
so a sender and receiver that disagree on the number of objects get a clear error rather than a truncation.
"""
from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from .._wire import COMM_OBJECT_TAG
from ..errors import CollectiveMismatchError
from .monitor import monitored_barrier
from .device import displacements, pickled
from .steps import Calls, movable

__all__ = ["ExchangeOperations", "split_mismatches"]


class ExchangeOperations(Calls):
    """``all_to_all_single``, object lists point to point, ``isend``/``irecv`` and ``monitored_barrier`` of
    :class:`~distlab.comm.ProcessGroup` (taking the group's :class:`~distlab.comm.steps.GroupSteps`, like
    :class:`~distlab.comm.operations.GroupOperations`)."""

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,  # noqa: A002
                          async_op: bool = False, name=None):
        """Rank ``i`` sends ``input_split_sizes[j]`` rows of ``input`` to rank ``j``, and receives
        ``output_split_sizes[i]`` rows from rank ``i`` into ``output`` (in rank order).

        Split sizes None (or empty) split dimension 0 equally over the ranks. Returns ``output`` (a Work when
        ``async_op``).
        """
        label = f"all_to_all_single of {name!r}" if name else "all_to_all_single"
        send, _ = movable(input, "all_to_all_single", name)
        recv, copy_back = movable(output, "all_to_all_single", name)
        if not input.shape or not output.shape:
            raise ValueError(f"{label}: input and output need at least one dimension (they are split along the "
                             f"first), got shapes {tuple(input.shape)} and {tuple(output.shape)}")
        if input.dtype != output.dtype or tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise ValueError(f"{label}: input and output need the same dtype and the same dimensions after the "
                             f"first, got {input.dtype}{list(input.shape)} and {output.dtype}{list(output.shape)}")
        sends = self._split_sizes(input_split_sizes, input.shape[0], "input_split_sizes", "input", label)
        receives = self._split_sizes(output_split_sizes, output.shape[0], "output_split_sizes", "output", label)
        row = int(np.prod(input.shape[1:], dtype=np.int64)) * (input.dtype.itemsize // send.dtype.itemsize)
        send_spec = [send, _counts_and_offsets(sends, row)]
        recv_spec = [recv, _counts_and_offsets(receives, row)]
        seq = self._steps.enter("all_to_all_single", name, _Rows(input))
        start = self._steps.start()
        if not self._steps.detail:
            request = self.comm.Ialltoallv(send_spec, recv_spec)
            return self._steps.issue("all_to_all_single", seq, name, input.nbytes, request, copy_back, output, async_op,
                               None, start)

        def stages():
            table = np.empty((self.size, 2 * self.size), dtype=np.int64)
            yield self.comm.Iallgather(np.array(sends + receives, dtype=np.int64), table)
            problems = split_mismatches(table)
            if problems:
                where = f" ({name!r})" if name else ""
                raise CollectiveMismatchError(
                    f"rank {self.rank}{where}: all_to_all_single #{seq}: the split sizes disagree: "
                    + "; ".join(problems), seq=seq, groups={problem: [] for problem in problems})
            yield self.comm.Ialltoallv(send_spec, recv_spec)
            if copy_back is not None:
                copy_back()
            return output

        return self._steps.run("all_to_all_single", seq, name, input.nbytes, stages(), async_op)

    def isend(self, array, dst: int, tag: int = 0, name=None):
        """Start sending ``array`` to rank ``dst``; returns its :class:`~distlab.comm.Work`."""
        return self.send(array, dst, tag=tag, async_op=True, name=name)

    def irecv(self, array, src=None, tag: int = 0, name=None):
        """Start receiving into ``array`` from rank ``src`` (any rank when None); returns its Work, whose
        ``result()`` is the sender's rank."""
        return self.recv(array, src, tag=tag, async_op=True, name=name)

    def send_object_list(self, object_list, dst: int, async_op: bool = False, name=None):
        """Send the picklable objects of ``object_list`` to rank ``dst`` (its ``recv_object_list`` fills a list
        of the same length)."""
        self._steps.check_usable()
        self._steps.check_rank(dst, "send_object_list dst")
        if not isinstance(object_list, list):
            raise TypeError(f"send_object_list: object_list must be a list, got {type(object_list).__name__}")
        payloads = [pickled(obj) for obj in object_list]
        header = np.array([len(payloads)] + [p.size for p in payloads], dtype=np.int64).view(np.uint8)
        message = np.concatenate([header] + payloads)
        start = self._steps.start()
        request = self.comm.Isend(message, dest=dst, tag=COMM_OBJECT_TAG)
        return self._steps.issue("send_object_list", 0, name, message.nbytes, request, None, None, async_op, dst, start)

    def recv_object_list(self, object_list, src=None, async_op: bool = False, name=None):
        """Receive objects sent by ``send_object_list`` from rank ``src`` (any rank when None) into
        ``object_list`` (in place, its length must be the number sent); returns the sender's rank."""
        self._steps.check_usable()
        if src is not None:
            self._steps.check_rank(src, "recv_object_list src")
        if not isinstance(object_list, list):
            raise TypeError(f"recv_object_list: object_list must be a list, got {type(object_list).__name__}")
        probe = ProbeRequest(self.comm, MPI.ANY_SOURCE if src is None else src, COMM_OBJECT_TAG)

        def stages():
            yield probe
            data = np.empty(probe.status.Get_count(MPI.BYTE), dtype=np.uint8)
            sender = probe.status.Get_source()
            yield probe.message.Irecv(data)
            count = int(data[:8].view(np.int64)[0])
            sizes = data[8:8 * (count + 1)].view(np.int64)
            if count != len(object_list):
                raise ValueError(f"recv_object_list: rank {sender} sent {count} objects, object_list has room for "
                                 f"{len(object_list)} (pass a list as long as the sender's)")
            offset = 8 * (count + 1)
            for index, size in enumerate(sizes.tolist()):
                object_list[index] = pickle.loads(data[offset:offset + size].tobytes())
                offset += size
            return sender

        return self._steps.run("recv_object_list", 0, name, 0, stages(), async_op, peer=src)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False, name=None) -> None:
        """A barrier whose rank 0 names the ranks that did not reach it within ``timeout`` (see
        :func:`distlab.comm.monitor.monitored_barrier`)."""
        monitored_barrier(self._steps, timeout, wait_all_ranks, name)

    # -- argument checks --------------------------------------------------------------------------------------
    def _split_sizes(self, sizes, rows: int, argument: str, which: str, label: str) -> list[int]:
        """Rows to or from each rank: ``sizes`` checked (one per rank, non-negative, summing to ``rows``), or an
        equal split when None or empty."""
        if sizes is None or len(sizes) == 0:
            if rows % self.size:
                raise ValueError(f"{label}: dimension 0 of the {which} ({rows}) is not divisible by the group size "
                                 f"({self.size}); pass {argument}")
            return [rows // self.size] * self.size
        sizes = list(sizes)
        if len(sizes) != self.size:
            raise ValueError(f"{label}: {argument} needs one entry per rank ({self.size}), got {len(sizes)}")
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in sizes):
            raise ValueError(f"{label}: {argument} must be non-negative integers, got {sizes}")
        if sum(sizes) != rows:
            raise ValueError(f"{label}: {argument} sum to {sum(sizes)}, but dimension 0 of the {which} is {rows}")
        return [int(s) for s in sizes]


class ProbeRequest:
    """A request-like matched probe (``MPI_Improbe``): its ``Test`` is true once a message from ``source`` with
    ``tag`` arrived, which it then holds (``message``, ``status``) for a matched receive."""

    __slots__ = ("comm", "source", "tag", "message", "status")

    def __init__(self, comm, source: int, tag: int):
        self.comm, self.source, self.tag = comm, source, tag
        self.message = None
        self.status = MPI.Status()

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        if self.message is None:
            self.message = self.comm.Improbe(self.source, self.tag, self.status)
        return self.message is not None


class _Rows:
    """What ``all_to_all_single``'s fingerprint compares: the dtype and the dimensions after the first (the
    number of rows may differ from rank to rank)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, array):
        self.shape, self.dtype = tuple(array.shape[1:]), array.dtype


def _counts_and_offsets(splits: list[int], row: int) -> tuple[list[int], list[int]]:
    counts = [s * row for s in splits]
    offsets = displacements(counts).astype(np.int64).tolist() if counts else []
    return counts, offsets


def split_mismatches(table: np.ndarray) -> list[str]:
    """Every pair of ranks whose split sizes disagree, from the gathered table (row ``i``: rank ``i``'s
    ``input_split_sizes`` then its ``output_split_sizes``); the same words on every rank."""
    size = table.shape[0]
    problems = []
    for i in range(size):
        for j in range(size):
            sent, expected = int(table[i, j]), int(table[j, size + i])
            if sent != expected:
                problems.append(f"rank {i} sends {sent} rows to rank {j}, which expects {expected}")
    return problems
