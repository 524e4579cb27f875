"""``distlab.join``: the active twin's Join, and the JoinHook and Joinable base classes (read
:mod:`distlab.reference.join`).

``Joinable`` and ``JoinHook`` are defined once (in ``distlab._common.join``) and shared by both twins, so a model,
optimizer, layer or metric written against either twin, or against this module, works under either twin's Join.

How to make your own class joinable:

1. subclass ``distlab.join.Joinable`` and call ``super().__init__()`` in ``__init__``;
2. give it ``join_device`` and ``join_process_group`` properties;
3. call ``Join.notify_join_context(self)`` once per iteration, before the iteration's first collective;
4. return from ``join_hook(**kwargs)`` a ``JoinHook`` whose ``main_hook`` issues exactly the collectives one
   iteration of your class issues (contributing zeros or neutral values), and whose ``post_hook`` does any
   final synchronisation.

The joinables of distlab: :class:`~distlab.ddp.DistributedDataParallel`,
:class:`~distlab.optim.ZeroRedundancyOptimizer`, :class:`~distlab.nn.SyncBatchNorm` and
:class:`~distlab.metrics.DistributedMean`.
"""
from ._backend import load as _load

_impl = _load("join")
Join = _impl.Join
JoinHook = _impl.JoinHook
Joinable = _impl.Joinable

__all__ = ["Join", "JoinHook", "Joinable"]
