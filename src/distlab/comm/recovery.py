"""Rebuilding distlab's groups on the survivors of a failure: revoke, agree, shrink, then new groups.

When a process dies under fault tolerance (:mod:`distlab.comm.ulfm`), every survivor's operation on a group that
holds it fails with :class:`~distlab.errors.ProcessFailedError`. The survivors then call :func:`rebuild`, all of
them (it is collective over the survivors), which:

1. **revokes** the old world's communicator (and those of the groups passed in ``revoke``), so that a survivor
   still inside another operation on them fails out of it and joins the recovery instead of waiting;
2. **agrees** over the survivors (``MPI_Comm_agree``, failures acknowledged): every survivor has arrived, and
   they agree on the failures seen so far;
3. **shrinks** the old world's communicator to the survivors (``MPI_Comm_shrink``: ranks keep their order);
4. makes the new world group on it, which :func:`distlab.comm.world` returns from then on, and the sub-groups
   asked for, each given by its ranks in the old world (dead ranks dropped, the rest renumbered).

Every step is bounded by the timeout: a survivor that never calls it makes the others raise
:class:`~distlab.errors.DistTimeoutError` naming the step and the ranks that should have come.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mpi4py import MPI

from ..futures import resolve_timeout
from . import ulfm
from .group import ProcessGroup, set_world, world

__all__ = ["Rebuilt", "rebuild", "world_ranks", "parent"]


@dataclass
class Rebuilt:
    """What :func:`rebuild` made.

    Attributes
    ----------
    world : ProcessGroup
        The new world group (the survivors); :func:`distlab.comm.world` returns it.
    groups : list
        One entry per rank list passed in: the rebuilt group, or None on a rank not in it (or when none of its
        ranks survived).
    failed_ranks : list of int
        The ranks of ``COMM_WORLD`` (the world the job started with) no longer in the world: every failure so far.
    ranks : dict
        Old world rank -> new world rank, for the survivors.
    seconds : dict
        How long each step took on this rank (``revoke``, ``agree``, ``shrink``, ``world``, ``groups``).
    """

    world: ProcessGroup
    groups: list = field(default_factory=list)
    failed_ranks: list = field(default_factory=list)
    ranks: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


_survivors = None  # the communicator of the world rebuild() made last (None: the job lost no process)


def parent():
    """The communicator a new group of the whole job is made from: None (``COMM_WORLD``, what
    :class:`~distlab.comm.ProcessGroup` takes by default) until :func:`rebuild` shrank the world, then the new
    world's (the collectives engine, started again after a failure, runs over it)."""
    return _survivors


def world_ranks(comm) -> list[int]:
    """The ``COMM_WORLD`` rank of each rank of ``comm``, in ``comm``'s order."""
    group, everyone = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), everyone)]
    finally:
        group.Free()
        everyone.Free()


def _old_to_new(old_comm, new_comm) -> dict[int, int]:
    old_group, new_group = old_comm.Get_group(), new_comm.Get_group()
    try:
        mapped = MPI.Group.Translate_ranks(old_group, list(range(old_group.Get_size())), new_group)
    finally:
        old_group.Free()
        new_group.Free()
    return {old: int(new) for old, new in enumerate(mapped) if new != MPI.UNDEFINED}


def rebuild(groups=(), timeout=None, old: ProcessGroup | None = None, revoke=()) -> Rebuilt:
    """Rebuild the world group, and ``groups``, on the survivors of ``old`` (default: the current world).

    Collective over the survivors: every one of them calls it, with the same ``groups``.

    Parameters
    ----------
    groups : sequence of sequences of int
        Sub-groups to make on the new world, each by its ranks in the *old* world (those that died are dropped).
    timeout : float, optional
        Seconds each step may take; default ``old``'s timeout.
    old : ProcessGroup, optional
        The world that lost processes; default :func:`distlab.comm.world`. It is revoked and destroyed.
    revoke : sequence of ProcessGroup
        Other groups of the old world to revoke and destroy with it (a member's pending work then fails).

    Returns
    -------
    Rebuilt
    """
    ulfm.require("rebuilding the world on the survivors")
    old = world() if old is None else old
    timeout = resolve_timeout(timeout, "rebuild(timeout)", old.timeout)
    specs = [[int(r) for r in ranks] for ranks in groups]
    seconds = {}
    start = time.monotonic()
    for group in (old, *[g for g in revoke if g is not None]):
        ulfm.revoke(group.comm)
    seconds["revoke"] = _lap(start)
    ulfm.agree(old.comm, 1, timeout, old.name)
    seconds["agree"] = _lap(start, seconds)
    shrunk = ulfm.shrink(old.comm, timeout, old.name)
    seconds["shrink"] = _lap(start, seconds)
    ranks = _old_to_new(old.comm, shrunk)
    try:
        new_world = ProcessGroup(shrunk, timeout=timeout, name="world")
    finally:
        shrunk.Free()
    set_world(new_world)
    global _survivors
    _survivors = new_world.comm
    for group in (*[g for g in revoke if g is not None], old):
        group.destroy()
    seconds["world"] = _lap(start, seconds)
    rebuilt = []
    for spec in specs:
        survivors = [ranks[r] for r in spec if r in ranks]
        rebuilt.append(new_world.new_group(survivors, timeout=timeout) if survivors else None)
    seconds["groups"] = _lap(start, seconds)
    alive = set(world_ranks(new_world.comm))
    failed = [r for r in range(MPI.COMM_WORLD.Get_size()) if r not in alive]
    return Rebuilt(new_world, rebuilt, failed, ranks, seconds)


def _lap(start: float, seconds: dict | None = None) -> float:
    """Seconds since ``start`` less the steps already counted."""
    return time.monotonic() - start - sum((seconds or {}).values())
