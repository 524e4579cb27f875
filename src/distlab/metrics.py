"""``DistributedMean``: a metric averaged over every rank at each update, and joinable.

A typical training loop logs a loss averaged over ranks; that allreduce is a collective like any other, so a rank
that ran out of data must shadow it or the others hang (a complaint about the anchor: Join shadows DDP's
collectives but not the user's metrics). Put the metric in the same ``Join`` as the model, after it::

    loss_mean = DistributedMean()
    with Join([ddp_model, loss_mean]):
        for x, y in my_batches:
            loss = loss_fn(ddp_model(x), y)
            loss.backward(); opt.step()
            loss_mean.update(float(loss.data))      # one allreduce per iteration, shadowed by joined ranks
    print(loss_mean.compute())
"""
from __future__ import annotations

import numpy as np

from . import _backend, comm
from ._common.join import HostJoinable, JoinHook

__all__ = ["DistributedMean"]


class _MeanJoinHook(JoinHook):
    """Shadows :meth:`DistributedMean.update` with a zero contribution (zero sum, zero count)."""

    def __init__(self, metric: "DistributedMean"):
        self.metric = metric

    def main_hook(self) -> None:
        self.metric._allreduce(0.0, 0)


class DistributedMean(HostJoinable):
    """The running mean of values reported by every rank, kept identical on every rank.

    Parameters
    ----------
    process_group : distlab.comm.ProcessGroup, optional
        Default: the world group.
    """

    def __init__(self, process_group=None):
        super().__init__()
        self._join = _backend.load("join").Join  # the active twin's (the twins' protocols are the same)
        self.process_group = process_group if process_group is not None else comm.world()
        self.total = 0.0
        self.count = 0
        self.last = float("nan")

    def update(self, value, weight: int = 1) -> float:
        """Add this rank's ``value`` (with ``weight`` samples); return the mean of this step over the ranks."""
        self._join.notify_join_context(self)
        step_total, step_count = self._allreduce(float(value) * weight, int(weight))
        self.last = step_total / step_count if step_count else float("nan")
        return self.last

    def _allreduce(self, total: float, count: int):
        sums = np.array([total, float(count)], dtype=np.float64)
        self.process_group.allreduce(sums, name="metric: DistributedMean")
        self.total += sums[0]
        self.count += int(sums[1])
        return sums[0], int(sums[1])

    def compute(self) -> float:
        """The mean of every value reported so far, on every rank (nan before the first update)."""
        return self.total / self.count if self.count else float("nan")

    def join_hook(self, **kwargs) -> _MeanJoinHook:
        return _MeanJoinHook(self)
