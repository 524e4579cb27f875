"""Join: training on uneven inputs without hangs (mirrors torch/distributed/algorithms/join.py).

Twinned with ``core/_join.pyx``.

The problem: ranks that get different numbers of batches. A rank that runs out stops calling collectives, and the
others wait forever in their next allreduce. Join's answer: a rank that has run out *shadows* the others. Inside
``with Join([model, ...]):`` each training iteration of a rank that still has data starts with an allreduce of 1
(``notify_join_context``, issued by the first joinable). A rank that has run out leaves the ``with`` body and, in
``__exit__``, loops: it allreduces 0 (matching that allreduce) to count the ranks still training; while some are,
it runs every joinable's *main hook*, which issues exactly the collectives one training iteration would issue
(with zeros), so the others' collectives always find a partner. When the count reaches 0 every rank has
joined, and each runs its joinables' *post hooks* (DDP broadcasts the final model from the last rank to join).

Guarantees kept: every rank issues the same sequence of collectives (J1: the count allreduce matches the
notification allreduce; J2: main hooks shadow one iteration exactly), and with ``throw_on_early_termination``
every rank raises instead of shadowing (J3), so nothing hangs.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import numpy as np

from distlab._join_support import JoinConfig, early_termination_message, exhausted_message, skew_message

__all__ = ["JoinHook", "Joinable", "Join"]

#: After this many shadowed iterations Join warns once about the skew of inputs across ranks.
WARN_THRESHOLD = 1000


class JoinHook:
    """What a joinable does while other ranks still train (``main_hook``) and once all joined (``post_hook``).

    Mirrors ``torch.distributed.algorithms.join.JoinHook``; both hooks do nothing by default.
    """

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration (called once per iteration of the others)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank joined; ``is_last_joiner`` is True on the ranks that joined last."""


class Joinable(ABC):
    """A class whose collectives Join can shadow: a model, an optimizer, a metric.

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


class Join:
    """Context manager for uneven inputs: ``with Join([ddp_model, metric]): for batch in my_batches: ...``.

    Parameters
    ----------
    joinables : list
        The joinables; the first one issues Join's own allreduces. All must share one process group.
    enable : bool
        False makes the context manager do nothing (for even inputs).
    throw_on_early_termination : bool
        Raise on every rank as soon as one rank runs out, instead of shadowing.
    **kwargs
        Passed to every ``join_hook`` (e.g. DDP's ``divide_by_initial_world_size``).
    """

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        if len(joinables) == 0:
            raise ValueError("the join context manager needs at least one joinable")
        self._joinables = list(joinables)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._set_joinable_configs()
        self._extract_dist_info()

    def _set_joinable_configs(self):
        """Only the first joinable communicates for Join (``_set_joinable_configs``)."""
        for position, joinable in enumerate(self._joinables):
            joinable._join_config = JoinConfig(self._enable, self._throw_on_early_termination, position == 0)

    def _extract_dist_info(self):
        """One process group for all joinables, else their collectives could not be matched."""
        group, device = None, None
        for joinable in self._joinables:
            if group is None:
                group = joinable.join_process_group
            elif group is not joinable.join_process_group:
                raise ValueError("the joinables use different process groups; Join needs them all on one group")
            if device is None:
                device = joinable.join_device
        self._process_group, self._device = group, device
        self._rank = group.rank

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        """Shadow the others until every rank has joined, then run the post hooks (``Join.__exit__``)."""
        if not self._enable or exc_type is not None:
            return None  # a failing body propagates its own error; peers fail at their next wait (timeout)
        all_joined, is_last_joiner, shadowed = False, True, 0
        while not all_joined:
            if shadowed == WARN_THRESHOLD + 1:
                warnings.warn(skew_message(self._rank, WARN_THRESHOLD), stacklevel=2)
            if self._count_nonjoined_ranks() == 0:  # J1: matches the notification of the ranks still training
                all_joined = True
            else:
                if self._throw_on_early_termination:
                    self._notify_ranks_to_terminate()
                for hook in self._join_hooks:  # J2: one iteration's collectives, with zeros
                    hook.main_hook()
                is_last_joiner = False
                shadowed += 1
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)
        return None

    def _count_nonjoined_ranks(self) -> int:
        """Allreduce 0: the sum is the number of ranks whose notification (1) is in this collective."""
        count = np.zeros(1, dtype=np.int64)
        self._process_group.allreduce(count, name="join: ranks still training")
        return int(count[0])

    def _notify_ranks_to_terminate(self):
        """J3: answer the others' early-termination check with 1, then raise here too."""
        ones = np.ones(1, dtype=np.int64)
        self._process_group.allreduce(ones, name="join: early termination check")
        raise RuntimeError(exhausted_message(self._rank))

    @staticmethod
    def notify_join_context(joinable):
        """Called by a joinable once per iteration before its collectives; returns the allreduce's Work or None.

        Only the first joinable of an enabled Join communicates: it allreduces 1 (counted by joined ranks'
        ``_count_nonjoined_ranks``). With ``throw_on_early_termination`` it then checks whether a rank ran out.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AttributeError(f"{type(joinable).__name__} has no join configuration: its constructor must call "
                                 "Joinable.__init__ (super().__init__())")
        if not config.is_first_joinable or not config.enable:
            return None
        group = joinable.join_process_group
        work = group.allreduce(np.ones(1, dtype=np.int64), async_op=True, name="join: ranks still training")
        if config.throw_on_early_termination:
            flag = np.zeros(1, dtype=np.int64)
            group.allreduce(flag, name="join: early termination check")
            if flag[0]:
                raise RuntimeError(early_termination_message(group.rank))
        return work
