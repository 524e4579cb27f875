"""What both reducer twins share: error messages, runtime statistics and the reducer's timeline.

Defined once so the twins raise word-for-word the same errors and report the same statistics. The messages name
parameters by default (the anchor, reducer.cpp, names them only under ``TORCH_DISTRIBUTED_DEBUG``), since a list of
indices sends users hunting through ``named_parameters()``.
"""
from __future__ import annotations

import time

from .timeline import get_timeline, now_us

__all__ = ["marked_twice", "prior_reduction_unfinished", "static_graph_changed", "grad_mismatch", "ReducerStats"]


def _named(names, indices) -> str:
    return ", ".join(f"{names[i]!r} (index {i})" for i in indices)


def marked_twice(names, index, static_graph: bool, find_unused: bool) -> str:
    """``mark_variable_ready`` saw ``index`` twice in one iteration (``checkAndRaiseMarkedTwiceError``)."""
    causes = [
        "it is used in several reentrant backward passes (for example activation checkpointing); DDP supports "
        "that only with static_graph=True",
        "it is shared by several modules and used more than once, while the graph changes between iterations; "
        "try static_graph=True",
        "two DDP wrappers (or a DDP wrapper and a manual allreduce hook) reduce the same parameter",
    ]
    if find_unused:
        causes.append("find_unused_parameters=True marked it unused, yet a gradient reached it later in the same "
                      "backward pass (its use is hidden from the graph walk)")
    listed = "".join(f"\n  {n}) {c}" for n, c in enumerate(causes, 1))
    return (f"parameter {names[index]!r} (index {index}) was marked ready twice in one backward pass; the DDP "
            f"reducer expects one gradient per parameter per iteration. Likely causes:{listed}")


def prior_reduction_unfinished(rank, names, unmarked, static_graph: bool, find_unused: bool) -> str:
    """A new iteration started before the last one's gradients were all reduced (``ensure_prior_reduction_finished``)."""
    head = ("expected the reduction of the previous iteration to finish before a new one starts. ")
    if static_graph:
        why = ("The training graph changed: with static_graph=True every iteration must use the same parameters "
               "as the first one.")
    elif not find_unused:
        why = ("This happens when the module has parameters that were not used in producing the loss. Pass "
               "find_unused_parameters=True to DistributedDataParallel, and make sure every output of forward "
               "takes part in the loss.")
    else:
        why = ("find_unused_parameters=True is set, so some outputs of forward likely did not take part in the "
               "loss; make sure they all do.")
    return (head + why + f"\nParameters that received no gradient on rank {rank}: {_named(names, unmarked)}")


def static_graph_changed(names, index) -> str:
    """A static graph produced more gradient hooks for a parameter than in its first iteration."""
    return (f"the training graph changed in this iteration: parameter {names[index]!r} (index {index}) received "
            "more gradients than in the first iteration, which static_graph=True does not allow (the set of used "
            "parameters and how often each is used must stay the same)")


def grad_mismatch(names, index, param_dtype, grad) -> str:
    """A gradient of the wrong dtype or layout reached the reducer."""
    kind = "sparse" if getattr(grad, "is_sparse", False) else f"{grad.dtype}"
    return (f"parameter {names[index]!r} (index {index}) has dtype {param_dtype} but its gradient is {kind}; the "
            "reducer needs a dense gradient of the parameter's dtype (a sparse gradient only for parameters "
            "declared sparse, such as Embedding(sparse=True))")


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
        self.launch_us = {}

    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.sampling = _sampled(iteration)
        self.events = {}

    def mark(self, event: str) -> None:
        if self.sampling:
            self.events[event] = time.perf_counter()

    def grad_arrived(self, index: int, name: str) -> None:
        if self.sampling:
            now = time.perf_counter()
            self.events.setdefault("first_grad", now)
            self.events["last_grad"] = now
        if self.timeline.enabled:
            self.timeline.instant(f"grad {name}", cat="reducer", lane="reducer grads", args={"index": index})

    def bucket_launched(self, bucket: int, nbytes: int, nparams: int, future) -> None:
        if self.sampling:
            self.events.setdefault("comm_start", time.perf_counter())
        if not self.timeline.enabled:
            return
        start = now_us()
        self.timeline.instant(f"bucket {bucket} ready", cat="reducer", lane="reducer buckets",
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
