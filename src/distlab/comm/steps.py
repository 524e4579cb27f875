"""The steps every call of a process group takes: number it, post its arrival, issue it, wait for it.

:class:`GroupSteps` is the base class of the call families (:class:`~distlab.comm.operations.GroupOperations`,
:class:`~distlab.comm.rooted.RootedOperations`, :class:`~distlab.comm.exchange.ExchangeOperations`), which
:class:`~distlab.comm.ProcessGroup` combines: each call checks its arguments, then takes these steps, so the calls
go one way (group -> the call families -> these steps -> :mod:`~distlab.comm.work`). The group sets up the state
they use (``comm``, ``rank``, ``size``, the arrival slot, the side channel, the timeline).
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from .._types import ReduceOp
from .._wire import COLLECTIVE_OPS, FINGERPRINT_WORDS
from ..errors import CollectiveMismatchError, ProcessGroupBrokenError
from ..timeline import now_us
from .work import Work, _busy, record, spin

__all__ = ["GroupSteps"]

log = logging.getLogger("distlab.comm")
_OP_CODES = {name: code for code, name in enumerate(COLLECTIVE_OPS)}


class GroupSteps:
    """Numbering, arrival, issue and wait: what every collective and point-to-point call of a group runs."""

    def _start_numbering(self) -> None:
        """Number this group's collectives from 1 (called once, when the group is set up)."""
        self._seq = 0
        self._next_seq = itertools.count(1).__next__  # atomic under the GIL: no lock on the hot path

    # -- issuing operations ---------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken:
            raise ProcessGroupBrokenError(
                f"process group {self.name!r} cannot be used: {self._broken}. Create a new group or restart.")

    def _enter(self, op: str, name, array=None, root: int = -1, reduce_op: str = "", check: bool = True) -> int:
        """Number the collective, post arrival, and (DETAIL) check it matches on every rank (unless ``check`` is
        False: ``monitored_barrier`` carries its fingerprint in its own messages)."""
        if self._broken:
            self._check_usable()
        seq = self._seq = self._next_seq()
        self._my_slot[1] = _OP_CODES[op]
        self._my_slot[0] = seq
        if self._info:
            log.info("group %s rank %d: %s #%d %s", self.name, self.rank, op, seq, name or "")
        if self._detail and check:
            shape = None if array is None else array.shape
            dtype = None if array is None else array.dtype
            reduce_name = reduce_op.value if isinstance(reduce_op, ReduceOp) else reduce_op
            self._check_fingerprint(self._fingerprint.make_fingerprint(seq, op, shape, dtype, root, reduce_name),
                                    op, seq, name)
        return seq

    def _check_fingerprint(self, words, op: str, seq: int, name) -> None:
        table = np.empty((self.size, FINGERPRINT_WORDS), dtype=np.int64)

        def stages():
            yield self.comm.Iallgather(words, table)

        Work(self, op, seq, f"{name or op} (DETAIL fingerprint check)", table.nbytes, stages=stages()).wait()
        message = self._fingerprint.find_mismatch(table)
        if message is not None:
            where = f" ({name!r})" if name else ""
            raise CollectiveMismatchError(f"rank {self.rank}{where}: {message}", seq=seq,
                                          groups=self._fingerprint.fingerprint_groups(table))

    def _issue(self, op: str, seq: int, name, nbytes: int, request, finish, result, async_op: bool,
               peer=None, start_us: float = 0.0):
        """Complete a one-request operation: return a Work (async) or wait here and return ``result``.

        The sync path makes no Work object: it is the hot path of small collectives.
        """
        if async_op:
            work = Work(self, op, seq, name, nbytes, request, finish, result, peer, start_us=start_us)
            self._pending[work] = None
            _busy.add(self)
            return work
        if not request.Test():
            timeout = self.timeout
            spin(self, request.Test, time.monotonic() + timeout, timeout, op, seq, name, nbytes, peer)
        if finish is not None:
            finish()
        if start_us:
            record(self, op, name, seq, nbytes, start_us)
        return result

    def _staged(self, op: str, seq: int, name, nbytes: int, stages, async_op: bool, peer=None):
        """Run a multi-request operation (``stages`` yields each request and returns the result)."""
        start_us = self._start()
        work = Work(self, op, seq, name, nbytes, peer=peer, stages=stages, start_us=start_us)
        if async_op:
            if not work._done:
                self._pending[work] = None
                _busy.add(self)
            return work
        work.wait()
        return work._result

    def _start(self) -> float:
        return now_us() if self._timeline_on else 0.0
