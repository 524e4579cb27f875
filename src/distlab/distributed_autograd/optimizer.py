"""``DistributedOptimizer``: one local optimizer per owner of the parameters, stepped with a distributed autograd
context's gradients (mirrors torch/distributed/optim/optimizer.py ``DistributedOptimizer`` and
``_LocalOptimizer``; torch has it as ``torch.distributed.optim.DistributedOptimizer``, here it is
``distlab.distributed_autograd.DistributedOptimizer``).

::

    from distlab.distributed_autograd import DistributedOptimizer

    opt = DistributedOptimizer(SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as context_id:
        loss = forward_through_workers(x).sum()
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
"""
from __future__ import annotations

import threading

from distlab import rpc
from distlab.errors import DistTimeoutError, RemoteError

from . import _state
from .api import get_container, get_gradients

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner: a plain optimizer over its local parameters (torch's _LocalOptimizer)."""

    # torch serialises local steps with one global lock: two contexts stepping concurrently see consistent state
    _lock = threading.Lock()

    def __init__(self, optimizer_class, local_params_rref, *args, **kwargs):
        self._params = [r.local_value() for r in local_params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id):
        grads = get_gradients(context_id)
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
        owners = sorted(by_owner)
        futures = [rpc.rpc_async(owner, _new_local_optimizer, (optimizer_class, by_owner[owner], args, kwargs))
                   for owner in owners]
        self.remote_optimizers = _wait_all(futures, owners, "create the local optimizers")

    def step(self, context_id):
        """Apply context ``context_id``'s gradients on every owner (concurrently); re-raise the first remote error.

        Raises
        ------
        AutogradContextNotFoundError
            No context ``context_id`` on this worker.
        RemoteError
            A local optimizer raised (the first error; every owner is waited for first).
        DistTimeoutError
            An owner did not answer within the RPC timeout (named, with the context id).
        """
        get_container().retrieve_context(context_id)  # an unknown context fails here, clearly
        owners = [r.owner().id for r in self.remote_optimizers]
        futures = [rpc.rpc_async(owner, _local_step, (r, context_id))
                   for owner, r in zip(owners, self.remote_optimizers)]
        _wait_all(futures, owners, f"step with autograd context {context_id}")


def _wait_all(futures, owners, what):
    """Wait for every owner's answer (together bounded by the RPC timeout), then raise the first error."""
    limit = _state.timeout(rpc.get_agent())
    results, first = [], None
    for owner, fut in zip(owners, futures):
        try:
            results.append(fut.wait(limit + 1.0))  # the RPC's own timeout, which names the worker, fires first
        except RemoteError as exc:
            first = first or exc
        except DistTimeoutError as exc:
            first = first or DistTimeoutError(
                f"DistributedOptimizer ({what}): worker {owner} did not answer within {limit:g} s: {exc}",
                op=f"DistributedOptimizer {what}", missing_ranks=[owner], timeout=limit)
    if first is not None:
        raise first
    return results
