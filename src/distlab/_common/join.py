"""What both Join twins share, defined once: the Joinable and JoinHook base classes, the join configuration,
Join's construction (checks, hooks, configurations, process group) and its messages.

Both ``distlab.reference.join`` and ``distlab.core._join`` import these, so a joinable written against either twin
(or against :mod:`distlab.join`) is the same class: ``Joinable`` here *is* ``distlab.join.Joinable``. Only what
runs every iteration (``Join.notify_join_context``, ``Join.__exit__``'s shadowing loop and its counting allreduce)
is twinned.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

__all__ = [
    "WARN_THRESHOLD", "COUNT_NAME", "TERMINATION_CHECK_NAME", "JoinConfig", "JoinHook", "Joinable", "HostJoinable", "JoinSetup", "prepare_join",
    "pre_hooks_of", "record_count", "skew_message", "exhausted_message", "early_termination_message", "missing_config_message",
]

#: After this many shadowed iterations Join warns once about the skew of inputs across ranks (as torch).
WARN_THRESHOLD = 1000

#: Names of Join's own collectives (they appear in traces and timeouts; the twins must issue the same ones).
COUNT_NAME = "join: ranks still training"
TERMINATION_CHECK_NAME = "join: early termination check"

#: What a class needs to take part in a Join; quoted by every error about a joinable that is not one.
JOINABLE_CONTRACT = (
    "A Joinable subclasses distlab.join.Joinable, calls super().__init__() in its constructor, implements "
    "join_hook(**kwargs) returning a distlab.join.JoinHook, and has the properties join_device and "
    "join_process_group")

_REQUIRED = ("join_hook", "join_device", "join_process_group")


class JoinConfig(NamedTuple):
    """How a joinable takes part in the enclosing Join (``torch.distributed.algorithms.join._JoinConfig``).

    The twins read it by position (``enable``, ``throw_on_early_termination``, ``is_first_joinable``).
    """

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def disabled() -> "JoinConfig":
        """The configuration outside any Join: nothing to notify."""
        return JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class JoinHook:
    """What a joinable does on a rank that ran out of inputs while other ranks still train.

    Mirrors ``torch.distributed.algorithms.join.JoinHook``; every hook does nothing by default.

    Join calls, on a rank that has left the body of its ``with`` block:

    - :meth:`pre_hook` before each count of the ranks still training (a distlab addition; not in throw mode),
    - :meth:`main_hook` once per iteration that the other ranks still run,
    - :meth:`post_hook` once, when every rank has joined.
    """

    def pre_hook(self) -> None:
        """Post, without waiting, collectives that must be in flight before any main hook blocks.

        A distlab addition, for joinables whose collectives run on a communicator of their own and interleave
        with another joinable's (SyncBatchNorm's statistics inside DDP's backward): every rank inside
        ``Join.__exit__``, the last joiners included, runs the pre hooks before each count, so the set posted
        before the final count is matched by every rank's own. Complete the posted work in the next
        ``pre_hook`` or in :meth:`post_hook`. Not called with ``throw_on_early_termination``.
        """

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration (called once per iteration of the others)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank joined; ``is_last_joiner`` is True on the ranks that joined last."""


class Joinable(ABC):
    """A class whose collectives Join can shadow: a model, an optimizer, a layer, a metric.

    A subclass calls ``super().__init__()`` (which sets the join configuration), returns a :class:`JoinHook`
    from :meth:`join_hook`, tells Join its device and process group, and calls
    ``Join.notify_join_context(self)`` once per iteration before its first collective.
    """

    @abstractmethod
    def __init__(self):
        super().__init__()
        self._join_config = JoinConfig.disabled()

    @abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """Return the hook that shadows this joinable's collectives; ``kwargs`` come from ``Join(...)``."""

    @property
    @abstractmethod
    def join_device(self):
        """Where the join bookkeeping arrays live (``"cpu"``, or a cupy device)."""

    @property
    @abstractmethod
    def join_process_group(self):
        """The process group the joinable communicates over."""


class HostJoinable(Joinable):
    """A Joinable whose collectives run on host memory over ``self.process_group`` (DistributedDataParallel,
    DistributedMean, ZeroRedundancyOptimizer, SyncBatchNorm): Join runs its counting allreduce there, on the CPU."""

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.process_group


class JoinSetup(NamedTuple):
    """What ``Join.__init__`` keeps: the joinables, their hooks, and the one process group and device."""

    joinables: list
    hooks: list
    process_group: Any
    device: Any


def prepare_join(joinables, enable: bool, throw_on_early_termination: bool, hook_kwargs: dict) -> JoinSetup:
    """Check the joinables, make their hooks, hand each its configuration (``Join.__init__``).

    Mirrors torch's ``Join.__init__``, ``_set_joinable_configs`` and ``_extract_dist_info``: only the first
    joinable communicates for Join, and all must share one process group, else their collectives could not be
    matched. Every error is raised before any joinable is touched.
    """
    joinables = list(joinables)
    if not joinables:
        raise ValueError("the join context manager needs at least one joinable")
    for position, joinable in enumerate(joinables):
        _check_joinable(joinable, position)
    group, device = joinables[0].join_process_group, joinables[0].join_device
    for position, joinable in enumerate(joinables[1:], 1):
        if joinable.join_process_group is not group:
            raise ValueError(f"the joinables use different process groups: joinables[0] "
                             f"({type(joinables[0]).__name__}) is on {group!r}, joinables[{position}] "
                             f"({type(joinable).__name__}) on {joinable.join_process_group!r}; Join needs them all "
                             "on one group")
    hooks = [joinable.join_hook(**hook_kwargs) for joinable in joinables]
    for position, joinable in enumerate(joinables):
        joinable._join_config = JoinConfig(bool(enable), bool(throw_on_early_termination), position == 0)
    return JoinSetup(joinables, hooks, group, device)


def _check_joinable(joinable, position: int) -> None:
    missing = [name for name in _REQUIRED if not hasattr(type(joinable), name)]
    if missing:
        raise TypeError(f"Join expects Joinables, but joinables[{position}] is {_describe(joinable)}, which has "
                        f"no {', '.join(missing)}. {JOINABLE_CONTRACT}.")
    if not hasattr(joinable, "_join_config"):
        raise TypeError(f"joinables[{position}] ({_describe(joinable)}) has no join configuration: its constructor "
                        f"must call super().__init__(). {JOINABLE_CONTRACT}.")


def pre_hooks_of(hooks) -> list:
    """The bound ``pre_hook`` of every hook that has one (torch's hooks, and distlab's older ones, have none)."""
    return [hook.pre_hook for hook in hooks if callable(getattr(hook, "pre_hook", None))]


def _describe(obj) -> str:
    cls = type(obj)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"a {name} object"


def record_count(remaining: int) -> int:
    """Note one round of ``Join.__exit__`` on the timeline (lane ``join``): the count, and what follows.

    Returns ``remaining``, so that a twin records and tests the count in one expression.
    """
    from distlab.timeline import get_timeline

    timeline = get_timeline()
    if timeline.enabled:
        timeline.instant(f"count {remaining}: " + ("all joined" if remaining == 0 else "shadow an iteration"),
                         lane="join", args={"still_training": remaining})
    return remaining


def missing_config_message(joinable) -> str:
    return (f"{type(joinable).__name__} has no join configuration: its constructor must call "
            f"Joinable.__init__ (super().__init__()). {JOINABLE_CONTRACT}.")


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
