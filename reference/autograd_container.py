"""Distributed autograd containers, reference twin: ids, contexts, and the per-worker container of contexts.

Twinned with ``core/_autograd_container.pyx``, which includes the twin of :mod:`distlab.reference.autograd_context`.

Mirrors PyTorch's torch/csrc/distributed/autograd/context/container.cpp (``DistAutogradContainer``),
context.cpp (``DistAutogradContext``) and rpc_messages/autograd_metadata.h (``AutogradMetadata``).

One distributed backward pass is identified on every worker by a *context id*; each RPC made inside it by a
*message id* that names one send/recv function pair. Both are 64-bit ``worker_id << 48 | counter`` integers, so
every worker mints ids that are unique across the world without coordination:

- The worker that opens ``with context()`` calls :meth:`DistAutogradContainer.new_context`; the context id is
  minted there. Every worker an RPC of that pass reaches creates the context lazily with the *same* id through
  :meth:`DistAutogradContainer.get_or_create_context`.
- The sender of an RPC mints a message id (:meth:`DistAutogradContainer.new_autograd_message_id`), records its
  ``SendRpcBackward`` under it and the receiver records its ``RecvRpcBackward`` under the same id; in backward the
  receiver's recv function names that id when it sends gradients back, and the sender finds its send function.
- A context holds the pass's gradients (never ``.grad``), the workers it talked to (to release the context on
  all of them when the pass ends) and the futures of gradient RPCs still in flight (first error wins).

The transport (``distlab.distributed_autograd``) is not twinned; this module does no communication.
Every method is thread-safe: RPC handlers run on a thread pool.
"""
from __future__ import annotations

import threading

from distlab._common.autograd_container import (
    AUTO_INCREMENT_BITS,
    AUTO_INCREMENT_MASK,
    INVALID_CONTEXT_ID,
    NUM_DEFAULT_SHARDS,
    ContainerSlot,
    check_container_args,
    check_id,
    context_not_found,
    id_overflow,
    nested_context,
    no_current_context,
)

from .autograd_context import AutogradMetadata, DistAutogradContext

__all__ = ["AutogradMetadata", "DistAutogradContext", "DistAutogradContainer", "init", "get_container",
           "is_initialized", "shutdown"]


class DistAutogradContainer:
    """One worker's contexts, its id counters and each thread's current context (mirrors container.cpp).

    Parameters
    ----------
    worker_id : int
        This worker's id (its RPC rank), in [0, 65535]; the high 16 bits of every id it mints.
    num_shards : int
        Shards of the context map, each with its own lock (a power of two).
    start : int
        Counter of the first id minted (0; tests use it to reach the overflow).

    Raises
    ------
    ValueError
        ``worker_id`` outside [0, 65535], ``num_shards`` not a power of two, ``start`` outside the counter.
    """

    def __init__(self, worker_id: int, num_shards: int = NUM_DEFAULT_SHARDS, start: int = 0):
        # mirrors DistAutogradContainer::init: TORCH_CHECK(worker_id >= 0 && worker_id <= kMaxWorkerId)
        worker_id, num_shards, start = check_container_args(worker_id, num_shards, start)
        self._worker_id = worker_id
        self._num_shards = num_shards
        base = worker_id << AUTO_INCREMENT_BITS
        self._next_context_id = base | start
        self._next_message_id = base | start
        self._max_id = base | AUTO_INCREMENT_MASK  # ids must stay below it (max_id_)
        self._id_lock = threading.Lock()  # the atomics of next_context_id_ / next_autograd_message_id_
        self._shards = [({}, threading.Lock()) for _ in range(num_shards)]  # autograd_contexts_
        self._local = threading.local()  # current_context_id_ is thread_local

    @property
    def worker_id(self) -> int:
        """This worker's id."""
        return self._worker_id

    @property
    def max_id(self) -> int:
        """The bound every id minted here stays below: ``worker_id << 48 | (2**48 - 1)``."""
        return self._max_id

    def _shard(self, context_id):
        # mirrors getShard: context_id & (num_shards - 1)
        return self._shards[context_id & (self._num_shards - 1)]

    # -- ids (mirrors newContext's id and newAutogradMessageId) ---------------------------------------------
    def new_autograd_message_id(self) -> int:
        """Mint a message id for one send/recv pair; AutogradIdOverflowError once the counter is exhausted."""
        with self._id_lock:
            message_id = self._next_message_id
            if message_id < self._max_id:  # check for overflow into the worker id bits (the counter stops there)
                self._next_message_id += 1
        if message_id >= self._max_id:
            raise id_overflow("message id", self._worker_id, self._max_id)
        return message_id

    # -- contexts -------------------------------------------------------------------------------------------
    def new_context(self) -> DistAutogradContext:
        """Open a context with a fresh id and make it this thread's current context (mirrors newContext).

        Raises DistAutogradError if this thread already has a current context (contexts do not nest), and
        AutogradIdOverflowError once the context counter is exhausted.
        """
        current = self.current_context_id()
        if current != INVALID_CONTEXT_ID:
            raise nested_context(current)
        with self._id_lock:
            context_id = self._next_context_id
            if context_id < self._max_id:
                self._next_context_id += 1
        if context_id >= self._max_id:
            raise id_overflow("context id", self._worker_id, self._max_id)
        context = DistAutogradContext(context_id)
        contexts, lock = self._shard(context_id)
        with lock:
            contexts[context_id] = context
        self._local.context_id = context_id
        return context

    def get_or_create_context(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``, created if this worker has none yet (the receiving side of an RPC)."""
        context_id = check_id(context_id)
        contexts, lock = self._shard(context_id)
        with lock:
            context = contexts.get(context_id)
            if context is None:
                context = contexts[context_id] = DistAutogradContext(context_id)
            return context

    def retrieve_context(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``; AutogradContextNotFoundError if it does not exist (mirrors retrieveContext)."""
        context_id = check_id(context_id)
        contexts, lock = self._shard(context_id)
        with lock:
            context = contexts.get(context_id)
        if context is None:
            raise context_not_found(context_id, self._worker_id)
        return context

    def release_context(self, context_id: int) -> set:
        """Drop context ``context_id``; return the workers to tell (mirrors releaseContext).

        Raises AutogradContextNotFoundError if it does not exist. Clears this thread's current context if it was
        that one. The caller sends the release to every returned worker (best effort, with retries).
        """
        context = self._erase(check_id(context_id))
        if context is None:
            raise context_not_found(context_id, self._worker_id)
        return context.known_worker_ids()

    def release_context_if_present(self, context_id: int) -> set:
        """Drop context ``context_id`` if it exists; return its known workers (empty set if it did not exist).

        This is the receiving side of a release message: forwarding it to the returned workers cleans up nested
        RPC chains (worker A called B, B called C: A tells B, B tells C).
        """
        context = self._erase(check_id(context_id))
        return set() if context is None else context.known_worker_ids()

    def _erase(self, context_id):
        # mirrors eraseContextIdAndReset
        contexts, lock = self._shard(context_id)
        with lock:
            context = contexts.pop(context_id, None)
        if context is not None and self.current_context_id() == context_id:
            self._local.context_id = INVALID_CONTEXT_ID
        return context

    def num_autograd_contexts(self) -> int:
        """Contexts alive on this worker."""
        total = 0
        for contexts, lock in self._shards:
            with lock:
                total += len(contexts)
        return total

    def context_ids(self) -> list:
        """Ids of the contexts alive on this worker, sorted."""
        ids = []
        for contexts, lock in self._shards:
            with lock:
                ids.extend(contexts)
        return sorted(ids)

    # -- the thread's current context (current_context_id_ is thread_local) ----------------------------------
    def current_context_id(self) -> int:
        """This thread's current context id, or -1."""
        return getattr(self._local, "context_id", INVALID_CONTEXT_ID)

    def has_valid_context(self) -> bool:
        """True when this thread has a current context that still exists."""
        context_id = self.current_context_id()
        if context_id == INVALID_CONTEXT_ID:
            return False
        contexts, lock = self._shard(context_id)
        with lock:
            return context_id in contexts

    def current_context(self) -> DistAutogradContext:
        """This thread's current context; DistAutogradError with the ``with context()`` hint if there is none."""
        context_id = self.current_context_id()
        if context_id == INVALID_CONTEXT_ID:
            raise no_current_context()
        return self.retrieve_context(context_id)

    def set_current_context_id(self, context_id: int) -> None:
        """Make ``context_id`` this thread's current context (error if it has one: contexts do not nest)."""
        current = self.current_context_id()
        if current != INVALID_CONTEXT_ID:
            raise nested_context(current)
        self._local.context_id = int(context_id)

    def force_current_context_id(self, context_id: int) -> int:
        """Set this thread's current context id unconditionally (-1 clears it); return the previous one.

        How an RPC handler thread adopts the caller's context and restores its own afterwards (mirrors
        DistAutogradContextGuard).
        """
        previous = self.current_context_id()
        self._local.context_id = int(context_id)
        return previous

    def clear_current_context_id(self) -> None:
        """Forget this thread's current context."""
        self._local.context_id = INVALID_CONTEXT_ID


# -- the per-worker singleton (mirrors DistAutogradContainer::init / getInstance) ----------------------------
_slot = ContainerSlot(DistAutogradContainer)


def init(worker_id: int) -> DistAutogradContainer:
    """Create this worker's container (once); calling again with the same id returns it, another id is an error."""
    return _slot.init(worker_id)


def get_container() -> DistAutogradContainer:
    """This worker's container; DistAutogradError if :func:`init` was not called."""
    return _slot.get()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _slot.is_initialized()


def shutdown() -> None:
    """Drop this worker's container (RPC shutdown calls it; a later :func:`init` may use another worker id)."""
    _slot.shutdown()
