"""RRefs: remote references with PyTorch's reference-counting protocol (reference twin).

Twinned with ``core/_rref.pyx``. The component is in two modules, read in this order:
:mod:`distlab.reference.rref_impl` (ids, fork data, the two RRef kinds) and
:mod:`distlab.reference.rref_context` (the per-worker protocol state, which drives them). This module gathers
their names: it is what ``distlab._backend.load("rref")`` returns.

An RRef names a value that lives on one worker, its *owner*. The owner holds the single ``OwnerRRef`` (the value,
as a future); every other worker that holds the RRef holds a ``UserRRef`` with its own fork id. The owner counts
the forks of each RRef and deletes the ``OwnerRRef`` when the count drops to zero. Two guarantees make that safe
without assuming any message order (mirrors rref_impl.h, Note [RRef Protocol], and docs/source/rpc/rref.rst):

G1
    The owner is notified when any UserRRef is deleted (a ``user_delete`` control message, sent exactly once).
G2
    A parent RRef is not deleted until the owner has confirmed the child (the parent keeps a *pending child*
    until a ``child_accept`` arrives; a user is a *pending user* until the owner confirms it).

Nothing here touches MPI: the context emits control messages through an injectable sender, so the same code runs
under the MPI agent (:mod:`distlab.rpc`) and under an in-process deterministic scheduler (the equivalence and
reordering tests). What both twins share verbatim (errors, string forms, the leak report, the valid id ranges)
is written once, in ``distlab._common.rref``.
"""
from __future__ import annotations

from .rref_context import RRefContext
from .rref_impl import GloballyUniqueId, OwnerRRef, RRefForkData, UserRRef, parse_fork_data

__all__ = ["GloballyUniqueId", "RRefForkData", "OwnerRRef", "UserRRef", "RRefContext", "parse_fork_data"]
