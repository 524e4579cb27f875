"""The stall inspector of the negotiated collectives (mirrors horovod/common/stall_inspector.cc, and does better).

A *stall* is a tensor that some ranks have submitted and others have not, for longer than the check time: the
job is not deadlocked inside MPI, it is waiting for ranks that run different code, are stuck elsewhere, or ran out
of data. Horovod's warning lists the tensor names with the ranks that are ready and missing; ours also says how
long each tensor has waited and what usually causes it, and keeps the reports for programs (``reports``).

Shared by both twins of the controller: it is only touched when something waits (requeued hits, the slow path),
never per tensor on the common hit path.
"""
from __future__ import annotations

import time
import warnings

from .._wire import REQUEST_TYPE_NAMES
from ..errors import StallWarning

__all__ = ["StallInspector"]


class StallInspector:
    """Track when tensors started waiting; report and optionally shut down on stalls.

    Parameters
    ----------
    size : int
        World size.
    check_time : float
        Seconds a tensor may wait before it is reported, and the interval between checks (0 disables).
    shutdown_time : float
        Seconds after which a stalled tensor shuts the collectives down (0 = never).
    clock : callable
        Monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, size: int, check_time: float = 60.0, shutdown_time: float = 0.0, clock=time.monotonic):
        self.size = int(size)
        self.check_time = float(check_time)
        self.shutdown_time = float(shutdown_time)
        self.clock = clock
        self._uncached: dict[str, tuple[int, dict[int, float]]] = {}   # name -> (type, {rank: first seen})
        #: Cached tensors this rank holds back, waiting for other ranks: {name: first seen} (empty: none).
        self.cached_waits: dict[str, float] = {}
        self._last_check = clock()
        #: Every stall report produced so far (rank 0), newest last.
        self.reports: list[str] = []
        #: Names reported in the last check with their missing ranks: {name: [ranks]}.
        self.last_stalled: dict[str, list[int]] = {}
        #: Why the last check shut the job down (a predicate of this rank, for the other ranks' messages).
        self.shutdown_reason = ""

    # -- bookkeeping (mirrors RecordUncachedTensorStart / RemoveUncachedTensor / ...Cached...) -----------------
    def record_uncached(self, name: str, rank: int, request_type: int = 0) -> None:
        entry = self._uncached.get(name)
        if entry is None:
            entry = self._uncached[name] = (request_type, {})
        entry[1].setdefault(rank, self.clock())

    def remove_uncached(self, name: str) -> None:
        self._uncached.pop(name, None)

    def record_cached(self, name: str) -> None:
        self.cached_waits.setdefault(name, self.clock())

    def remove_cached(self, name: str) -> None:
        self.cached_waits.pop(name, None)

    # -- checks ------------------------------------------------------------------------------------------------
    def should_check(self) -> bool:
        return self.check_time > 0 and self.clock() - self._last_check >= self.check_time

    def update_check_time(self) -> None:
        self._last_check = self.clock()

    def stalled_cached_names(self) -> list[str]:
        """Cached tensors this rank has held back longer than the check time (to push onto the slow path)."""
        now = self.clock()
        return sorted(n for n, t in self.cached_waits.items() if now - t >= self.check_time)

    def check(self, joined_ranks=()) -> bool:
        """Report stalled uncached tensors (coordinator only); return True if the job should shut down."""
        now = self.clock()
        joined = set(joined_ranks)
        stalled = []
        shut_down = False
        for name, (kind, ranks) in self._uncached.items():
            waited = now - min(ranks.values())
            if waited < self.check_time:
                continue
            missing = [r for r in range(self.size) if r not in ranks and r not in joined]
            if not missing:
                continue
            stalled.append((waited, name, kind, sorted(ranks), missing))
            if self.shutdown_time > 0 and waited >= self.shutdown_time:
                shut_down = True
        self.last_stalled = {name: missing for _w, name, _k, _r, missing in stalled}
        if stalled:
            stalled.sort(key=lambda item: (-item[0], item[1]))
            lines = [
                f"distlab stall inspector: {len(stalled)} tensor(s) have been submitted by some ranks but not all "
                f"for more than {self.check_time:g} s. The missing ranks have not called these collectives: they "
                "may run different code (a name or an `if rank == ...` differs), be stuck elsewhere, or have run "
                "out of data (call collectives.join() when a rank has no more batches)."
            ]
            for waited, name, kind, ready, missing in stalled:
                kind_name = REQUEST_TYPE_NAMES[kind] if 0 <= kind < len(REQUEST_TYPE_NAMES) else "?"
                lines.append(f"  {name!r} ({kind_name}): waiting {waited:.1f} s; ready on {_ranks(ready)}; "
                             f"missing {_ranks(missing)}")
            if shut_down:
                lines.append(f"Shutting down: a tensor waited longer than DISTLAB_STALL_SHUTDOWN_TIME="
                             f"{self.shutdown_time:g} s.")
                waited, name, _kind, _ready, missing = stalled[0]
                self.shutdown_reason = (f"shut the job down: its stall inspector saw {name!r} wait {waited:.1f} s "
                                        f"for {_ranks(missing)} (DISTLAB_STALL_SHUTDOWN_TIME="
                                        f"{self.shutdown_time:g} s)")
            else:
                lines.append("Set DISTLAB_STALL_CHECK_TIME to change how long to wait before this report (0 turns it "
                             "off), DISTLAB_STALL_SHUTDOWN_TIME to shut down after a stall.")
            report = "\n".join(lines)
            self.reports.append(report)
            warnings.warn(report, StallWarning, stacklevel=2)
        return shut_down


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
