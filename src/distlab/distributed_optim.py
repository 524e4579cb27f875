"""``DistributedOptimizer``: one local optimizer per owner of the parameters, stepped with a distributed autograd
context's gradients (mirrors torch/distributed/optim/optimizer.py ``DistributedOptimizer`` and
``_LocalOptimizer``).

::

    opt = DistributedOptimizer(SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        loss = forward_through_workers(x).sum()
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
"""
from __future__ import annotations

import threading

from distlab import distributed_autograd as _dist_autograd
from distlab import rpc
from distlab.errors import RemoteError

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner: a plain optimizer over its local parameters (torch's _LocalOptimizer)."""

    # torch serialises local steps with one global lock: two contexts stepping concurrently see consistent state
    _lock = threading.Lock()

    def __init__(self, optimizer_class, local_params_rref, *args, **kwargs):
        self._params = [r.local_value() for r in local_params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id):
        grads = _dist_autograd.get_gradients(context_id)
        with _LocalOptimizer._lock:
            saved = [p.grad for p in self._params]
            try:
                # the context's gradients, not .grad (None where this pass gave none: the optimizer skips it)
                for p in self._params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self._params, saved):
                    p.grad = g


def _new_local_optimizer(optimizer_class, local_params_rref, args, kwargs):
    return rpc.RRef(_LocalOptimizer(optimizer_class, local_params_rref, *args, **kwargs))


def _local_step(local_optim_rref, context_id):
    local_optim_rref.local_value().step(context_id)


class DistributedOptimizer:
    """Step parameters spread over workers with the gradients of a distributed autograd context.

    Parameters
    ----------
    optimizer_class : type
        A :class:`distlab.optim.Optimizer` subclass (``SGD``, ``Adam``, ...), built once per owner.
    params_rref : list of RRef
        RRefs to the parameters (Tensors) to optimise, on any workers.
    *args, **kwargs
        Passed to ``optimizer_class`` on each owner.
    """

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        by_owner = {}
        for r in params_rref:
            by_owner.setdefault(r.owner().id, []).append(r)
        futures = [rpc.rpc_async(owner, _new_local_optimizer, (optimizer_class, rrefs, args, kwargs))
                   for owner, rrefs in sorted(by_owner.items())]
        self.remote_optimizers = _wait_all(futures, "create the local optimizers")

    def step(self, context_id):
        """Apply context ``context_id``'s gradients on every owner (concurrently); re-raise the first remote error."""
        _dist_autograd.get_container().retrieve_context(context_id)  # an unknown context fails here, clearly
        futures = [rpc.rpc_async(r.owner().id, _local_step, (r, context_id)) for r in self.remote_optimizers]
        _wait_all(futures, f"step context {context_id}")


def _wait_all(futures, what):
    results, first = [], None
    for fut in futures:
        try:
            results.append(fut.wait())
        except RemoteError as exc:  # wait them all (each bounded by the RPC timeout), then raise the first
            first = first or exc
    if first is not None:
        raise first
    return results
