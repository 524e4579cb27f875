"""A stateful object's state kept in this process's memory: :func:`snapshot` and :func:`restore`.

What Horovod's elastic ``State.commit()`` keeps (``horovod/common/elastic.py``: ``save`` copies the state in
memory, ``restore`` copies it back): the survivors of a failure roll back to it in the same process, without reading
a checkpoint. :func:`snapshot` walks ``state_dict()`` as :func:`~distlab.checkpoint.save` does (a stateful value, a
sampler, :class:`~distlab.checkpoint.RNGState`, is replaced by its own ``state_dict()``, so it is collective where
those are) and copies every array, so that later steps, which update the parameters in place, leave it alone.
:func:`restore` gives each stateful value back its part, innermost first, then the object its dict, as
:func:`~distlab.checkpoint.load` does: a rank that restores in a smaller world re-splits what it restores there
(an :class:`~distlab.data.ElasticSampler` splits the rest of its epoch among the ranks there are now).

Unlike a checkpoint, a snapshot is this rank's alone: a sharded value (a ZeroRedundancyOptimizer's state) keeps
only this rank's shard, and a dead rank's shard is gone with it.
"""
from __future__ import annotations

import copy

from ..autograd import Tensor
from ._flatten import is_array, is_stateful

__all__ = ["Snapshot", "snapshot", "restore"]


class Snapshot(dict):
    """The copied ``state_dict()`` of one stateful object (its stateful values snapshots themselves)."""


def snapshot(stateful) -> Snapshot:
    """A copy of ``stateful.state_dict()`` that later updates of the object leave alone."""
    return Snapshot(_copy(stateful.state_dict()))


def _copy(value):
    if is_stateful(value):
        return snapshot(value)
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(item) for item in value)
    if isinstance(value, Tensor):
        return value.data.copy()
    if is_array(value):
        return value.copy()
    return copy.deepcopy(value)


def restore(stateful, saved: Snapshot) -> None:
    """Give ``stateful`` back the state ``saved`` holds (the stateful values inside it first)."""
    template = stateful.state_dict()
    stateful.load_state_dict({key: _filled(template.get(key), item) for key, item in saved.items()})


def _filled(template, saved):
    """``saved`` with its stateful values restored into the template's objects, arrays copied once more (the
    object may keep what it is given: the snapshot must stay as it was for the next rollback)."""
    if isinstance(saved, Snapshot):
        restore(template, saved)
        return template
    if isinstance(saved, dict):
        inner = template if isinstance(template, dict) else {}
        return {key: _filled(inner.get(key), item) for key, item in saved.items()}
    if isinstance(saved, (list, tuple)):
        inner = template if isinstance(template, (list, tuple)) and len(template) == len(saved) else [None] * len(saved)
        return type(saved)(_filled(t, item) for t, item in zip(inner, saved))
    if is_array(saved):
        return saved.copy()
    return copy.deepcopy(saved)
