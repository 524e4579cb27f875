"""Horovod-style negotiated collectives: submit named arrays in any order, a background thread agrees on what to run.

Every rank submits named collectives asynchronously (``allreduce_async``, ``allgather_async``, ...), in any
order. A background thread runs a *cycle* every ``DISTLAB_CYCLE_TIME`` ms: the controller (the active twin of
:mod:`distlab.reference.negotiation`) finds which named tensors every rank has submitted, through the coordinator
the first time and through the response cache's one bit-vector allreduce once the pattern repeats, fuses small
allreduces into one fusion buffer, and the thread runs the collectives in the same order on every rank.

Example::

    from distlab import collectives as hvd
    hvd.init()
    handles = [hvd.allreduce_async(g, name=f"grad.{i}") for i, g in enumerate(grads)]
    grads = [hvd.synchronize(h) for h in handles]
    hvd.shutdown()

horovod.torch's working set is here: allreduce, grouped_allreduce, allgather, broadcast, alltoall (with splits),
reducescatter, barrier and join, each ``_async`` too and each on a ``process_set``;
:class:`~distlab.collectives.optimizer.DistributedOptimizer`, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object`` and ``allgather_object``; process sets
(``add_process_set``, ``remove_process_set``); ``rank``, ``size``, ``local_rank``, ``local_size``, ``cross_rank``
and ``cross_size``; and Horovod's elastic API (:mod:`distlab.collectives.elastic`: ``elastic.run``, ``State``,
``ObjectState``, ``ModelState``, ``ElasticSampler``) over the launcher's restarts. Ranks are world ranks everywhere (``root_rank``, the value
``join`` returns), as in Horovod.

Settings (environment, read by :func:`init`; Horovod's defaults):

``DISTLAB_CACHE_CAPACITY`` (1024; 0 disables the response cache), ``DISTLAB_FUSION_THRESHOLD`` (bytes,
128 MiB), ``DISTLAB_CYCLE_TIME`` (ms, 1), ``DISTLAB_STALL_CHECK_TIME`` (s, 60; 0 disables),
``DISTLAB_STALL_SHUTDOWN_TIME`` (s, 0 = never), and ``DISTLAB_TIMEOUT`` for every wait.

The cycle thread talks over its own :class:`distlab.comm.ProcessGroup` (a duplicate of COMM_WORLD), so it never
interleaves with the program's own collectives.
"""
from __future__ import annotations

from . import elastic
from . import ops as _ops
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ops import *  # noqa: F403 - the Horovod-style operations, settings, ProcessSet and errors (ops.__all__)
from .optimizer import Compression, DistributedOptimizer

__all__ = [
    *_ops.__all__,
    "DistributedOptimizer", "Compression", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "elastic",
]
