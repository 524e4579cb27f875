"""What both twins of the distributed autograd containers share: constants, argument checks, error messages, the
per-worker singleton, and the helpers that run once per pass rather than once per message.

The twins (:mod:`distlab.reference.autograd_container`, ``distlab.core._autograd_container``) keep only the
per-message path: minting ids, finding a context in the sharded map, recording send/recv functions and known
workers, accumulating gradients. Everything here runs at construction, once per pass, or to format an error, and
is written once.

Ids (mirrors container.h): a context id and a message id are 64-bit integers, ``worker_id << 48 | counter``, so
every worker mints globally unique ids without talking to anyone.
"""
from __future__ import annotations

import threading

from distlab.autograd.sparse import SparseGrad
from distlab.autograd.tensor import Tensor
from distlab.errors import AutogradContextNotFoundError, AutogradIdOverflowError, DistAutogradError
from distlab.futures import Future

__all__ = ["AUTO_INCREMENT_BITS", "AUTO_INCREMENT_MASK", "MAX_WORKER_ID", "NUM_DEFAULT_SHARDS", "INVALID_CONTEXT_ID",
           "worker_of", "counter_of", "check_id", "check_container_args", "context_not_found", "id_overflow",
           "nested_context", "no_current_context", "not_initialized", "function_error", "send_function_not_found",
           "backward_already_running", "describe_context", "private_copy", "gradients_as_tensors",
           "first_error_future", "ContainerSlot"]

#: Low bits of an id that count; the 16 bits above them hold the worker id (container.cpp kAutoIncrementBits).
AUTO_INCREMENT_BITS = 48
AUTO_INCREMENT_MASK = (1 << AUTO_INCREMENT_BITS) - 1
#: Largest worker id that fits in the 16 high bits (container.cpp kMaxWorkerId).
MAX_WORKER_ID = 65535
#: Shards of the context map, each with its own lock (container.h kNumDefaultShards; a power of two).
NUM_DEFAULT_SHARDS = 128
#: "No context" value of a thread's current context id (container.cpp kInvalidContextId).
INVALID_CONTEXT_ID = -1


def worker_of(any_id: int) -> int:
    """The worker that minted a context or message id (its 16 high bits)."""
    return any_id >> AUTO_INCREMENT_BITS


def counter_of(any_id: int) -> int:
    """The per-worker counter part of a context or message id (its 48 low bits)."""
    return any_id & AUTO_INCREMENT_MASK


# -- argument checks --------------------------------------------------------------------------------------------
def check_id(value, what: str = "context id") -> int:
    """An autograd id as an int; ValueError unless it is an unsigned 64-bit integer."""
    value = int(value)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"autograd {what}s are unsigned 64-bit integers, got {value}")
    return value


def check_container_args(worker_id, num_shards, start) -> tuple[int, int, int]:
    """A container's constructor arguments as ints; ValueError naming the one out of range.

    Mirrors DistAutogradContainer::init's ``TORCH_CHECK(worker_id >= 0 && worker_id <= kMaxWorkerId)``; the number
    of shards must be a power of two (an id picks its shard with a mask) and ``start`` (the first counter value,
    which tests use to reach the overflow) must fit in the counter bits.
    """
    worker_id, num_shards, start = int(worker_id), int(num_shards), int(start)
    if not 0 <= worker_id <= MAX_WORKER_ID:
        raise ValueError(f"worker_id needs to be in the range [0, {MAX_WORKER_ID}], got {worker_id}")
    if num_shards < 1 or num_shards & (num_shards - 1):
        raise ValueError(f"num_shards must be a power of two, got {num_shards}")
    if not 0 <= start <= AUTO_INCREMENT_MASK:
        raise ValueError(f"start must be in [0, {AUTO_INCREMENT_MASK}], got {start}")
    return worker_id, num_shards, start


# -- errors (returned, for the caller to raise: the traceback then points at the twin) ---------------------------
def context_not_found(context_id, worker_id) -> AutogradContextNotFoundError:
    """retrieveContext's "could not find autograd context"."""
    return AutogradContextNotFoundError(f"Could not find autograd context with id: {context_id} on worker {worker_id}")


def id_overflow(what: str, worker_id, max_id) -> AutogradIdOverflowError:
    """A worker's ``what`` ("context id" or "message id") counter reached the worker id bits."""
    return AutogradIdOverflowError(
        f"autograd {what} overflow on worker {worker_id}: its {AUTO_INCREMENT_BITS}-bit counter is exhausted "
        f"(max id {max_id})")


def nested_context(current) -> DistAutogradError:
    """newContext on a thread that has a current context already (contexts do not nest)."""
    return DistAutogradError(
        f"Already have an autograd context id for this thread (context {current}); distributed autograd contexts "
        "cannot be nested on one thread")


def no_current_context() -> DistAutogradError:
    """currentContext without one, with the ``with context()`` hint."""
    return DistAutogradError(
        "Current thread doesn't have a valid autograd context. Please wrap your code using: "
        "`with distlab.distributed_autograd.context() as context_id:` to generate a valid context")


def not_initialized() -> DistAutogradError:
    """getInstance before init."""
    return DistAutogradError(
        "distributed autograd is not initialized on this worker: call distlab.rpc.init_rpc() first "
        "(or distlab.distributed_autograd.init(worker_id))")


def function_error(context_id, what: str, message_id) -> DistAutogradError:
    """addSendFunction / addRecvFunction with no function (``message_id`` None) or an id already used."""
    if message_id is None:
        return DistAutogradError(f"cannot add a None {what} function to autograd context {context_id}")
    return DistAutogradError(
        f"autograd context {context_id} already has a {what} function for message id {message_id}")


def send_function_not_found(context_id, message_id) -> DistAutogradError:
    """retrieveSendFunction of an unknown message id."""
    return DistAutogradError(
        f"Could not find send function for autograd message id {message_id} in autograd context {context_id}")


def backward_already_running(context_id) -> DistAutogradError:
    """setGraphTask while a pass of the context is attached."""
    return DistAutogradError(f"autograd context {context_id} already has a running backward pass")


def describe_context(context_id, known_workers, send_ids, recv_ids, num_grads) -> str:
    """A context's ``repr``: its id, known workers, send and recv message ids, and how many gradients it holds."""
    return (f"DistAutogradContext(context_id={context_id}, known_workers={sorted(known_workers)}, "
            f"send={sorted(send_ids)}, recv={sorted(recv_ids)}, grads={num_grads})")


# -- gradients --------------------------------------------------------------------------------------------------
def private_copy(variable, grad):
    """The first gradient a context stores for ``variable``: a copy of its own, in the variable's dtype.

    Private, so that a dict returned by ``get_gradients`` earlier never changes under its holder (later gradients
    are added out of place) and so that the engine's arrays, which other nodes may share, are never aliased.
    """
    if isinstance(grad, SparseGrad):
        return grad.clone()
    return grad.astype(variable.data.dtype, order="C", copy=True)


def gradients_as_tensors(entries) -> dict:
    """``{variable: gradient}`` from ``[(variable, array or SparseGrad)]``; dense arrays are wrapped as Tensors."""
    return {var: (g if isinstance(g, SparseGrad) else Tensor._wrap(g)) for var, g in entries}


# -- outstanding RPCs -------------------------------------------------------------------------------------------
def first_error_future(futures, context_id) -> Future:
    """A Future completed when every one of ``futures`` succeeded, or at once with the first error.

    Mirrors clearAndWaitForOutstandingRpcsAsync: the first error wins and ends the wait, so a failed worker
    cannot stall the pass behind RPCs that will never be answered.
    """
    result = Future(description=f"outstanding gradient RPCs of autograd context {context_id}")
    if not futures:
        result.set_result(None)
        return result
    remaining = len(futures)
    lock = threading.Lock()

    def one_done(fut):
        nonlocal remaining
        exc = fut.exception()
        with lock:
            if result.done():
                return
            remaining -= 1
            if exc is not None:
                result.set_exception(exc)
            elif remaining == 0:
                result.set_result(None)

    for fut in futures:
        fut.add_done_callback(one_done)
    return result


# -- the per-worker singleton -----------------------------------------------------------------------------------
class ContainerSlot:
    """Holds one worker's container (mirrors DistAutogradContainer::init / getInstance).

    Parameters
    ----------
    factory : type
        The twin's container class, called as ``factory(worker_id)``.
    """

    def __init__(self, factory):
        self._factory = factory
        self._instance = None
        self._lock = threading.Lock()

    def init(self, worker_id):
        """Create the container (once); again with the same id returns it, another id is an error."""
        with self._lock:
            if self._instance is not None:
                if int(worker_id) != self._instance.worker_id:
                    raise DistAutogradError(
                        f"Container is already initialized with worker_id: {self._instance.worker_id}, cannot "
                        f"initialize with different worker_id: {worker_id}")
                return self._instance
            self._instance = self._factory(worker_id)
            return self._instance

    def get(self):
        """The container; DistAutogradError if :meth:`init` was not called."""
        instance = self._instance
        if instance is None:
            raise not_initialized()
        return instance

    def is_initialized(self) -> bool:
        """True between :meth:`init` and :meth:`shutdown`."""
        return self._instance is not None

    def shutdown(self) -> None:
        """Drop the container (a later :meth:`init` may use another worker id)."""
        with self._lock:
            self._instance = None
