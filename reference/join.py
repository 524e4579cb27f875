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

What runs once lives in :mod:`distlab._common.join`, shared by both twins: the :class:`~distlab.join.Joinable`
and :class:`~distlab.join.JoinHook` base classes, the checks of ``Join(...)``'s arguments, and the messages.
This module is the per-iteration protocol.

Guarantees kept: every rank issues the same sequence of collectives (J1: the count allreduce matches the
notification allreduce; J2: main hooks shadow one iteration exactly), with ``throw_on_early_termination``
every rank raises instead of shadowing (J3), and what a pre hook posts ahead is always matched (J4), so nothing
hangs.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from distlab._common.join import (
    COUNT_NAME,
    TERMINATION_CHECK_NAME,
    WARN_THRESHOLD,
    JoinHook,
    Joinable,
    early_termination_message,
    exhausted_message,
    missing_config_message,
    pre_hooks_of,
    prepare_join,
    record_count,
    skew_message,
)

if TYPE_CHECKING:
    from distlab.comm import Work

__all__ = ["JoinHook", "Joinable", "Join"]


class Join:
    """Context manager for uneven inputs: ``with Join([ddp_model, metric]): for batch in my_batches: ...``.

    Parameters
    ----------
    joinables : list of Joinable
        The joinables; the first one issues Join's own allreduces. All must share one process group.
    enable : bool
        False makes the context manager do nothing (for even inputs).
    throw_on_early_termination : bool
        Raise on every rank as soon as one rank runs out, instead of shadowing.
    **kwargs
        Passed to every ``join_hook`` (e.g. DDP's ``divide_by_initial_world_size``).

    Raises
    ------
    ValueError
        No joinable, or joinables on different process groups.
    TypeError
        An object that is not a Joinable (the message says what a Joinable needs).
    """

    def __init__(self, joinables: Sequence[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any) -> None:
        # Checks, hooks and configurations (only the first joinable communicates) are shared with the core.
        setup = prepare_join(joinables, enable, throw_on_early_termination, kwargs)
        self._joinables, self._join_hooks = setup.joinables, setup.hooks
        self._pre_hooks = pre_hooks_of(setup.hooks)
        self._process_group, self._device = setup.process_group, setup.device
        self._rank = setup.process_group.rank
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        """Shadow the others until every rank has joined, then run the post hooks (mirrors ``Join.__exit__``)."""
        if not self._enable or exc_type is not None:
            return None  # a failing body propagates its own error; peers fail at their next wait (timeout)
        all_joined, is_last_joiner, shadowed = False, True, 0
        while not all_joined:
            if shadowed == WARN_THRESHOLD + 1:
                warnings.warn(skew_message(self._rank, WARN_THRESHOLD), stacklevel=2)
            if not self._throw_on_early_termination:
                for pre_hook in self._pre_hooks:  # J4: posted before every count, the last one included
                    pre_hook()
            if record_count(self._count_nonjoined_ranks()) == 0:  # J1: matches the ranks' notification
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
        self._process_group.allreduce(count, name=COUNT_NAME)
        return int(count[0])

    def _notify_ranks_to_terminate(self):
        """J3: answer the others' early-termination check with 1, then raise here too."""
        ones = np.ones(1, dtype=np.int64)
        self._process_group.allreduce(ones, name=TERMINATION_CHECK_NAME)
        raise RuntimeError(exhausted_message(self._rank))

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Called by a joinable once per iteration before its collectives; returns the allreduce's Work or None.

        Only the first joinable of an enabled Join communicates: it allreduces 1 (counted by joined ranks'
        ``_count_nonjoined_ranks``). With ``throw_on_early_termination`` it then checks whether a rank ran out.

        Raises
        ------
        AttributeError
            ``joinable`` never called ``Joinable.__init__``.
        RuntimeError
            With ``throw_on_early_termination``, when another rank ran out of inputs (J3).
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise AttributeError(missing_config_message(joinable))
        if not config.is_first_joinable or not config.enable:
            return None
        group = joinable.join_process_group
        work = group.allreduce(np.ones(1, dtype=np.int64), async_op=True, name=COUNT_NAME)
        if config.throw_on_early_termination:
            flag = np.zeros(1, dtype=np.int64)
            group.allreduce(flag, name=TERMINATION_CHECK_NAME)
            if flag[0]:
                raise RuntimeError(early_termination_message(group.rank))
        return work
