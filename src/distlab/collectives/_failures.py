"""How one rank's engine failure reaches every rank at once: a note to each peer, heard inside any wait.

Horovod stops every rank in the same cycle when one asks to: the shutdown flag of its request list (or the
"should shut down" bit of the cache's bit vector) reaches the coordinator, whose response list tells everyone
(``Controller::ComputeResponseList``, ``RunLoopOnce``). distlab's negotiation does the same for a rank that calls
``shutdown()``, and for a coordinator that fails in its cycle (it broadcasts the stop, with the reason, to the
ranks waiting in its broadcast).

A rank whose cycle thread itself fails (an exception running a response, a response list it refuses, a wait that
timed out) cannot take part in another cycle: its peers already wait for it in the collective it will never
enter. So it sends every peer a *failure note* instead, point to point with the reserved tag
``ENGINE_FAILURE_TAG`` on the engine's own communicator, saying why. A peer hears it wherever it is: at the top of
its next cycle, or inside the wait it is blocked in, because the engine is the ``interrupt`` of each of its
groups (:class:`~distlab.comm.ProcessGroup`), which every wait calls between polls once past its spin phase. Every
rank then stops within the cycle it is in, its pending handles failing with the failing rank's cause.

A process killed outright sends nothing; MPI (without ULFM) reports nothing either, and a peer blocked on it
would wait for its timeout. The launcher reports it instead: distlab's process manager, like hydra, ends the whole
job as soon as a rank ends badly, and the launcher's summary names the rank and the signal.
"""
from __future__ import annotations

import logging
import time

from mpi4py import MPI

from .._wire import ENGINE_FAILURE_NOTE_BYTES, ENGINE_FAILURE_TAG
from ..errors import MessageFormatError, NotInitializedError

__all__ = ["PeerFailed", "FailureNotes", "failure_reason", "stopped_by"]

log = logging.getLogger("distlab.collectives")

#: How long a failing rank waits for its notes to leave (they are small: MPI sends them eagerly).
SEND_GRACE = 2.0


class PeerFailed(Exception):
    """Raised in the cycle thread (by a wait's interrupt, or the check at the top of a cycle): a peer failed."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} {reason}")
        self.rank, self.reason = rank, reason


def failure_reason(error: BaseException, rank: int) -> str:
    """What the peers of a rank whose cycle thread raised ``error`` are told (a predicate of that rank).

    Logs the error with its traceback here (logger ``distlab.collectives``), as the reason carries only its text.
    """
    log.error("rank %d: the collectives engine failed in its cycle; every rank stops", rank, exc_info=error)
    text = f"{type(error).__name__}: {error}"
    if len(text) > 1500:
        text = text[:1500] + " [...]"
    if isinstance(error, MessageFormatError):
        return f"refused a negotiation message ({text}); see rank {rank}'s log"
    return f"failed in its background loop ({text}); see rank {rank}'s log"


def stopped_by(failure: PeerFailed) -> NotInitializedError:
    """The error a peer's pending handles and later calls fail with: who failed, and why."""
    return NotInitializedError(f"distlab.collectives stopped: {failure}")


class FailureNotes:
    """One rank's end of the failure notes, over the engine's communicator ``comm`` (``rank`` of ``size``)."""

    def __init__(self, comm, rank: int, size: int):
        self.comm, self.rank, self.size = comm, rank, size
        self._inbox = bytearray(ENGINE_FAILURE_NOTE_BYTES)
        self._status = MPI.Status()

    def announce(self, reason: str) -> None:
        """Tell every peer that this rank's engine failed, and why; waits (briefly) for the notes to leave."""
        note = reason.encode("utf-8")[:ENGINE_FAILURE_NOTE_BYTES]
        try:
            sends = [self.comm.Isend([note, MPI.BYTE], dest=peer, tag=ENGINE_FAILURE_TAG)
                     for peer in range(self.size) if peer != self.rank]
            deadline = time.monotonic() + SEND_GRACE
            while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                time.sleep(1e-3)
        except Exception:  # noqa: BLE001 - failing already: the peers will time out instead, as before
            log.exception("rank %d: could not tell the other ranks that its collectives engine failed", self.rank)

    def check(self) -> None:
        """Raise :class:`PeerFailed` if a peer's note has arrived (the groups' ``interrupt``; cheap otherwise)."""
        message = self.comm.Improbe(MPI.ANY_SOURCE, ENGINE_FAILURE_TAG, self._status)
        if message is None:
            return
        count = self._status.Get_count(MPI.BYTE)
        message.Recv([self._inbox, count, MPI.BYTE])
        raise PeerFailed(self._status.Get_source(), bytes(self._inbox[:count]).decode("utf-8", "replace"))
