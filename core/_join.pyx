# cython: language_level=3
"""Core twin of :mod:`distlab.reference.join` (read that module for the explanation).

Join runs once per iteration, not per tensor, so there is little to gain from typing; the core mirrors the
reference line for line with C-typed loop state and C-level counters, and exists so that the whole join protocol
runs on one twin at a time (equivalence and mixed-world tests drive both).
"""
import warnings
from abc import ABC, abstractmethod

import numpy as np

from distlab._join_support import JoinConfig, early_termination_message, exhausted_message, skew_message

__all__ = ["JoinHook", "Joinable", "Join"]

WARN_THRESHOLD = 1000


class JoinHook:
    """See :class:`distlab.reference.join.JoinHook`."""

    def main_hook(self):
        """See :meth:`distlab.reference.join.JoinHook.main_hook`."""

    def post_hook(self, is_last_joiner):
        """See :meth:`distlab.reference.join.JoinHook.post_hook`."""


class Joinable(ABC):
    """See :class:`distlab.reference.join.Joinable`."""

    @abstractmethod
    def __init__(self):
        """See :class:`distlab.reference.join.Joinable`."""
        super().__init__()
        self._join_config = JoinConfig.disabled()

    @abstractmethod
    def join_hook(self, **kwargs):
        """See :meth:`distlab.reference.join.Joinable.join_hook`."""

    @property
    @abstractmethod
    def join_device(self):
        """See :attr:`distlab.reference.join.Joinable.join_device`."""

    @property
    @abstractmethod
    def join_process_group(self):
        """See :attr:`distlab.reference.join.Joinable.join_process_group`."""


cdef class Join:
    """See :class:`distlab.reference.join.Join`."""
    cdef list _joinables, _join_hooks
    cdef bint _enable, _throw_on_early_termination
    cdef object _process_group, _device
    cdef int _rank
    cdef object _count

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        """See :class:`distlab.reference.join.Join`."""
        if len(joinables) == 0:
            raise ValueError("the join context manager needs at least one joinable")
        self._joinables = list(joinables)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        self._count = np.zeros(1, dtype=np.int64)
        self._set_joinable_configs()
        self._extract_dist_info()

    def _set_joinable_configs(self):
        cdef Py_ssize_t position
        for position, joinable in enumerate(self._joinables):
            joinable._join_config = JoinConfig(self._enable, self._throw_on_early_termination, position == 0)

    def _extract_dist_info(self):
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
        cdef bint all_joined = False, is_last_joiner = True
        cdef long long shadowed = 0
        if not self._enable or exc_type is not None:
            return None
        while not all_joined:
            if shadowed == WARN_THRESHOLD + 1:
                warnings.warn(skew_message(self._rank, WARN_THRESHOLD), stacklevel=2)
            if self._count_nonjoined_ranks() == 0:
                all_joined = True
            else:
                if self._throw_on_early_termination:
                    self._notify_ranks_to_terminate()
                for hook in self._join_hooks:
                    hook.main_hook()
                is_last_joiner = False
                shadowed += 1
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)
        return None

    def _count_nonjoined_ranks(self):
        self._count[0] = 0
        self._process_group.allreduce(self._count, name="join: ranks still training")
        return int(self._count[0])

    def _notify_ranks_to_terminate(self):
        ones = np.ones(1, dtype=np.int64)
        self._process_group.allreduce(ones, name="join: early termination check")
        raise RuntimeError(exhausted_message(self._rank))

    @staticmethod
    def notify_join_context(joinable):
        """See :meth:`distlab.reference.join.Join.notify_join_context`."""
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
