"""What both Join twins share: the join configuration type and the messages (defined once, word for word)."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["JoinConfig", "HostJoinable", "skew_message", "exhausted_message", "early_termination_message"]


class JoinConfig(NamedTuple):
    """How a joinable takes part in the enclosing Join (``torch.distributed.algorithms.join._JoinConfig``)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def disabled() -> "JoinConfig":
        """The configuration outside any Join: nothing to notify."""
        return JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class HostJoinable:
    """The two Joinable properties of an object whose collectives run on host memory over ``self.process_group``
    (DistributedDataParallel, DistributedMean): Join runs its counting allreduce there, on the CPU."""

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.process_group


def skew_message(rank: int, threshold: int) -> str:
    return (f"rank {rank} has shadowed more than {threshold} iterations of the ranks still training: it has at "
            f"least {threshold} fewer inputs than they do. Such uneven inputs cost every rank time; consider "
            "balancing the data across ranks")


def exhausted_message(rank: int) -> str:
    return (f"rank {rank} exhausted its inputs, and Join was asked to throw on early termination "
            "(throw_on_early_termination=True): every rank raises now")


def early_termination_message(rank: int) -> str:
    return (f"rank {rank}: another rank exhausted its inputs, and Join was asked to throw on early termination "
            "(throw_on_early_termination=True): every rank raises now")
