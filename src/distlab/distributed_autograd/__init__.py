"""Distributed autograd over distlab.rpc (mirrors torch.distributed.autograd and torch.distributed.optim).

::

    from distlab import distributed_autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", f, args=(x, w)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: gradient}, .grad untouched
        opt.step(context_id)                               # opt = dist_autograd.DistributedOptimizer(...)

RPCs made inside a context (``rpc_sync``, ``rpc_async``, ``remote``, ``RRef.to_here`` and the RRef proxies)
carry autograd metadata; ``backward`` follows them back across the workers; leaving the context releases it on
every worker it reached. The package, one job per module:

- :mod:`.api`: ``context``, ``get_gradients``, ``init``, ``get_container``, ``debug_info``;
- :mod:`.forward`: the call wrapper (registered with :mod:`distlab.rpc.wrappers`) that records send/recv
  functions, and tensors over the wire;
- :mod:`.engine`: send/recv functions, graph tasks and the engine loop of one worker's part of a pass;
- :mod:`.backward_pass`: ``backward`` and the messages that carry a pass between workers;
- :mod:`.cleanup`: releasing a context on every worker it reached;
- :mod:`.optimizer`: ``DistributedOptimizer``;
- :mod:`.config`: settings (``config.inline_backward``); ``_state``: the container twin, the attachment to the
  RPC agent, the timeout.

The containers are twinned (``distlab._backend.load("autograd_container")``: :mod:`distlab.reference.autograd_container`
and its core twin). Distributed autograd attaches to the RPC agent on first use (the first ``context()``, or the
first RPC of a context reaching this worker): it initialises the container with the RPC rank, registers its message
handlers and its call wrapper. distlab.rpc never imports this package.
"""
from __future__ import annotations

from . import config
from .api import context, debug_info, get_container, get_gradients, init
from .backward_pass import backward
from .cleanup import handle_cleanup as _handle_cleanup  # noqa: F401 - registers the release handler
from .forward import wrap_call as _wrap_call  # noqa: F401 - provides the call wrapper, registers tensor pickling
from .optimizer import DistributedOptimizer

__all__ = ["context", "backward", "get_gradients", "DistributedOptimizer", "init", "get_container", "debug_info",
           "config"]
