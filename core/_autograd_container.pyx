# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.autograd_container` (read that module for the explanation)."""
import threading

from libc.stdint cimport int64_t, uint64_t
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.algorithm cimport sort

from distlab._autograd_shared import (
    AUTO_INCREMENT_BITS,
    AUTO_INCREMENT_MASK,
    INVALID_CONTEXT_ID,
    MAX_WORKER_ID,
    NESTED_CONTEXT_MESSAGE,
    NO_CURRENT_CONTEXT_MESSAGE,
    NOT_INITIALIZED_MESSAGE,
    NUM_DEFAULT_SHARDS,
)
from distlab.autograd.sparse import SparseGrad, add_grads
from distlab.autograd.tensor import Tensor
from distlab.errors import AutogradContextNotFoundError, AutogradIdOverflowError, DistAutogradError
from distlab.futures import Future

__all__ = ["AutogradMetadata", "DistAutogradContext", "DistAutogradContainer", "init", "get_container",
           "is_initialized", "shutdown"]

cdef int _BITS = AUTO_INCREMENT_BITS
cdef uint64_t _MASK = AUTO_INCREMENT_MASK
cdef int64_t _INVALID = INVALID_CONTEXT_ID


def _check_id(value, what="context id"):
    """An autograd id as an int; ValueError unless it is an unsigned 64-bit integer (reference: _check_id)."""
    value = int(value)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"autograd {what}s are unsigned 64-bit integers, got {value}")
    return value


cdef class _AutogradMetadataBase:
    """Typed state and methods of AutogradMetadata; see distlab.reference.autograd_container."""

    cdef public uint64_t context_id
    cdef public uint64_t message_id

    def _init_state(self, context_id, message_id):
        self.context_id = _check_id(context_id)
        self.message_id = _check_id(message_id, "message id")

    def to_tuple(self):
        """See distlab.reference.autograd_container.AutogradMetadata.to_tuple."""
        return (self.context_id, self.message_id)

    def __eq__(self, other):
        return isinstance(other, _AutogradMetadataBase) and self.to_tuple() == other.to_tuple()

    def __hash__(self):
        return hash(self.to_tuple())

    def __repr__(self):
        return f"AutogradMetadata(context_id={self.context_id}, message_id={self.message_id})"



class AutogradMetadata(_AutogradMetadataBase):
    """See distlab.reference.autograd_container.AutogradMetadata."""

    def __init__(self, context_id, message_id):
        """See distlab.reference.autograd_container.AutogradMetadata."""
        self._init_state(context_id, message_id)


cdef class _DistAutogradContextBase:
    """Typed state and methods of DistAutogradContext; see distlab.reference.autograd_container."""

    cdef uint64_t _context_id
    cdef object _lock
    cdef unordered_set[int64_t] _known_workers
    cdef dict _send
    cdef dict _recv
    cdef dict _grads
    cdef list _outstanding
    cdef object _graph_task

    def _init_state(self, context_id):
        self._context_id = _check_id(context_id)
        self._lock = threading.Lock()
        self._send = {}
        self._recv = {}
        self._grads = {}
        self._outstanding = []
        self._graph_task = None

    @property
    def context_id(self):
        """See distlab.reference.autograd_container.DistAutogradContext.context_id."""
        return self._context_id

    def add_known_worker_id(self, worker_id):
        """See distlab.reference.autograd_container.DistAutogradContext.add_known_worker_id."""
        cdef int64_t w = int(worker_id)
        with self._lock:
            self._known_workers.insert(w)

    def known_worker_ids(self):
        """See distlab.reference.autograd_container.DistAutogradContext.known_worker_ids."""
        with self._lock:
            return {w for w in self._known_workers}

    def add_send_function(self, func, message_id):
        """See distlab.reference.autograd_container.DistAutogradContext.add_send_function."""
        self._add_function(self._send, "send", func, message_id)

    def add_recv_function(self, func, message_id):
        """See distlab.reference.autograd_container.DistAutogradContext.add_recv_function."""
        self._add_function(self._recv, "recv", func, message_id)

    cdef _add_function(self, dict table, str what, func, message_id):
        if func is None:
            raise DistAutogradError(f"cannot add a None {what} function to autograd context {self._context_id}")
        cdef uint64_t mid = _check_id(message_id, "message id")
        with self._lock:
            if mid in table:
                raise DistAutogradError(
                    f"autograd context {self._context_id} already has a {what} function for message id {mid}")
            table[mid] = func

    def send_functions(self):
        """See distlab.reference.autograd_container.DistAutogradContext.send_functions."""
        with self._lock:
            return dict(self._send)

    def recv_functions(self):
        """See distlab.reference.autograd_container.DistAutogradContext.recv_functions."""
        with self._lock:
            return dict(self._recv)

    def retrieve_send_function(self, message_id):
        """See distlab.reference.autograd_container.DistAutogradContext.retrieve_send_function."""
        with self._lock:
            func = self._send.get(int(message_id))
        if func is None:
            raise DistAutogradError(
                f"Could not find send function for autograd message id {message_id} in autograd context "
                f"{self._context_id}")
        return func

    def accumulate_grad(self, variable, grad):
        """See distlab.reference.autograd_container.DistAutogradContext.accumulate_grad."""
        cdef list entry
        key = id(variable)
        with self._lock:
            entry = self._grads.get(key)
            if entry is None:
                if isinstance(grad, SparseGrad):
                    own = grad.clone()
                else:
                    own = grad.astype(variable.data.dtype, order="C", copy=True)
                self._grads[key] = [variable, own]
            else:
                entry[1] = add_grads(entry[1], grad)

    def get_gradients(self):
        """See distlab.reference.autograd_container.DistAutogradContext.get_gradients."""
        with self._lock:
            entries = list(self._grads.values())
        return {var: (g if isinstance(g, SparseGrad) else Tensor._wrap(g)) for var, g in entries}

    def add_outstanding_rpc(self, future):
        """See distlab.reference.autograd_container.DistAutogradContext.add_outstanding_rpc."""
        with self._lock:
            self._outstanding.append(future)

    def num_outstanding_rpcs(self):
        """See distlab.reference.autograd_container.DistAutogradContext.num_outstanding_rpcs."""
        with self._lock:
            return len(self._outstanding)

    def clear_outstanding_rpcs(self):
        """See distlab.reference.autograd_container.DistAutogradContext.clear_outstanding_rpcs."""
        with self._lock:
            self._outstanding = []

    def clear_and_wait_for_outstanding_rpcs_async(self):
        """See distlab.reference.autograd_container.DistAutogradContext.clear_and_wait_for_outstanding_rpcs_async."""
        with self._lock:
            futures = self._outstanding
            self._outstanding = []
        result = Future(description=f"outstanding gradient RPCs of autograd context {self._context_id}")
        if not futures:
            result.set_result(None)
            return result
        waiter = _FirstErrorWaiter(result, len(futures))
        for fut in futures:
            fut.add_done_callback(waiter.one_done)
        return result

    def set_graph_task(self, task):
        """See distlab.reference.autograd_container.DistAutogradContext.set_graph_task."""
        with self._lock:
            if self._graph_task is not None:
                raise DistAutogradError(f"autograd context {self._context_id} already has a running backward pass")
            self._graph_task = task

    def retrieve_graph_task(self):
        """See distlab.reference.autograd_container.DistAutogradContext.retrieve_graph_task."""
        return self._graph_task

    def reset_graph_task(self):
        """See distlab.reference.autograd_container.DistAutogradContext.reset_graph_task."""
        with self._lock:
            self._graph_task = None

    def __repr__(self):
        with self._lock:
            known = sorted(w for w in self._known_workers)
            return (f"DistAutogradContext(context_id={self._context_id}, known_workers={known}, "
                    f"send={sorted(self._send)}, recv={sorted(self._recv)}, grads={len(self._grads)})")



class DistAutogradContext(_DistAutogradContextBase):
    """See distlab.reference.autograd_container.DistAutogradContext."""

    def __init__(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContext."""
        self._init_state(context_id)


cdef class _FirstErrorWaiter:
    """Completes ``result`` when all futures succeeded or at the first error (reference: one_done closure)."""

    cdef object result
    cdef Py_ssize_t remaining
    cdef object lock

    def __init__(self, result, Py_ssize_t count):
        self.result = result
        self.remaining = count
        self.lock = threading.Lock()

    def one_done(self, fut):
        exc = fut.exception()
        with self.lock:
            if self.result.done():
                return
            self.remaining -= 1
            if exc is not None:
                self.result.set_exception(exc)
            elif self.remaining == 0:
                self.result.set_result(None)


cdef class _DistAutogradContainerBase:
    """Typed state and methods of DistAutogradContainer; see distlab.reference.autograd_container."""

    cdef uint64_t _worker_id
    cdef uint64_t _num_shards
    cdef uint64_t _next_context_id
    cdef uint64_t _next_message_id
    cdef uint64_t _max_id
    cdef list _shards
    cdef list _locks
    cdef object _local

    def _init_state(self, worker_id, num_shards=NUM_DEFAULT_SHARDS, start=0):
        worker_id, num_shards, start = int(worker_id), int(num_shards), int(start)
        if not 0 <= worker_id <= MAX_WORKER_ID:
            raise ValueError(f"worker_id needs to be in the range [0, {MAX_WORKER_ID}], got {worker_id}")
        if num_shards < 1 or num_shards & (num_shards - 1):
            raise ValueError(f"num_shards must be a power of two, got {num_shards}")
        if not 0 <= start <= AUTO_INCREMENT_MASK:
            raise ValueError(f"start must be in [0, {AUTO_INCREMENT_MASK}], got {start}")
        self._worker_id = worker_id
        self._num_shards = num_shards
        cdef uint64_t base = self._worker_id << _BITS
        self._next_context_id = base | <uint64_t>start
        self._next_message_id = base | <uint64_t>start
        self._max_id = base | _MASK
        self._shards = [{} for _ in range(num_shards)]
        self._locks = [threading.Lock() for _ in range(num_shards)]
        self._local = threading.local()

    @property
    def worker_id(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.worker_id."""
        return self._worker_id

    @property
    def max_id(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.max_id."""
        return self._max_id

    cdef inline Py_ssize_t _shard(self, uint64_t context_id):
        return <Py_ssize_t>(context_id & (self._num_shards - 1))

    def new_autograd_message_id(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.new_autograd_message_id."""
        # the GIL makes this read-increment atomic (nothing in between releases it)
        cdef uint64_t message_id = self._next_message_id
        if message_id < self._max_id:
            self._next_message_id += 1
        if message_id >= self._max_id:
            raise AutogradIdOverflowError(
                f"autograd message id overflow on worker {self._worker_id}: its {_BITS}-bit counter "
                f"is exhausted (max id {self._max_id})")
        return message_id

    def new_context(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.new_context."""
        current = self._current()
        if current != _INVALID:
            raise DistAutogradError(NESTED_CONTEXT_MESSAGE.format(current=current))
        cdef uint64_t context_id = self._next_context_id
        if context_id < self._max_id:
            self._next_context_id += 1
        if context_id >= self._max_id:
            raise AutogradIdOverflowError(
                f"autograd context id overflow on worker {self._worker_id}: its {_BITS}-bit counter "
                f"is exhausted (max id {self._max_id})")
        context = DistAutogradContext(context_id)
        cdef Py_ssize_t s = self._shard(context_id)
        with self._locks[s]:
            (<dict>self._shards[s])[context_id] = context
        self._local.context_id = context_id
        return context

    def get_or_create_context(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.get_or_create_context."""
        cdef uint64_t cid = _check_id(context_id)
        cdef Py_ssize_t s = self._shard(cid)
        cdef dict contexts = self._shards[s]
        with self._locks[s]:
            context = contexts.get(cid)
            if context is None:
                context = DistAutogradContext(cid)
                contexts[cid] = context
            return context

    def retrieve_context(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.retrieve_context."""
        cdef uint64_t cid = _check_id(context_id)
        cdef Py_ssize_t s = self._shard(cid)
        with self._locks[s]:
            context = (<dict>self._shards[s]).get(cid)
        if context is None:
            raise AutogradContextNotFoundError(
                f"Could not find autograd context with id: {cid} on worker {self._worker_id}")
        return context

    def release_context(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.release_context."""
        context = self._erase(_check_id(context_id))
        if context is None:
            raise AutogradContextNotFoundError(
                f"Could not find autograd context with id: {context_id} on worker {self._worker_id}")
        return context.known_worker_ids()

    def release_context_if_present(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.release_context_if_present."""
        context = self._erase(_check_id(context_id))
        return set() if context is None else context.known_worker_ids()

    cdef object _erase(self, uint64_t context_id):
        cdef Py_ssize_t s = self._shard(context_id)
        with self._locks[s]:
            context = (<dict>self._shards[s]).pop(context_id, None)
        if context is not None and self._current() == context_id:
            self._local.context_id = _INVALID
        return context

    def num_autograd_contexts(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.num_autograd_contexts."""
        cdef Py_ssize_t total = 0, s
        for s in range(self._num_shards):
            with self._locks[s]:
                total += len(<dict>self._shards[s])
        return total

    def context_ids(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.context_ids."""
        cdef vector[uint64_t] ids
        cdef Py_ssize_t s
        for s in range(self._num_shards):
            with self._locks[s]:
                for cid in <dict>self._shards[s]:
                    ids.push_back(cid)
        sort(ids.begin(), ids.end())
        return [cid for cid in ids]

    cdef inline object _current(self):
        return getattr(self._local, "context_id", _INVALID)

    def current_context_id(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.current_context_id."""
        return self._current()

    def has_valid_context(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.has_valid_context."""
        current = self._current()
        if current == _INVALID:
            return False
        cdef uint64_t cid = current
        cdef Py_ssize_t s = self._shard(cid)
        with self._locks[s]:
            return cid in <dict>self._shards[s]

    def current_context(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.current_context."""
        current = self._current()
        if current == _INVALID:
            raise DistAutogradError(NO_CURRENT_CONTEXT_MESSAGE)
        return self.retrieve_context(current)

    def set_current_context_id(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.set_current_context_id."""
        current = self._current()
        if current != _INVALID:
            raise DistAutogradError(NESTED_CONTEXT_MESSAGE.format(current=current))
        self._local.context_id = int(context_id)

    def force_current_context_id(self, context_id):
        """See distlab.reference.autograd_container.DistAutogradContainer.force_current_context_id."""
        previous = self._current()
        self._local.context_id = int(context_id)
        return previous

    def clear_current_context_id(self):
        """See distlab.reference.autograd_container.DistAutogradContainer.clear_current_context_id."""
        self._local.context_id = _INVALID



class DistAutogradContainer(_DistAutogradContainerBase):
    """See distlab.reference.autograd_container.DistAutogradContainer."""

    def __init__(self, worker_id, num_shards=NUM_DEFAULT_SHARDS, start=0):
        """See distlab.reference.autograd_container.DistAutogradContainer."""
        self._init_state(worker_id, num_shards, start)


_instance = None
_instance_lock = threading.Lock()


def init(worker_id):
    """See distlab.reference.autograd_container.init."""
    global _instance
    with _instance_lock:
        if _instance is not None:
            if int(worker_id) != _instance.worker_id:
                raise DistAutogradError(
                    f"Container is already initialized with worker_id: {_instance.worker_id}, cannot initialize "
                    f"with different worker_id: {worker_id}")
            return _instance
        _instance = DistAutogradContainer(worker_id)
        return _instance


def get_container():
    """See distlab.reference.autograd_container.get_container."""
    instance = _instance
    if instance is None:
        raise DistAutogradError(NOT_INITIALIZED_MESSAGE)
    return instance


def is_initialized():
    """See distlab.reference.autograd_container.is_initialized."""
    return _instance is not None


def shutdown():
    """See distlab.reference.autograd_container.shutdown."""
    global _instance
    with _instance_lock:
        _instance = None
