"""The DDP reducer's runtime statistics and timeline events, shared by both twins (so they report the same)."""
from __future__ import annotations

import time

import numpy as np

from ..timeline import get_timeline, now_us

__all__ = ["ReducerStats"]


def _sampled(iteration: int) -> bool:
    """Runtime stats are sampled on iterations 1-10, then every 100th (``should_collect_runtime_stats``)."""
    return iteration <= 10 or iteration % 100 == 0


class ReducerStats:
    """Runtime statistics and timeline events of one reducer (``Logger`` + ``reducer_timer`` in the anchor).

    Per sampled iteration: backward compute time (first to last gradient), communication time (first bucket
    launch to the end of finalize) and their overlap. The timeline shows each gradient's arrival and each
    bucket's flight, so overlap with backward can be seen in Perfetto.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.timeline = get_timeline()
        self.iteration = 0
        self.sampling = False
        self.events = {}
        self.samples = []
        self.arrivals = None  # with record_arrivals: seconds from a sampled iteration's first gradient to each
        self._arrivals_of = 0  # the iteration they belong to

    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.sampling = _sampled(iteration)
        self.events = {}

    def record_arrivals(self, count: int) -> None:
        """Keep each gradient's arrival time in the latest sampled iteration (``bucket_cap_mb="auto"`` uses them)."""
        self.arrivals = np.full(count, np.nan)

    def mark(self, event: str) -> None:
        if self.sampling:
            self.events[event] = time.perf_counter()

    def grad_arrived(self, index: int, name: str) -> None:
        if self.sampling:
            now = time.perf_counter()
            first = self.events.setdefault("first_grad", now)
            self.events["last_grad"] = now
            if self.arrivals is not None:
                if self._arrivals_of != self.iteration:
                    self.arrivals[:] = np.nan
                    self._arrivals_of = self.iteration
                self.arrivals[index] = now - first
        if self.timeline.enabled:
            self.timeline.instant(f"grad {name}", cat="reducer", lane="reducer grads", args={"index": index})

    def bucket_launched(self, bucket: int, nbytes: int, nparams: int, future) -> None:
        if self.sampling:
            self.events.setdefault("comm_start", time.perf_counter())
        if not self.timeline.enabled:
            return
        start = now_us()
        self.timeline.instant(f"bucket {bucket} launched", cat="reducer", lane="reducer buckets",
                              args={"bytes": nbytes, "params": nparams})

        def done(_future):
            self.timeline.complete(f"bucket {bucket} allreduce", start, cat="reducer", lane="reducer buckets",
                                   args={"bytes": nbytes, "params": nparams, "iteration": self.iteration})

        future.add_done_callback(done)

    def end_iteration(self) -> None:
        if not self.sampling or "comm_start" not in self.events:
            return
        end = time.perf_counter()
        first = self.events.get("first_grad", self.events["comm_start"])
        last = self.events.get("last_grad", first)
        compute = last - first
        comm = end - self.events["comm_start"]
        overlap = max(0.0, last - self.events["comm_start"])
        self.samples.append({"iteration": self.iteration, "backward_compute_s": compute,
                             "backward_comm_s": comm, "overlap_s": overlap})

    def logging_data(self, config: dict) -> dict:
        data = dict(config)
        if self.samples:
            for key in ("backward_compute_s", "backward_comm_s", "overlap_s"):
                data[f"avg_{key}"] = sum(s[key] for s in self.samples) / len(self.samples)
        data["sampled_iterations"] = [s["iteration"] for s in self.samples]
        return data
