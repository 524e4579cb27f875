# Included by _autograd_container.pyx: core twin of distlab.reference.autograd_context (a pass's metadata
# and one context's state).

cdef class AutogradMetadata:
    """See :class:`distlab.reference.autograd_context.AutogradMetadata`."""

    cdef public uint64_t context_id
    cdef public uint64_t message_id

    def __init__(self, context_id, message_id):
        self.context_id = check_id(context_id)
        self.message_id = check_id(message_id, "message id")

    cpdef tuple to_tuple(self):
        """See :meth:`distlab.reference.autograd_context.AutogradMetadata.to_tuple`."""
        return (self.context_id, self.message_id)

    def __eq__(self, other):
        if not isinstance(other, AutogradMetadata):
            return False
        cdef AutogradMetadata that = other
        return self.context_id == that.context_id and self.message_id == that.message_id

    def __hash__(self):
        return hash(self.to_tuple())

    def __repr__(self):
        return f"AutogradMetadata(context_id={self.context_id}, message_id={self.message_id})"


cdef class DistAutogradContext:
    """See :class:`distlab.reference.autograd_context.DistAutogradContext`."""

    cdef uint64_t _context_id
    cdef PyThread_type_lock _lock  # context.h lock_: guards everything below
    cdef unordered_set[int64_t] _known_workers
    cdef dict _send  # message id -> SendRpcBackward
    cdef dict _recv  # message id -> RecvRpcGroup
    cdef dict _grads  # id(variable) -> [variable, gradient]
    cdef list _outstanding
    cdef object _graph_task

    def __cinit__(self, *args, **kwargs):
        # the lock and the maps exist however the object was made (__init__ only sets the id)
        self._send = {}
        self._recv = {}
        self._grads = {}
        self._outstanding = []
        self._lock = PyThread_allocate_lock()
        if self._lock is NULL:
            raise MemoryError("could not allocate the lock of a distributed autograd context")

    def __init__(self, context_id):
        self._context_id = check_id(context_id)

    def __dealloc__(self):
        if self._lock is not NULL:
            PyThread_free_lock(self._lock)

    @property
    def context_id(self):
        """See :attr:`distlab.reference.autograd_context.DistAutogradContext.context_id`."""
        return self._context_id

    cpdef add_known_worker_id(self, worker_id):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.add_known_worker_id`."""
        cdef int64_t worker = worker_id
        _acquire(self._lock)
        self._known_workers.insert(worker)
        PyThread_release_lock(self._lock)

    cpdef set known_worker_ids(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.known_worker_ids`."""
        cdef vector[int64_t] copy
        _acquire(self._lock)
        copy.assign(self._known_workers.begin(), self._known_workers.end())
        PyThread_release_lock(self._lock)
        return set(copy)

    cpdef add_send_function(self, func, message_id):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.add_send_function`."""
        self._add_function(self._send, "send", func, message_id)

    cpdef add_recv_function(self, func, message_id):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.add_recv_function`."""
        self._add_function(self._recv, "recv", func, message_id)

    cdef _add_function(self, dict table, str what, func, message_id):
        if func is None:
            raise _shared.function_error(self._context_id, what, None)
        key = _id_of(message_id, "message id")
        cdef bint taken
        _acquire(self._lock)
        try:
            taken = key in table
            if not taken:
                table[key] = func
        finally:
            PyThread_release_lock(self._lock)
        if taken:
            raise _shared.function_error(self._context_id, what, key)

    cpdef dict send_functions(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.send_functions`."""
        _acquire(self._lock)
        try:
            return self._send.copy()
        finally:
            PyThread_release_lock(self._lock)

    cpdef dict recv_functions(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.recv_functions`."""
        _acquire(self._lock)
        try:
            return self._recv.copy()
        finally:
            PyThread_release_lock(self._lock)

    cpdef retrieve_send_function(self, message_id):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.retrieve_send_function`."""
        key = int(message_id)
        _acquire(self._lock)
        func = self._send.get(key)
        PyThread_release_lock(self._lock)
        if func is None:
            raise _shared.send_function_not_found(self._context_id, message_id)
        return func

    cpdef accumulate_grad(self, variable, grad):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.accumulate_grad`."""
        key = id(variable)
        cdef list entry
        _acquire(self._lock)
        try:
            entry = self._grads.get(key)
            if entry is None:
                self._grads[key] = [variable, _shared.private_copy(variable, grad)]
            else:
                entry[1] = add_grads(entry[1], grad)
        finally:
            PyThread_release_lock(self._lock)

    cpdef dict get_gradients(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.get_gradients`."""
        _acquire(self._lock)
        try:
            entries = list(self._grads.values())
        finally:
            PyThread_release_lock(self._lock)
        return _shared.gradients_as_tensors(entries)

    cpdef add_outstanding_rpc(self, future):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.add_outstanding_rpc`."""
        _acquire(self._lock)
        try:
            self._outstanding.append(future)
        finally:
            PyThread_release_lock(self._lock)

    cpdef Py_ssize_t num_outstanding_rpcs(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.num_outstanding_rpcs`."""
        return len(self._outstanding)  # one read of a list's size: atomic under the GIL

    cpdef clear_outstanding_rpcs(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.clear_outstanding_rpcs`."""
        self._outstanding = []  # one store: atomic under the GIL

    cpdef clear_and_wait_for_outstanding_rpcs_async(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.clear_and_wait_for_outstanding_rpcs_async`."""
        _acquire(self._lock)
        taken, self._outstanding = self._outstanding, []
        PyThread_release_lock(self._lock)
        return _shared.first_error_future(taken, self._context_id)

    cpdef set_graph_task(self, task):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.set_graph_task`."""
        cdef bint busy
        _acquire(self._lock)
        busy = self._graph_task is not None
        if not busy:
            self._graph_task = task
        PyThread_release_lock(self._lock)
        if busy:
            raise _shared.backward_already_running(self._context_id)

    cpdef retrieve_graph_task(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.retrieve_graph_task`."""
        return self._graph_task

    cpdef reset_graph_task(self):
        """See :meth:`distlab.reference.autograd_context.DistAutogradContext.reset_graph_task`."""
        self._graph_task = None  # one store: atomic under the GIL

    def __repr__(self):
        known = self.known_worker_ids()
        _acquire(self._lock)
        try:
            return _shared.describe_context(self._context_id, known, self._send, self._recv, len(self._grads))
        finally:
            PyThread_release_lock(self._lock)
