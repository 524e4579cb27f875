# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.autograd_context` and :mod:`distlab.reference.autograd_container`.

Read the reference twin for the explanation. What is compiled here is what runs per RPC and per gradient: minting
ids (``uint64_t`` counters), finding a context in the sharded map (one C lock per shard), recording known workers
(a C++ set), send and recv functions, and accumulating gradients. Argument checks, error messages, the per-worker
singleton and the once-per-pass helpers are :mod:`distlab._common.autograd_container`, shared with the reference.
Laid out like the reference, file for file: the context (``_autograd_context.pxi``) is included below, then the
container.
"""
cimport cython
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport int64_t, uint64_t
from libcpp.algorithm cimport sort
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector

import threading

# What is not compiled (argument checks, error messages, once-per-pass helpers) is called as _shared.name:
# the prefix marks, at each call, code that both twins share.
from distlab._common import autograd_container as _shared
from distlab._common.autograd_container import NUM_DEFAULT_SHARDS, check_id
from distlab.autograd.sparse import add_grads

__all__ = ["AutogradMetadata", "DistAutogradContext", "DistAutogradContainer", "init", "get_container",
           "is_initialized", "shutdown"]

cdef enum:
    _BITS = 48  # container.cpp kAutoIncrementBits
cdef uint64_t _MASK = ((<uint64_t>1) << _BITS) - 1
cdef int _NO_CONTEXT = -1  # kInvalidContextId

if (_BITS, _MASK, _NO_CONTEXT) != (_shared.AUTO_INCREMENT_BITS, _shared.AUTO_INCREMENT_MASK,
                                   _shared.INVALID_CONTEXT_ID):
    raise ImportError("distlab.core._autograd_container was compiled with id constants that differ from "
                      "distlab._common.autograd_container: rebuild the core (make build)")

include "_autograd_context.pxi"


cdef class DistAutogradContainer:
    """See :class:`distlab.reference.autograd_container.DistAutogradContainer`."""

    cdef uint64_t _worker_id
    cdef uint64_t _shard_mask  # num_shards - 1: an id's shard is id & mask
    cdef uint64_t _next_context_id
    cdef uint64_t _next_message_id
    cdef uint64_t _max_id
    cdef list _shards  # one dict (context id -> context) per shard
    cdef vector[PyThread_type_lock] _shard_locks
    cdef object _local  # current_context_id_ is thread_local

    def __cinit__(self, *args, **kwargs):
        # one shard however the object was made, so that the unchecked shard indexing below is always in range
        self._shards = [{}]
        self._add_shard_lock()
        self._local = threading.local()

    def __init__(self, worker_id, num_shards=NUM_DEFAULT_SHARDS, start=0):
        worker_id, num_shards, start = _shared.check_container_args(worker_id, num_shards, start)
        self._worker_id = worker_id
        cdef uint64_t first = (self._worker_id << _BITS) | <uint64_t>start
        self._next_context_id = first
        self._next_message_id = first
        self._max_id = (self._worker_id << _BITS) | _MASK
        self._shards = [{} for _ in range(num_shards)]
        while self._shard_locks.size() < <size_t>num_shards:
            self._add_shard_lock()
        self._shard_mask = num_shards - 1  # last: every shard exists before an id can reach it

    def __dealloc__(self):
        cdef PyThread_type_lock lock
        for lock in self._shard_locks:
            if lock is not NULL:
                PyThread_free_lock(lock)

    cdef _add_shard_lock(self):
        cdef PyThread_type_lock lock = PyThread_allocate_lock()
        if lock is NULL:
            raise MemoryError("could not allocate the shard locks of the distributed autograd container")
        self._shard_locks.push_back(lock)

    @property
    def worker_id(self):
        """See :attr:`distlab.reference.autograd_container.DistAutogradContainer.worker_id`."""
        return self._worker_id

    @property
    def max_id(self):
        """See :attr:`distlab.reference.autograd_container.DistAutogradContainer.max_id`."""
        return self._max_id

    cdef inline Py_ssize_t _shard(self, uint64_t context_id) noexcept:
        # an index below len(self._shards) == self._shard_locks.size(): the mask keeps it in range
        return <Py_ssize_t>(context_id & self._shard_mask)

    cpdef new_autograd_message_id(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.new_autograd_message_id`."""
        # No id lock: nothing between the read and the increment releases the GIL, which makes them one step.
        cdef uint64_t message_id = self._next_message_id
        if message_id >= self._max_id:
            raise _shared.id_overflow("message id", self._worker_id, self._max_id)
        self._next_message_id = message_id + 1
        return message_id

    cpdef DistAutogradContext new_context(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.new_context`."""
        current = self.current_context_id()
        if current != _NO_CONTEXT:
            raise _shared.nested_context(current)
        cdef uint64_t context_id = self._next_context_id  # the GIL again stands for the id lock
        if context_id >= self._max_id:
            raise _shared.id_overflow("context id", self._worker_id, self._max_id)
        self._next_context_id = context_id + 1
        cdef DistAutogradContext context = DistAutogradContext(context_id)
        cdef Py_ssize_t shard = self._shard(context_id)
        _acquire(self._shard_locks[shard])
        try:
            _shard_dict(self._shards, shard)[context_id] = context
        finally:
            PyThread_release_lock(self._shard_locks[shard])
        self._local.context_id = context_id
        return context

    cpdef DistAutogradContext get_or_create_context(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.get_or_create_context`."""
        cdef uint64_t key = _id_of(context_id, "context id")
        cdef Py_ssize_t shard = self._shard(key)
        cdef dict contexts = _shard_dict(self._shards, shard)
        _acquire(self._shard_locks[shard])
        try:
            context = contexts.get(key)
            if context is None:
                context = contexts[key] = DistAutogradContext(key)
            return context
        finally:
            PyThread_release_lock(self._shard_locks[shard])

    cpdef DistAutogradContext retrieve_context(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.retrieve_context`."""
        cdef uint64_t key = _id_of(context_id, "context id")
        cdef Py_ssize_t shard = self._shard(key)
        _acquire(self._shard_locks[shard])
        context = _shard_dict(self._shards, shard).get(key)
        PyThread_release_lock(self._shard_locks[shard])
        if context is None:
            raise _shared.context_not_found(key, self._worker_id)
        return context

    cpdef set release_context(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.release_context`."""
        context = self._erase(_id_of(context_id, "context id"))
        if context is None:
            raise _shared.context_not_found(context_id, self._worker_id)
        return (<DistAutogradContext>context).known_worker_ids()

    cpdef set release_context_if_present(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.release_context_if_present`."""
        context = self._erase(_id_of(context_id, "context id"))
        return set() if context is None else (<DistAutogradContext>context).known_worker_ids()

    cdef object _erase(self, uint64_t context_id):
        cdef Py_ssize_t shard = self._shard(context_id)
        _acquire(self._shard_locks[shard])
        try:
            context = _shard_dict(self._shards, shard).pop(context_id, None)
        finally:
            PyThread_release_lock(self._shard_locks[shard])
        if context is not None and self.current_context_id() == context_id:
            self._local.context_id = _NO_CONTEXT
        return context

    cpdef Py_ssize_t num_autograd_contexts(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.num_autograd_contexts`."""
        cdef Py_ssize_t total = 0, shard
        for shard in range(len(self._shards)):
            _acquire(self._shard_locks[shard])
            total += len(_shard_dict(self._shards, shard))
            PyThread_release_lock(self._shard_locks[shard])
        return total

    cpdef list context_ids(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.context_ids`."""
        cdef vector[uint64_t] ids
        cdef Py_ssize_t shard
        for shard in range(len(self._shards)):
            _acquire(self._shard_locks[shard])
            try:
                for key in _shard_dict(self._shards, shard):
                    ids.push_back(key)
            finally:
                PyThread_release_lock(self._shard_locks[shard])
        sort(ids.begin(), ids.end())
        return ids

    cpdef object current_context_id(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.current_context_id`."""
        return getattr(self._local, "context_id", _NO_CONTEXT)

    cpdef bint has_valid_context(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.has_valid_context`."""
        current = self.current_context_id()
        if current == _NO_CONTEXT:
            return False
        cdef uint64_t key = current
        cdef Py_ssize_t shard = self._shard(key)
        _acquire(self._shard_locks[shard])
        found = key in _shard_dict(self._shards, shard)
        PyThread_release_lock(self._shard_locks[shard])
        return found

    cpdef DistAutogradContext current_context(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.current_context`."""
        current = self.current_context_id()
        if current == _NO_CONTEXT:
            raise _shared.no_current_context()
        return self.retrieve_context(current)

    cpdef set_current_context_id(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.set_current_context_id`."""
        current = self.current_context_id()
        if current != _NO_CONTEXT:
            raise _shared.nested_context(current)
        self._local.context_id = int(context_id)

    cpdef force_current_context_id(self, context_id):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.force_current_context_id`."""
        previous = self.current_context_id()
        self._local.context_id = int(context_id)
        return previous

    cpdef clear_current_context_id(self):
        """See :meth:`distlab.reference.autograd_container.DistAutogradContainer.clear_current_context_id`."""
        self._local.context_id = _NO_CONTEXT


_slot = _shared.ContainerSlot(DistAutogradContainer)


def init(worker_id):
    """See :func:`distlab.reference.autograd_container.init`."""
    return _slot.init(worker_id)


def get_container():
    """See :func:`distlab.reference.autograd_container.get_container`."""
    return _slot.get()


def is_initialized():
    """See :func:`distlab.reference.autograd_container.is_initialized`."""
    return _slot.is_initialized()


def shutdown():
    """See :func:`distlab.reference.autograd_container.shutdown`."""
    _slot.shutdown()


# --- core-only helpers ---
cdef inline void _acquire(PyThread_type_lock lock) noexcept:
    """Take a C lock; wait for it without the GIL, so that its holder can run (and release it)."""
    if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(lock, WAIT_LOCK)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline dict _shard_dict(list shards, Py_ssize_t shard):
    """The context dict of ``shard`` (an index the id mask keeps in range)."""
    return <dict>shards[shard]


cdef inline uint64_t _id_of(value, str what) except? 0:
    """An id as a C integer: Python ints convert directly; anything else (or out of range) goes through the shared
    check_id, which converts it as the reference does or raises its ValueError."""
    if type(value) is int and value >= 0:
        try:
            return value
        except OverflowError:
            pass
    return check_id(value, what)
