"""Chrome trace timelines (Trace Event Format), one stream per rank merged into one file.

Enable with ``DISTLAB_TIMELINE=path.json`` or ``python -m distlab run --timeline path.json``. Each rank keeps
its events in memory and writes ``path.json.rank<N>`` when it exits; the launcher (or rank 0 at exit) merges
the parts into ``path.json``, which opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.

Every component records into the same per-rank :class:`Timeline`: the comm layer records each collective, the
reducer each bucket, and so on. Ranks are processes (``pid``), lanes are named threads (``tid``).
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import threading
import time

__all__ = ["Timeline", "get_timeline", "flush_now", "merge", "now_us"]

# Wall-clock origin plus a monotonic offset: precise within a rank, comparable across ranks on one machine.
_WALL0 = time.time()
_PERF0 = time.perf_counter()


def now_us() -> float:
    """Current time in microseconds since the epoch (the trace's time base)."""
    return (_WALL0 + (time.perf_counter() - _PERF0)) * 1e6


def _world_rank() -> int:
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class Timeline:
    """One rank's stream of trace events.

    Parameters
    ----------
    path : str or None
        Where the merged trace goes; this rank writes ``path + ".rank<N>"``. ``None`` disables recording.
    rank : int, optional
        This rank (the trace's ``pid``); default from the launcher's environment.
    """

    def __init__(self, path: str | None, rank: int | None = None):
        self.path = path
        self.enabled = bool(path)
        self.rank = _world_rank() if rank is None else rank
        self._events: list[dict] = []
        self._lanes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._flushed = False

    def _lane(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            tid = self._lanes[lane] = len(self._lanes) + 1
            self._events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                                 "args": {"name": lane}})
        return tid

    def complete(self, name: str, start_us: float, end_us: float | None = None, *, cat: str = "distlab",
                 lane: str = "main", args: dict | None = None) -> None:
        """Record a span (``ph: X``) from ``start_us`` to ``end_us`` (default: now)."""
        if not self.enabled:
            return
        end_us = now_us() if end_us is None else end_us
        with self._lock:
            event = {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": self._lane(lane),
                     "ts": start_us, "dur": max(end_us - start_us, 0.0)}
            if args:
                event["args"] = args
            self._events.append(event)

    def instant(self, name: str, *, cat: str = "distlab", lane: str = "main", args: dict | None = None,
                ts: float | None = None) -> None:
        """Record an instant event (``ph: i``), e.g. a gradient's arrival."""
        if not self.enabled:
            return
        with self._lock:
            event = {"ph": "i", "s": "t", "name": name, "cat": cat, "pid": self.rank,
                     "tid": self._lane(lane), "ts": now_us() if ts is None else ts}
            if args:
                event["args"] = args
            self._events.append(event)

    def counter(self, name: str, values: dict, *, ts: float | None = None) -> None:
        """Record a counter sample (``ph: C``), e.g. cache hits so far."""
        if not self.enabled:
            return
        with self._lock:
            self._events.append({"ph": "C", "name": name, "pid": self.rank, "ts": now_us() if ts is None else ts,
                                 "args": dict(values)})

    @contextlib.contextmanager
    def span(self, name: str, *, cat: str = "distlab", lane: str = "main", args: dict | None = None):
        """Record the ``with`` block as one span."""
        start = now_us() if self.enabled else 0.0
        try:
            yield
        finally:
            self.complete(name, start, cat=cat, lane=lane, args=args)

    def events(self) -> list[dict]:
        """A copy of the events recorded so far."""
        with self._lock:
            return list(self._events)

    def part_path(self) -> str:
        return f"{self.path}.rank{self.rank}"

    def flush(self) -> str | None:
        """Write this rank's part file (atomically) and return its path."""
        if not self.enabled:
            return None
        events = [{"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                  {"ph": "M", "name": "process_sort_index", "pid": self.rank, "args": {"sort_index": self.rank}}]
        events += self.events()
        part = self.part_path()
        os.makedirs(os.path.dirname(os.path.abspath(part)), exist_ok=True)
        tmp = f"{part}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(events, fh)
        os.replace(tmp, part)
        self._flushed = True
        return part


def merge(path: str, expected_parts: int | None = None, wait: float = 0.0, remove_parts: bool = True,
          partial: bool = False) -> str | None:
    """Merge the per-rank part files of ``path`` into one Chrome trace at ``path``.

    Parameters
    ----------
    path : str
        The trace file to write; parts are ``path + ".rank<N>"``.
    expected_parts : int, optional
        Wait (up to ``wait`` seconds) until this many parts exist before merging.
    wait : float
        Seconds to wait for missing parts.
    remove_parts : bool
        Delete the part files after merging.
    partial : bool
        The run was interrupted: mark the trace ``otherData.partial`` (its parts end where each rank stopped).

    Returns
    -------
    str or None
        ``path``, or None when there were no parts to merge.
    """
    deadline = time.monotonic() + wait
    while True:
        parts = sorted(glob.glob(glob.escape(path) + ".rank*"))
        parts = [p for p in parts if p.rsplit(".rank", 1)[1].isdigit()]
        if expected_parts is None or len(parts) >= expected_parts or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not parts:
        return None
    events: list[dict] = []
    for part in parts:
        with open(part) as fh:
            events.extend(json.load(fh))
    # Shift the time base so the trace starts near zero (Perfetto shows epoch microseconds awkwardly).
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
        if "dur" in event:
            event["dur"] = round(event["dur"], 3)
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"producer": "distlab", "ranks": len(parts), "epoch_origin_us": origin}}
    if partial:
        trace["otherData"]["partial"] = True
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(trace, fh)
    os.replace(tmp, path)
    if remove_parts:
        for part in parts:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
    return path


_timeline: Timeline | None = None
_timeline_lock = threading.Lock()


def get_timeline() -> Timeline:
    """This process's timeline (enabled when ``DISTLAB_TIMELINE`` names a file)."""
    global _timeline
    if _timeline is None:
        with _timeline_lock:
            if _timeline is None:
                _timeline = Timeline(os.environ.get("DISTLAB_TIMELINE") or None)
                if _timeline.enabled:
                    atexit.register(_flush_at_exit, _timeline)
    return _timeline


def flush_now() -> str | None:
    """Write this process's part now, if it records a timeline: for a rank told to stop (SIGTERM) or failing.

    Returns the part's path, or None when nothing is recorded.
    """
    timeline = _timeline
    if timeline is None or not timeline.enabled:
        return None
    return timeline.flush()


def _flush_at_exit(timeline: Timeline) -> None:
    timeline.flush()
    # Rank 0 merges once every rank's part is there (bounded: a crashed rank must not hold up exit).
    # Under the launcher, the launcher merges after the job instead, which also covers slow ranks.
    if timeline.rank == 0 and not os.environ.get("DISTLAB_LAUNCHER"):
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
        merge(timeline.path, expected_parts=world, wait=5.0)
