"""``monitored_barrier``: a barrier whose rank 0 names the ranks that did not reach it in time.

Mirrors ProcessGroupGloo::monitoredBarrier (torch.distributed.monitored_barrier): every other rank sends rank 0
word of its arrival and waits for rank 0's answer; rank 0 waits up to ``timeout`` for every arrival, then
answers everyone. When ranks are missing, rank 0 raises :class:`~distlab.errors.DistTimeoutError` naming the
first of them (all of them with ``wait_all_ranks=True``), in torch's words (``[Rank 0]: Rank 2 failed to pass
monitored_barrier ...``) followed by what the arrival board says of each (the collective it last entered).

Where torch's other ranks only learn that rank 0 failed when their own wait times out ("check rank 0's logs"),
here rank 0 sends its verdict to every rank, the missing ones included: a rank that arrived raises at once with
rank 0's words, and a late rank that arrives afterwards finds the verdict waiting (it never hangs on a rank 0 that
gave up). A rank whose wait for rank 0 ends before rank 0 decided asks the board whether rank 0 entered the
barrier: if it did, rank 0 is still waiting for others and decides within one more ``timeout``, so the rank waits
for that; if it did not, the rank raises naming rank 0.

The arrival message is the rank's collective fingerprint, so ``DISTLAB_DEBUG=DETAIL`` costs nothing extra: rank 0
compares the fingerprints it received and sends them back with its verdict, and every rank raises the same
:class:`~distlab.errors.CollectiveMismatchError` when they differ (a rank that called something else, or is a
collective behind). A monitored barrier that timed out leaves its group broken, as every timeout does.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .._wire import COMM_MONITOR_TAG, COMM_MONITOR_VERDICTS, FINGERPRINT_WORDS
from ..errors import CollectiveMismatchError, DistTimeoutError
from ..futures import resolve_timeout
from .missing import ask_lead
from .work import spin

__all__ = ["monitored_barrier"]

_PASSED, _TIMED_OUT, _MISMATCH = (COMM_MONITOR_VERDICTS.index(v) for v in ("passed", "timed_out", "mismatch"))
_OP = "monitored_barrier"
_left_in_flight: list = []  # (requests, buffers) of messages to or from ranks that never came: MPI may still use them


def monitored_barrier(steps, timeout=None, wait_all_ranks: bool = False, name=None) -> None:
    """Wait until every rank of a group reached this barrier; rank 0 names the ones that did not in time.

    Parameters
    ----------
    steps : distlab.comm.steps.GroupSteps
        The steps of the group (every rank of it calls this).
    timeout : float or datetime.timedelta, optional
        How long rank 0 waits for the others; default the group's timeout.
    wait_all_ranks : bool, optional
        False (torch's default): rank 0 reports the first missing rank; True: all of them.
    name : str, optional
        Named in errors and on the timeline.

    Raises
    ------
    DistTimeoutError
        On every rank that reached the barrier when some did not (``missing_ranks`` as rank 0 reported them),
        and on a rank whose rank 0 never entered it.
    CollectiveMismatchError
        ``DISTLAB_DEBUG=DETAIL``: on every rank, when some rank's fingerprint differs (it called another
        collective, or is behind).
    """
    timeout = resolve_timeout(timeout, "monitored_barrier(timeout)", steps.timeout)
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"monitored_barrier: wait_all_ranks must be True or False, got {wait_all_ranks!r}")
    steps.check_usable()
    seq = steps.enter(_OP, name, check=False)
    start = steps.start()
    words = steps.fingerprint.make_fingerprint(seq, _OP)
    if steps.size > 1:
        if steps.rank == 0:
            _monitor(steps, seq, words, timeout, wait_all_ranks, name)
        else:
            _report(steps, seq, words, timeout, name)
    if start:
        steps.record(_OP, name, seq, 0, start)


def _monitor(steps, seq: int, words, timeout: float, wait_all_ranks: bool, name) -> None:
    """Rank 0: take every arrival until ``timeout``, then send the verdict to every rank."""
    size, comm = steps.size, steps.comm
    verdict = np.zeros(2 + size + size * FINGERPRINT_WORDS, dtype=np.int64)
    table = verdict[2 + size:].reshape(size, FINGERPRINT_WORDS)
    table[0] = words
    arrivals = {rank: comm.Irecv(table[rank], source=rank, tag=COMM_MONITOR_TAG) for rank in range(1, size)}
    pending = set(arrivals)
    deadline = time.monotonic() + timeout

    def arrived() -> bool:
        for rank in sorted(pending):
            if arrivals[rank].Test():
                pending.discard(rank)
        return not pending or time.monotonic() >= deadline

    _poll(steps, arrived, seq, name, timeout)
    missing = sorted(pending)
    named = missing if wait_all_ranks else missing[:1]
    mismatch = None
    if missing:
        verdict[0] = _TIMED_OUT
        verdict[1] = len(named)
        verdict[2:2 + len(named)] = named
    elif steps.detail:
        mismatch = steps.fingerprint.find_mismatch(table)
        verdict[0] = _MISMATCH if mismatch is not None else _PASSED
    answers = {rank: comm.Isend(verdict, dest=rank, tag=COMM_MONITOR_TAG) for rank in range(1, size)}
    sent = [answers[rank] for rank in answers if rank not in pending]
    spin(steps, lambda: all(request.Test() for request in sent), time.monotonic() + steps.timeout, steps.timeout,
         _OP, seq, name, 0, None)
    if missing:
        _left_in_flight.append(([arrivals[r] for r in missing] + [answers[r] for r in missing], verdict))
        detail = _board(steps, seq, timeout)
        _fail(steps, seq, name, timeout, named, f"[Rank 0]: {_ranks(named)} failed to pass {_label(seq, name)} of "
              f"group {steps.name!r} (size {size}) in {_ms(timeout)} ms{detail}")
    if mismatch is not None:
        _mismatch(steps, seq, name, table, mismatch)


def _report(steps, seq: int, words, timeout: float, name) -> None:
    """Any other rank: tell rank 0 it arrived, and wait for rank 0's verdict."""
    size, comm = steps.size, steps.comm
    verdict = np.zeros(2 + size + size * FINGERPRINT_WORDS, dtype=np.int64)
    arrival = comm.Isend(words, dest=0, tag=COMM_MONITOR_TAG)
    release = comm.Irecv(verdict, source=0, tag=COMM_MONITOR_TAG)
    deadline = time.monotonic() + timeout
    extended = False
    while True:
        _poll(steps, lambda: release.Test() or time.monotonic() >= deadline, seq, name, timeout)
        if release.Test():
            break
        if not extended and _entered(steps, seq, 0, timeout):
            deadline, extended = time.monotonic() + timeout, True  # rank 0 decides within its own timeout
            continue
        _left_in_flight.append(([arrival, release], (words, verdict)))
        where = "entered it but sent no verdict in time" if extended else \
            f"has not entered it{_board(steps, seq, timeout)}"
        _fail(steps, seq, name, timeout, [0], f"rank {steps.rank} reached {_label(seq, name)} of group "
              f"{steps.name!r} (size {size}), but rank 0, which monitors it, {where}")
    spin(steps, arrival.Test, time.monotonic() + steps.timeout, steps.timeout, _OP, seq, name, 0, 0)
    code, count = int(verdict[0]), int(verdict[1])
    if code == _TIMED_OUT:
        named = verdict[2:2 + count].tolist()
        _fail(steps, seq, name, timeout, named, f"rank {steps.rank} reached {_label(seq, name)} of group "
              f"{steps.name!r}, but rank 0 reports: {_ranks(named)} failed to pass it in time")
    if code == _MISMATCH:
        table = verdict[2 + size:].reshape(size, FINGERPRINT_WORDS)
        _mismatch(steps, seq, name, table, steps.fingerprint.find_mismatch(table))


def _poll(steps, test, seq: int, name, timeout: float) -> None:
    """Drive MPI until ``test()`` (which ends at its own deadline); the poll loop's deadline never fires."""
    spin(steps, test, math.inf, timeout, _OP, seq, name, 0, None)


def _entered(steps, seq: int, rank: int, timeout: float) -> bool:
    """Whether ``rank`` has entered collective ``seq`` (its node's board, asked across nodes if needed)."""
    known = steps.side.status(seq, ask_lead(timeout))
    return rank in known and known[rank][0] >= seq


def _board(steps, seq: int, timeout: float) -> str:
    """What the arrival board (and the other nodes) say of the ranks behind: ``: ranks [2] have not entered
    it (rank 2 last entered #4 allreduce)``."""
    _, detail = steps.side.describe(seq, ask_lead(timeout))
    return f": {detail}"


def _fail(steps, seq: int, name, timeout: float, missing, message: str) -> None:
    steps.side.gave_up(seq)
    steps.mark_broken(f"{_label(seq, name)} timed out and may still be in flight")
    raise DistTimeoutError(f"{message}. Raise the timeout to wait longer.", op=_OP, seq=seq, name=name,
                           missing_ranks=missing, timeout=timeout)


def _mismatch(steps, seq: int, name, table, message: str) -> None:
    where = f" ({name!r})" if name else ""
    raise CollectiveMismatchError(f"rank {steps.rank}{where}: {message}", seq=seq,
                                  groups=steps.fingerprint.fingerprint_groups(table))


def _label(seq: int, name) -> str:
    return f"{_OP} #{seq}" + (f" of {name!r}" if name else "")


def _ranks(ranks) -> str:
    return f"Rank {ranks[0]}" if len(ranks) == 1 else f"Ranks {', '.join(str(r) for r in ranks)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g}"
