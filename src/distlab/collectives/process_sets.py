"""Process sets: collectives among a subset of the ranks, each with its own coordinator and response cache.

Mirrors horovod/common/process_set.h and horovod/torch's ``ProcessSet``, ``add_process_set`` and
``remove_process_set``. Every rank belongs to the global process set (id 0). ``add_process_set(ranks)`` is
collective over every rank (as Horovod's): the ranks agree on the new set through the global set's negotiation,
then the set's members build its communicator, its controller (the active negotiation twin) and its cache, all in
the same cycle; from then on the set negotiates its own tensors, so sets with disjoint or overlapping members run
side by side. Pass ``process_set=`` to any collective.
"""
from __future__ import annotations

from .._wire import GLOBAL_PROCESS_SET_ID
from . import _engine

__all__ = ["ProcessSet", "global_process_set"]


class ProcessSet:
    """A set of ranks running collectives together (``horovod.torch.ProcessSet``).

    Parameters
    ----------
    ranks : sequence of int, optional
        The ranks of the set in the world (sorted, distinct); None for the global set (every rank).

    Attributes
    ----------
    process_set_id : int or None
        The set's id once registered (0 for the global set), None before ``add_process_set`` or after
        ``remove_process_set``.
    ranks : list of int or None
        Its ranks (None for the global set before init).
    """

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id = GLOBAL_PROCESS_SET_ID if ranks is None else None

    def _state(self):
        return _engine.get().process_set_state(self)

    def size(self) -> int:
        """How many ranks the set has."""
        return self._state().size_in_world()

    def rank(self) -> int:
        """This rank's rank within the set (-1 when it is not a member)."""
        state = self._state()
        return state.rank if state.member else -1

    def included(self) -> bool:
        """True when this rank belongs to the set."""
        return self._state().member

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (other.process_set_id,
                                                                                       other.ranks)

    def __hash__(self):
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __repr__(self) -> str:
        ranks = "all ranks" if self.ranks is None else f"ranks={self.ranks}"
        return f"ProcessSet(process_set_id={self.process_set_id}, {ranks})"


#: The set of every rank (id 0): the default ``process_set`` of every collective.
global_process_set = ProcessSet()
