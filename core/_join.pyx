# cython: language_level=3
"""Core twin of :mod:`distlab.reference.join` (read that module for the explanation).

Compiled here is what runs every iteration: ``notify_join_context`` (every joinable, every iteration) reading the
join configuration by position, and the shadowing loop of ``__exit__`` with C-level state, hook methods bound
once, and the counting allreduce into one reused buffer read through a typed memoryview. Construction, the base
classes and the messages are :mod:`distlab._common.join`'s, shared with the reference.
"""
cimport cython
cimport numpy as cnp

import warnings

import numpy as np

from distlab._common import join as _shared
from distlab._common.join import JoinHook, Joinable

cnp.import_array()

__all__ = ["JoinHook", "Joinable", "Join"]

# Positions of JoinConfig's fields, and the skew threshold, as C constants (checked against the shared module).
cdef enum:
    _ENABLE = 0
    _THROW = 1
    _FIRST = 2
    _SKEW_AFTER = 1000

assert _shared.JoinConfig._fields[_ENABLE] == "enable", _shared.JoinConfig._fields
assert _shared.JoinConfig._fields[_THROW] == "throw_on_early_termination", _shared.JoinConfig._fields
assert _shared.JoinConfig._fields[_FIRST] == "is_first_joinable", _shared.JoinConfig._fields
assert _SKEW_AFTER == _shared.WARN_THRESHOLD, (_SKEW_AFTER, _shared.WARN_THRESHOLD)

cdef str _COUNT = _shared.COUNT_NAME
cdef str _TERMINATION_CHECK = _shared.TERMINATION_CHECK_NAME
cdef object _ONE = np.ones(1, dtype=np.int64)  # copied for every notification (the Work keeps its array)


cdef class Join:
    """See :class:`distlab.reference.join.Join`."""
    cdef list _joinables, _join_hooks, _pre_hooks, _main_hooks
    cdef object _process_group, _device, _count_array
    cdef long long[::1] _count
    cdef bint _enable, _throw_on_early_termination
    cdef int _rank

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        """See :class:`distlab.reference.join.Join`."""
        cdef object setup = _shared.prepare_join(joinables, enable, throw_on_early_termination, kwargs)
        self._joinables = setup.joinables
        self._join_hooks = setup.hooks
        self._pre_hooks = _shared.pre_hooks_of(self._join_hooks)
        self._main_hooks = [h.main_hook for h in self._join_hooks]  # bound once, called every iteration
        self._process_group = setup.process_group
        self._device = setup.device
        self._rank = self._process_group.rank
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._count_array = np.zeros(1, dtype=np.int64)
        self._count = self._count_array

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        """See :meth:`distlab.reference.join.Join.__exit__`."""
        cdef bint last_joiner = True
        cdef bint throw = self._throw_on_early_termination
        cdef long long rounds = 0
        cdef object fn
        if exc_type is not None or not self._enable:
            return None
        while True:
            if rounds == _SKEW_AFTER + 1:
                # a compiled method has no Python frame: level 1 is the user's ``with``, the reference's level 2
                warnings.warn(_shared.skew_message(self._rank, _SKEW_AFTER), stacklevel=1)
            if not throw:  # in throw mode nothing is shadowed, so nothing is posted ahead either
                for fn in self._pre_hooks:
                    fn()
            if _shared.record_count(self._count_nonjoined_ranks()) == 0:
                break
            if throw:
                self._notify_ranks_to_terminate()
            for fn in self._main_hooks:
                fn()
            last_joiner = False
            rounds += 1
        for fn in self._join_hooks:
            fn.post_hook(last_joiner)
        return None

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef long long _count_nonjoined_ranks(self) except -1:
        """See :meth:`distlab.reference.join.Join._count_nonjoined_ranks`."""
        self._count[0] = 0
        self._process_group.allreduce(self._count_array, name=_COUNT)
        return self._count[0]

    cdef int _notify_ranks_to_terminate(self) except -1:
        """See :meth:`distlab.reference.join.Join._notify_ranks_to_terminate`."""
        self._process_group.allreduce(_ONE.copy(), name=_TERMINATION_CHECK)
        raise RuntimeError(_shared.exhausted_message(self._rank))

    @staticmethod
    def notify_join_context(joinable):
        """See :meth:`distlab.reference.join.Join.notify_join_context`."""
        cdef object config = getattr(joinable, "_join_config", None)
        cdef tuple fields
        cdef object pg, work
        if config is None:
            raise AttributeError(_shared.missing_config_message(joinable))
        fields = <tuple>config  # a JoinConfig is a tuple: read its fields by position
        if not (fields[_FIRST] and fields[_ENABLE]):
            return None
        pg = joinable.join_process_group
        work = pg.allreduce(_ONE.copy(), async_op=True, name=_COUNT)
        if fields[_THROW]:
            _check_early_termination(pg)
        return work


# --- core-only helpers ---
cdef int _check_early_termination(object pg) except -1:
    """The training side of J3: a joined rank answers this allreduce with 1 (``_notify_ranks_to_terminate``)."""
    cdef object flag = np.zeros(1, dtype=np.int64)
    cdef long long[::1] seen = flag
    pg.allreduce(flag, name=_TERMINATION_CHECK)
    if seen[0]:
        raise RuntimeError(_shared.early_termination_message(pg.rank))
    return 0
