"""Constants of distributed autograd shared by both container twins (ids cross process boundaries: define once).

Ids (mirrors container.h): a context id and a message id are 64-bit integers, ``worker_id << 48 | counter``,
so every worker mints globally unique ids without talking to anyone.
"""
from __future__ import annotations

__all__ = ["AUTO_INCREMENT_BITS", "AUTO_INCREMENT_MASK", "MAX_WORKER_ID", "NUM_DEFAULT_SHARDS", "INVALID_CONTEXT_ID",
           "worker_of", "counter_of", "NOT_INITIALIZED_MESSAGE", "NO_CURRENT_CONTEXT_MESSAGE",
           "NESTED_CONTEXT_MESSAGE", "K_BACKWARD", "K_PREPARE", "K_CLEANUP"]

#: Low bits of an id that count; the 16 bits above them hold the worker id (container.cpp kAutoIncrementBits).
AUTO_INCREMENT_BITS = 48
AUTO_INCREMENT_MASK = (1 << AUTO_INCREMENT_BITS) - 1
#: Largest worker id that fits in the 16 high bits (container.cpp kMaxWorkerId).
MAX_WORKER_ID = 65535
#: Shards of the context map, each with its own lock (container.h kNumDefaultShards; a power of two).
NUM_DEFAULT_SHARDS = 128
#: "No context" value of a thread's current context id (container.cpp kInvalidContextId).
INVALID_CONTEXT_ID = -1

#: RPC message kinds of distributed autograd (>= distlab._wire.RPC_USER_KIND_BASE; codes travel: never change).
K_BACKWARD = 80  # gradients for a send function: (context id, message id, pass id, retain_graph, grads)
K_PREPARE = 81  # a backward pass starts: (context id, pass id, retain_graph)
K_CLEANUP = 82  # release a context: context id

NOT_INITIALIZED_MESSAGE = (
    "distributed autograd is not initialized on this worker: call distlab.rpc.init_rpc() first "
    "(or distlab.distributed_autograd.init(worker_id))")
NO_CURRENT_CONTEXT_MESSAGE = (
    "Current thread doesn't have a valid autograd context. Please wrap your code using: "
    "`with distlab.distributed_autograd.context() as context_id:` to generate a valid context")
NESTED_CONTEXT_MESSAGE = (
    "Already have an autograd context id for this thread (context {current}); distributed autograd contexts "
    "cannot be nested on one thread")


def worker_of(any_id: int) -> int:
    """The worker that minted a context or message id (its 16 high bits)."""
    return any_id >> AUTO_INCREMENT_BITS


def counter_of(any_id: int) -> int:
    """The per-worker counter part of a context or message id (its 48 low bits)."""
    return any_id & AUTO_INCREMENT_MASK
