"""The RPC agent's timeout thread: fails requests whose deadline passed (shared plumbing, not twinned).

One thread per agent sleeps until the earliest deadline of the requests in flight. Requests made with the same
timeout come in deadline order, so each timeout value has a first-in first-out queue of ``(deadline, message
id)``: adding a request is an append, answered requests are dropped from the heads, and the thread looks only at
the heads (a heap of every request would cost each call a logarithmic insertion under a condition variable).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable

__all__ = ["DeadlineWatcher"]


class DeadlineWatcher:
    """Requests in flight with their deadlines, watched by one thread.

    Parameters
    ----------
    name : str
        The worker's name (names the thread).
    is_pending : callable
        ``is_pending(mid) -> bool``: the request still awaits its response (answered ones are dropped).
    on_expire : callable
        ``on_expire(mid, timeout)``: fail request ``mid`` with a timeout error (called outside the lock).
    """

    def __init__(self, name: str, is_pending: Callable, on_expire: Callable):
        self._queues: dict[float, collections.deque] = {}   # timeout -> deque of (deadline, mid), in order
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake_at = math.inf    # when the thread looks next
        self._is_pending = is_pending
        self._on_expire = on_expire
        self.running = True
        self._thread = threading.Thread(target=self._run, name=f"distlab-rpc-timeouts-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, deadline: float, mid: int, timeout: float) -> None:
        """Watch request ``mid``: expire it at ``deadline`` (monotonic seconds) unless it was answered."""
        is_pending = self._is_pending
        with self._lock:
            queue = self._queues.get(timeout)
            if queue is None:
                queue = self._queues[timeout] = collections.deque()
            while queue and not is_pending(queue[0][1]):
                queue.popleft()   # answered: the queue stays about as long as the requests in flight
            queue.append((deadline, mid))
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()

    def stop(self) -> None:
        with self._lock:
            self.running = False
            self._cond.notify_all()

    def _run(self) -> None:
        is_pending = self._is_pending
        while True:
            expired = []
            with self._lock:
                if not self.running:
                    return
                now = time.monotonic()
                wake_at = math.inf
                for timeout, queue in self._queues.items():
                    while queue and (queue[0][0] <= now or not is_pending(queue[0][1])):
                        deadline, mid = queue.popleft()
                        if deadline <= now and is_pending(mid):
                            expired.append((mid, timeout))
                    if queue:
                        wake_at = min(wake_at, queue[0][0])
                self._wake_at = wake_at
                if not expired:
                    self._cond.wait(None if wake_at == math.inf else wake_at - now)
                    continue
            for mid, timeout in expired:
                self._on_expire(mid, timeout)
