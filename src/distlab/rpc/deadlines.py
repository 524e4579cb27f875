"""The RPC agent's timeout thread: fails requests whose deadline passed (shared plumbing, not twinned).

One thread per agent sleeps on a condition variable until the earliest deadline of the requests in flight.
Between deadlines it also wakes every ``idle_interval()`` seconds so the transport can notice that traffic
stopped and leave MPICH's busy-polling probe (see :mod:`distlab.rpc.transport`, the adaptive wait).
"""
from __future__ import annotations

import heapq
import threading
import time
from typing import Callable

__all__ = ["DeadlineWatcher"]


class DeadlineWatcher:
    """A heap of ``(deadline, message id, timeout)`` watched by one thread.

    Parameters
    ----------
    name : str
        The worker's name (names the thread).
    is_pending : callable
        ``is_pending(mid) -> bool``: the request still awaits its response (answered ones are pruned).
    on_expire : callable
        ``on_expire(mid, timeout)``: fail request ``mid`` with a timeout error (called outside the lock).
    idle_interval : callable
        ``idle_interval() -> float or None``: how long to sleep at most between idleness checks (None: no check).
    on_idle_check : callable
        ``on_idle_check()``: called after each wake-up, under the lock (it must not block).
    """

    def __init__(self, name: str, is_pending: Callable, on_expire: Callable, idle_interval: Callable,
                 on_idle_check: Callable):
        self._heap: list = []
        self.cond = threading.Condition()
        self._is_pending = is_pending
        self._on_expire = on_expire
        self._idle_interval = idle_interval
        self._on_idle_check = on_idle_check
        self.running = True
        self._thread = threading.Thread(target=self._run, name=f"distlab-rpc-timeouts-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, deadline: float, mid: int, timeout: float) -> None:
        """Watch request ``mid``: expire it at ``deadline`` (monotonic seconds) unless it was answered."""
        with self.cond:
            heap = self._heap
            # Prune answered requests from the top: with the usual single timeout, deadlines come in order, so
            # the heap stays about as large as the number of requests in flight (not calls/s x timeout).
            while heap and not self._is_pending(heap[0][1]):
                heapq.heappop(heap)
            first = not heap or deadline < heap[0][0]
            heapq.heappush(heap, (deadline, mid, timeout))
            if first:
                self.cond.notify()

    def notify(self) -> None:
        """Wake the thread (the transport left idle mode: idleness checks resume)."""
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.running = False
            self.cond.notify_all()

    def _run(self) -> None:
        cond = self.cond
        heap = self._heap
        while True:
            with cond:
                while self.running and (not heap or heap[0][0] > time.monotonic()):
                    wait = None if not heap else heap[0][0] - time.monotonic()
                    interval = self._idle_interval()
                    if interval is not None:
                        wait = interval if wait is None else min(wait, interval)
                    cond.wait(wait)
                    if self.running:
                        self._on_idle_check()
                if not self.running:
                    return
                now = time.monotonic()
                expired = []
                while heap and heap[0][0] <= now:
                    expired.append(heapq.heappop(heap))
            for _deadline, mid, timeout in expired:
                if self._is_pending(mid):
                    self._on_expire(mid, timeout)
