"""Settings of distributed autograd on this worker; set them as attributes of this module, on every worker:

.. code-block:: python

    from distlab.distributed_autograd import config
    config.inline_backward = False
"""
from __future__ import annotations

__all__ = ["inline_backward", "CLEANUP_ATTEMPTS", "RELEASED_MEMORY"]

#: Run the backward part a gradient message triggers on the receiver's RPC listener thread (no thread-pool hop:
#: a chain of workers then passes gradients listener to listener). Backward never waits for a message, so this
#: cannot deadlock unless a tensor hook itself makes a blocking RPC; set it False on every worker for such hooks
#: (the part then runs on the RPC thread pool, as in PyTorch).
inline_backward = True
#: Attempts to release a context on a known worker. All of them together are bounded by the RPC timeout
#: (``DISTLAB_TIMEOUT`` when the RPC timeout is disabled): each attempt gets an equal share of it.
CLEANUP_ATTEMPTS = 3
#: How many released context ids each worker remembers (to refuse RPCs that outlive their context).
RELEASED_MEMORY = 4096
