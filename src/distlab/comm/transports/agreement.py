"""Which path each collective of an ipc group takes, agreed by its ranks: the slots, or the host path.

Host arrays meet the ipc transport too: Join's counts and DDP's used-parameter map are host arrays on every rank,
and a joined rank shadows the others' device collectives with host zeros (``SyncBatchNorm``). A shadow must run
the protocol its peers run, but a collective that is host memory on every rank belongs on the host path (plain
MPI), not copied in and out of device slots. Each rank knows only its own arrays, so the ranks agree once per
collective *signature* (op, name, shape, dtype): the signature's first collective runs through the slots, and its
arrival message also says whether each rank's arrays are device memory (:meth:`PathAgreement.first`); every rank
reads the same messages, so every rank records the same answer. From then on host arrays of a signature that was
host memory on every rank take the host path, and host arrays of one that was device memory on any rank stay on
the slots (a shadow's host zeros). Device arrays always take the slots (so a device collective's bits never depend
on what ran before it). A rank that calls a signature with host arrays before its first collective arrived drives
that one to its arrival first (:meth:`PathAgreement.slots`). The answers of the last :data:`AGREED_SIGNATURES`
signatures are kept, forgotten oldest first (every rank remembers in call order, so forgets alike).

What this cannot tell: a signature that was host memory on every rank, called later with device memory on some
ranks and host memory on others (a layer trained on the host, moved to the device, then shadowed by a joined rank
with host zeros, on the same group): the host ranks take the host path, the device ranks the slots, and the wait
times out naming the operation. A shadow made on its peers' device, or a new name, avoids it.
"""
from __future__ import annotations

import time

from ..work import spin

__all__ = ["PathAgreement", "AGREED_SIGNATURES"]

#: How many collective signatures' agreed paths a transport keeps.
AGREED_SIGNATURES = 1024


class _Agreeing:
    """A signature's first collective, still on its way to the arrival message that settles its path."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work


class PathAgreement:
    """The agreed path of each collective signature of one ipc group (see the module docstring).

    Parameters
    ----------
    steps : distlab.comm.steps.GroupSteps
        The group's steps (a wait for a first collective's arrival is bounded by its timeout).
    """

    def __init__(self, steps):
        self._steps = steps
        self._paths: dict = {}  # signature -> True (device somewhere), False (host everywhere) or _Agreeing

    def slots(self, key) -> bool:
        """Whether the collective of signature ``key`` goes through the slots: True when it was device memory on
        some rank, or when its path is not agreed yet (this collective agrees it); False when it was host memory on
        every rank."""
        path = self._paths.get(key)
        if path.__class__ is _Agreeing:
            path = self._settled(key, path)
        return path is not False

    def first(self, key):
        """For a collective of signature ``key`` about to run through the slots: ``record(device_words)`` when it
        is the signature's first (it agrees the path: call it with every rank's device word, from the arrival
        messages), else None."""
        if key in self._paths:
            return None

        def record(device_words) -> None:
            if self._paths.get(key).__class__ is _Agreeing:
                self._paths[key] = bool(device_words.any())
        return record

    def started(self, key, work) -> None:
        """The first collective of signature ``key`` (its ``record`` came from :meth:`first`) runs as ``work``."""
        paths = self._paths
        paths[key] = _Agreeing(work)
        if len(paths) > AGREED_SIGNATURES:
            del paths[next(iter(paths))]

    def _settled(self, key, agreeing: _Agreeing) -> bool | None:
        """The path of signature ``key`` once its first collective arrived (driving it until then, bounded by the
        group's timeout); None when that collective failed before (the next one agrees afresh)."""
        steps, work = self._steps, agreeing.work

        def settled() -> bool:
            return self._paths.get(key) is not agreeing or work.advance()

        if not settled():
            spin(steps, settled, time.monotonic() + steps.timeout, steps.timeout, work.op, work.seq, work.name,
                 work.nbytes, None)
        path = self._paths.get(key)
        if path is agreeing:
            del self._paths[key]
            return None
        return path
