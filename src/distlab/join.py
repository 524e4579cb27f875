"""``distlab.join``: the active twin's Join, JoinHook and Joinable (read :mod:`distlab.reference.join`).

Join matches joinables by protocol, not by class, so a model, optimizer or metric of either twin (and the shared
:class:`~distlab.ddp.DistributedDataParallel` and :class:`~distlab.metrics.DistributedMean`) works under either
twin's Join; those shared classes are registered as virtual subclasses of both twins' ``Joinable``.

How to make your own class joinable:

1. subclass ``distlab.join.Joinable`` and call ``super().__init__()`` in ``__init__``;
2. give it ``join_device`` and ``join_process_group`` properties;
3. call ``Join.notify_join_context(self)`` once per iteration, before the iteration's first collective;
4. return from ``join_hook(**kwargs)`` a ``JoinHook`` whose ``main_hook`` issues exactly the collectives one
   iteration of your class issues (contributing zeros or neutral values), and whose ``post_hook`` does any
   final synchronisation.
"""
from ._backend import load as _load, load_twins as _load_twins
from .ddp import DistributedDataParallel as _DDP
from .metrics import DistributedMean as _DistributedMean

_impl = _load("join")
Join = _impl.Join
JoinHook = _impl.JoinHook
Joinable = _impl.Joinable

for _twin in _load_twins("join").values():
    _twin.Joinable.register(_DDP)
    _twin.Joinable.register(_DistributedMean)

__all__ = ["Join", "JoinHook", "Joinable"]
