"""Naming the missing ranks when a wait times out: the node's arrival board, and notes between nodes.

On one node the :class:`~distlab.comm.board.ArrivalBoard` says everything: every rank's last collective is a
memory load away. A rank on another node cannot be read that way, and cannot be asked either if it is the late
one: it computes in Python outside MPI, so it answers nothing. Its node peers that *are* waiting can answer for
it, though, because they read their own node's board. So, as its deadline nears, a waiting rank sends every
rank off its node an *ask* note carrying its own node's board; every rank that is waiting in a distlab call
(in the back-off phase of its poll loop, where it checks for notes between sleeps) answers once with its
node's board. At the deadline, the ranks still unknown are those whose whole node had nobody waiting to answer:
they are late, or busy outside distlab, and the error says so.

Why not announce every entry across nodes? That is a message per peer per collective on the hot path, where today
an entry is two stores into shared memory. Here nothing is sent until a wait has nearly timed out, and a rank
reads notes only once it has waited past its spin phase, so a collective that completes costs exactly what it
did on one node. The price is that a rank computing outside distlab cannot answer for its node, and a rank that
gave up earlier cannot either; both show as "did not answer" rather than being guessed.
"""
from __future__ import annotations

import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from ..errors import DistTimeoutError
from .._wire import (COLLECTIVE_OPS, COMM_NOTE_HEADER, COMM_NOTE_KINDS, COMM_NOTE_STATES, COMM_NOTE_TAG,
                     COMM_NOTE_VERSION)
from .ulfm import is_failure

__all__ = ["SideChannel", "ask_lead", "listen_all", "operation_label", "timeout_error"]

_ASK, _ANSWER = (COMM_NOTE_KINDS.index(k) for k in ("ask", "answer"))
_ELSEWHERE, _WAITING, _GAVE_UP = (COMM_NOTE_STATES.index(s) for s in ("elsewhere", "waiting", "gave_up"))
_HEADER = len(COMM_NOTE_HEADER)
_listening: "weakref.WeakSet[SideChannel]" = weakref.WeakSet()  # channels with ranks off this node


def ask_lead(timeout: float) -> float:
    """How long before its deadline a waiting rank asks the other nodes (a quarter of the timeout, at most 1 s)."""
    return min(1.0, 0.25 * timeout)


def operation_label(op: str, seq: int, name, nbytes: int = 0) -> str:
    """``allreduce #7 of 'bucket0' (4096 bytes)``: how errors name an operation."""
    label = f"{op} #{seq}" if seq else op
    if name:
        label += f" of {name!r}"
    return label + (f" ({nbytes} bytes)" if nbytes else "")


def timeout_error(side: "SideChannel", group_name: str, timeout: float, op: str, seq: int, name, nbytes: int,
                  peer) -> DistTimeoutError:
    """The DistTimeoutError of operation ``op`` #``seq`` of the group ``side`` serves, naming the ranks that never
    posted it (its ``peer``, or what the side channel learnt); tells the other nodes this rank gave up."""
    label = operation_label(op, seq, name, nbytes)
    if peer is not None:
        missing, detail = [peer], f"its peer, rank {peer}, never posted the matching call"
    elif seq:
        missing, detail = side.describe(seq, ask_lead(timeout))
        side.gave_up(seq)
    else:
        missing, detail = [], "no rank posted a matching call"
    return DistTimeoutError(
        f"{label} timed out after {timeout:g} s on rank {side.rank} of group {group_name!r} "
        f"(size {side.size}): {detail}. Raise DISTLAB_TIMEOUT to wait longer; DISTLAB_DEBUG=DETAIL checks "
        f"that every rank calls the same collectives.",
        op=op, seq=seq, name=name, missing_ranks=missing, timeout=timeout)


def listen_all() -> None:
    """Read (and answer) the notes that arrived for every group with ranks on other nodes."""
    for channel in list(_listening):
        channel.listen()


class SideChannel:
    """A group's view of where its ranks are: the node board, and the notes heard from other nodes.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The group's communicator (notes travel on it with the reserved tag ``COMM_NOTE_TAG``).
    board : ArrivalBoard
        This node's board for the group.

    Attributes
    ----------
    remote : list of int
        Group ranks whose slots this rank cannot read (other nodes): the ones notes are for.
    waiting_seq : int
        The collective this rank is waiting on in this group right now (0: none), set by the poll loop.
    """

    def __init__(self, comm, board):
        self.comm = comm
        self.board = board
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.remote = [r for r in range(self.size) if r not in board.readable]
        self.waiting_seq = 0
        self.gave_up_seq = 0
        self.heard: dict[int, tuple[int, int, int]] = {}  # rank -> (last seq, op code, rank that reported it)
        self.states: dict[int, tuple[int, int]] = {}  # sender -> (state code, the seq it referred to)
        self.asked_at: float | None = None
        self._inbox = np.zeros(_HEADER + 3 * self.size, dtype=np.int64)
        self._outbox: list = []  # (request, note) of notes in flight: their buffers must outlive the send
        self._lock = threading.Lock()  # listen() may run from several threads' poll loops
        if self.remote:
            _listening.add(self)

    def close(self) -> bool:
        """Stop listening (the group is being released); False if a listen is under way (free the comm later).

        Called from a finalizer, which may run in the middle of this channel's own ``listen`` (garbage collection
        strikes at any allocation): the lock is only tried, never waited for.
        """
        _listening.discard(self)
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.comm = None
        finally:
            self._lock.release()
        return True

    # -- sending --------------------------------------------------------------------------------------------
    def _note(self, kind: int, state: int, seq: int) -> np.ndarray:
        entries = self.board.snapshot()
        note = np.empty(_HEADER + 3 * len(entries), dtype=np.int64)
        note[:_HEADER] = (COMM_NOTE_VERSION, kind, state, seq, self.rank, len(entries))
        note[_HEADER:] = np.asarray(entries, dtype=np.int64).ravel()
        return note

    def _send(self, note: np.ndarray, dest: int) -> None:
        self._outbox = [(req, buf) for req, buf in self._outbox if not req.Test()]
        self._outbox.append((self.comm.Isend(note, dest=dest, tag=COMM_NOTE_TAG), note))

    def ask(self, seq: int) -> None:
        """Tell every rank off this node that this rank waits on ``seq`` (with this node's board); they answer."""
        if not self.remote:
            return
        with self._lock:
            if self.comm is None:
                return
            self.asked_at = time.monotonic()
            note = self._note(_ASK, _WAITING, seq)
            for rank in self.remote:
                self._send(note, rank)

    def gave_up(self, seq: int) -> None:
        """This rank timed out in ``seq``: tell the other nodes, so their own reports can say so."""
        self.gave_up_seq = seq
        if not self.remote:
            return
        with self._lock:
            if self.comm is None:
                return
            note = self._note(_ANSWER, _GAVE_UP, seq)
            for rank in self.remote:
                self._send(note, rank)

    # -- receiving ------------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Take every note that arrived; answer each ask once with this node's board and this rank's state."""
        with self._lock:
            while self.comm is not None:
                try:
                    message = self.comm.Improbe(MPI.ANY_SOURCE, COMM_NOTE_TAG)
                except MPI.Exception as exc:
                    if not is_failure(exc):
                        raise
                    # a process failed, or the group was revoked (fault tolerance): nobody asks here any more,
                    # and the waits that listen must not fail of it (the rebuild of the world polls them)
                    _listening.discard(self)
                    self.comm = None
                    return
                if message is None:
                    return
                message.Recv(self._inbox)
                self._record(self._inbox)

    def _record(self, note: np.ndarray) -> None:
        version, kind, state, seq, sender, count = (int(w) for w in note[:_HEADER])
        if version != COMM_NOTE_VERSION:
            return  # a peer running another distlab: its note cannot be read, so it counts as unanswered
        for rank, last, code in note[_HEADER:_HEADER + 3 * count].reshape(-1, 3).tolist():
            known = self.heard.get(rank)
            if known is None or last >= known[0]:
                self.heard[rank] = (last, code, sender)
        self.states[sender] = (state, seq)
        if kind == _ASK:
            if self.gave_up_seq:
                mine, about = _GAVE_UP, self.gave_up_seq
            elif self.waiting_seq:
                mine, about = _WAITING, self.waiting_seq
            else:
                mine, about = _ELSEWHERE, 0
            self._send(self._note(_ANSWER, mine, about), sender)

    # -- reporting ------------------------------------------------------------------------------------------
    def status(self, seq: int, lead: float) -> dict[int, tuple[int, int, int | None]]:
        """Every rank's ``(last seq entered, op code, reported by)`` that is known (None: this node's board).

        Asks the other nodes now if that was not done yet, and gives their answers until ``lead`` seconds after
        the ask to arrive (returning as soon as every rank is known).
        """
        if self.remote and self.asked_at is None:
            self.ask(seq)
        known: dict[int, tuple[int, int, int | None]] = {}
        while True:
            self.listen()
            known = {rank: (last, code, via) for rank, (last, code, via) in self.heard.items()}
            for rank, slot in self.board.readable.items():
                known[rank] = (int(slot[0]), int(slot[1]), None)
            if not self.remote or len(known) == self.size or self.asked_at is None:
                return known
            if time.monotonic() >= self.asked_at + lead:
                return known
            time.sleep(1e-3)

    def describe(self, seq: int, lead: float) -> tuple[list[int], str]:
        """``(missing ranks, what to say about them)`` for a collective ``seq`` that timed out."""
        known = self.status(seq, lead)
        behind = sorted(r for r, (last, _, _) in known.items() if last < seq)
        silent = sorted(r for r in range(self.size) if r not in known)
        parts = []
        if behind:
            where = "; ".join(_last_entered(r, *known[r]) for r in behind)
            parts.append(f"ranks {behind} have not entered it ({where})")
        if silent:
            parts.append(f"ranks {silent} on other nodes did not answer: no rank of their node is waiting in "
                         f"this group (late, or busy outside distlab)")
        gave_up = sorted(r for r, (state, about) in self.states.items() if state == _GAVE_UP and about == seq)
        if not parts:
            parts.append("every rank entered it but the transfer did not complete (a rank may have died, or "
                         "called it with a different size or op)")
        if gave_up:
            parts.append(f"ranks {gave_up} timed out in it before this rank and gave up")
        return sorted(behind + silent), "; ".join(parts)


def _last_entered(rank: int, last: int, code: int, via) -> str:
    if not last:
        text = f"rank {rank} has entered no collective"
    else:
        op = COLLECTIVE_OPS[code] if 0 <= code < len(COLLECTIVE_OPS) else "?"
        text = f"rank {rank} last entered #{last} {op}"
    return text if via is None or via == rank else f"{text}, as rank {via} on its node reports"
