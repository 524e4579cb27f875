# Included by _rref.pyx: core twin of distlab.reference.rref_context (the RRef context, G1 and G2).

cdef class RRefContext:
    """See :class:`distlab.reference.rref_context.RRefContext`."""
    cdef public int worker_id
    cdef public int max_retries
    cdef public object lock
    cdef public object trace
    cdef public list errors
    cdef object _send
    cdef public int64_t next_local_id
    # RRef objects in dicts keyed by packed ids; the owner's fork counts and deleted forks are C++ sets.
    cdef dict _owners
    cdef dict _pending_owners
    cdef dict _pending_users
    cdef dict _pending_children
    cdef dict _confirmed_users
    cdef ForkTable _forks
    cdef unordered_set[int64_t] _deleted_forks

    def __init__(self, worker_id, send, int max_retries=5, trace=False):
        self.worker_id = _shared.check_worker_id(worker_id)
        self._send = send
        self.max_retries = max_retries
        self.lock = threading.RLock()
        self._owners = {}
        self._pending_owners = {}
        self._pending_users = {}
        self._pending_children = {}
        self._confirmed_users = {}
        self.trace = [] if trace else None
        self.errors = []

    # -- ids and creation
    cpdef GloballyUniqueId gen_id(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.gen_id`."""
        cdef int64_t local_id
        with self.lock:
            local_id = self.next_local_id
            if local_id >= LOCAL_LIMIT:
                raise id_overflow(self.worker_id)
            self.next_local_id = local_id + 1
        return _gid((<int64_t>self.worker_id << LOCAL_BITS) | local_id)

    def create_owner_rref(self, value=UNSET):
        """See :meth:`distlab.reference.rref_context.RRefContext.create_owner_rref`."""
        return OwnerRRef(self.worker_id, self.gen_id(), value)

    def create_remote(self, int owner):
        """See :meth:`distlab.reference.rref_context.RRefContext.create_remote`."""
        cdef OwnerRRef own
        cdef UserRRef user
        if owner == self.worker_id:
            own = OwnerRRef(self.worker_id, self.gen_id())
            with self.lock:
                self._owners[own.rref_id.packed] = own
                self._forks[own.rref_id.packed].insert(own.rref_id.packed)
            return own, own.rref_id, own.rref_id
        user = _new_user(owner, self.gen_id(), self.gen_id())
        self.add_pending_user(user.fork_id, user)
        return user, user.rref_id, user.fork_id

    def handle_remote_call(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.handle_remote_call`."""
        own = self.get_or_create_owner_rref(rref_id)
        if rref_id.packed == fork_id.packed:
            self.del_fork_of_owner(rref_id, fork_id)  # a remote to self: its self fork is dropped here
        else:
            self.add_fork_of_owner_if_not_present(rref_id, fork_id)
        return own

    def finish_remote(self, UserRRef user, error=None):
        """See :meth:`distlab.reference.rref_context.RRefContext.finish_remote`."""
        if error is None:
            self.del_pending_user(user.fork_id)
            return
        with self.lock:
            self._pending_users.pop(user.fork_id.packed, None)
            user.creation_error = error
            user.deleted_on_owner = True
            waiting = user.confirm_future
        if waiting is not None and not waiting.done():
            waiting.set_exception(error)

    # -- owners
    cpdef get_or_create_owner_rref(self, GloballyUniqueId rref_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.get_or_create_owner_rref`."""
        cdef int64_t key = rref_id.packed
        with self.lock:
            own = self._owners.get(key)
            if own is not None:
                return own
            own = self._owners[key] = OwnerRRef(self.worker_id, rref_id)
            waiting = self._pending_owners.pop(key, None)
        if waiting is not None:
            waiting.set_result(own)
        return own

    cpdef get_owner_rref(self, GloballyUniqueId rref_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.get_owner_rref`."""
        cdef int64_t key = rref_id.packed
        with self.lock:
            own = self._owners.get(key)
            if own is None:
                waiting = self._pending_owners.get(key)
                if waiting is None:
                    waiting = self._pending_owners[key] = Future(
                        description=pending_owner_description(rref_id, self.worker_id))
                return waiting
        done = Future(description=_shared.owner_repr(rref_id))
        done.set_result(own)
        return done

    # -- forks
    def prepare_child_fork(self, rref):
        """See :meth:`distlab.reference.rref_context.RRefContext.prepare_child_fork`."""
        cdef RRefForkData fd = rref.fork(self)
        if isinstance(rref, OwnerRRef):
            with self.lock:
                self._forks[fd.rref_id.packed].insert(fd.fork_id.packed)
                self._owners[fd.rref_id.packed] = rref
        else:
            self.add_pending_child(fd.fork_id, rref)
        return fd.to_tuple()

    def receive_fork(self, data):
        """See :meth:`distlab.reference.rref_context.RRefContext.receive_fork`."""
        cdef RRefForkData fd = parse_fork_data(data)
        cdef UserRRef user
        if fd.owner == self.worker_id:
            own_future = self.get_owner_rref(fd.rref_id)
            if fd.parent == self.worker_id:
                self.del_fork_of_owner(fd.rref_id, fd.fork_id)
            else:
                self._send_control(fd.parent, K_CHILD_ACCEPT, fd.fork_id.key())
            return None, own_future
        user = _new_user(fd.owner, fd.rref_id, fd.fork_id)
        if fd.parent == fd.owner:
            self.add_confirmed_user(user)
            return user, None
        user.confirm_future = Future(description=confirmation_description(user))
        self.add_pending_user(fd.fork_id, user)
        self._send_control(fd.owner, K_FORK_REQUEST, fd.rref_id.key() + fd.fork_id.key(),
                           _FinishForkRequest(self, fd.fork_id, fd.parent))
        return user, user.confirm_future

    def finish_fork_request(self, GloballyUniqueId fork_id, int parent):
        """See :meth:`distlab.reference.rref_context.RRefContext.finish_fork_request`."""
        self.del_pending_user(fork_id)
        self._send_control(parent, K_CHILD_ACCEPT, fork_id.key())

    cpdef add_pending_user(self, GloballyUniqueId fork_id, user):
        """See :meth:`distlab.reference.rref_context.RRefContext.add_pending_user`."""
        with self.lock:
            if fork_id.packed in self._pending_users:
                raise duplicate_user(fork_id)
            self._pending_users[fork_id.packed] = user

    cpdef del_pending_user(self, GloballyUniqueId fork_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.del_pending_user`."""
        cdef UserRRef user
        with self.lock:
            user = self._pending_users.pop(fork_id.packed, None)
            if user is None:
                return
            user.confirmed = True
            self._confirmed_users[fork_id.packed] = user
        if user.confirm_future is not None and not user.confirm_future.done():
            user.confirm_future.set_result(user)
        self._maybe_delete(user)

    cpdef add_confirmed_user(self, UserRRef user):
        """See :meth:`distlab.reference.rref_context.RRefContext.add_confirmed_user`."""
        with self.lock:
            user.confirmed = True
            self._confirmed_users[user.fork_id.packed] = user

    cpdef add_pending_child(self, GloballyUniqueId fork_id, rref):
        """See :meth:`distlab.reference.rref_context.RRefContext.add_pending_child`."""
        cdef UserRRef parent = rref
        with self.lock:
            if fork_id.packed in self._pending_children:
                raise duplicate_child(fork_id)
            self._pending_children[fork_id.packed] = parent
            parent.n_pending_children += 1

    cpdef del_pending_child(self, GloballyUniqueId fork_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.del_pending_child`."""
        cdef UserRRef parent
        with self.lock:
            parent = self._pending_children.pop(fork_id.packed, None)
            if parent is None:
                return
            parent.n_pending_children -= 1
        self._maybe_delete(parent)

    cpdef add_fork_of_owner_if_not_present(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.add_fork_of_owner_if_not_present`."""
        with self.lock:
            if not self._deleted_forks.count(fork_id.packed):
                self._forks[rref_id.packed].insert(fork_id.packed)

    cpdef del_fork_of_owner(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See :meth:`distlab.reference.rref_context.RRefContext.del_fork_of_owner`."""
        cdef ForkTable.iterator it
        with self.lock:
            self._deleted_forks.insert(fork_id.packed)
            it = self._forks.find(rref_id.packed)
            if it == self._forks.end():
                return None
            deref(it).second.erase(fork_id.packed)
            if not deref(it).second.empty():
                return None
            self._forks.erase(it)
            return self._owners.pop(rref_id.packed, None)

    # -- control messages
    cdef _send_control(self, int dst, int kind, tuple payload, on_ack=None, int attempt=0):
        if self.trace is not None:
            with self.lock:
                (<list>self.trace).append((self.worker_id, dst, kind, payload))
        self._send(dst, kind, payload).add_done_callback(_ControlAck(self, dst, kind, payload, on_ack, attempt))

    def handle(self, src, kind, payload):
        """See :meth:`distlab.reference.rref_context.RRefContext.handle`."""
        cdef Py_ssize_t n
        cdef int64_t first, second = 0
        if type(kind) is not int or type(payload) is not tuple:
            raise malformed_control(src, kind, payload)
        n = len(<tuple>payload)
        if not ((n == 4 and (kind == K_USER_DELETE or kind == K_FORK_REQUEST)) or (n == 2 and kind == K_CHILD_ACCEPT)):
            raise malformed_control(src, kind, payload)
        first = _pack(payload[0], payload[1])
        if n == 4:
            second = _pack(payload[2], payload[3])
        if first < 0 or second < 0:
            raise malformed_control(src, kind, payload)
        if kind == K_USER_DELETE:
            self.del_fork_of_owner(_gid(first), _gid(second))
        elif kind == K_FORK_REQUEST:
            self.add_fork_of_owner_if_not_present(_gid(first), _gid(second))
        else:
            self.del_pending_child(_gid(first))
        return None

    # -- deletion
    def release_user(self, UserRRef user):
        """See :meth:`distlab.reference.rref_context.RRefContext.release_user`."""
        with self.lock:
            if user.released:
                return
            user.released = True
        self._maybe_delete(user)

    cdef _maybe_delete(self, rref):
        cdef UserRRef user
        if not isinstance(rref, UserRRef):
            return
        user = rref
        with self.lock:
            if not user.released or user.deleted_on_owner or not user.confirmed or user.n_pending_children:
                return
            user.deleted_on_owner = True
            self._confirmed_users.pop(user.fork_id.packed, None)
        self._send_control(user.owner_id, K_USER_DELETE, user.rref_id.key() + user.fork_id.key())

    # -- shutdown and inspection
    def has_pending(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.has_pending`."""
        with self.lock:
            return len(self._pending_users) > 0 or len(self._pending_children) > 0

    def idle(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.idle`."""
        with self.lock:
            return not (self._owners or self._pending_users or self._pending_children or self._confirmed_users)

    def delete_all_users(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.delete_all_users`."""
        cdef UserRRef user
        with self.lock:
            users = [self._confirmed_users[k] for k in sorted(self._confirmed_users)]
        for user in users:
            with self.lock:
                user.released = True
            self._maybe_delete(user)
        return len(users)

    def drop_unforked_owners(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.drop_unforked_owners`."""
        cdef ForkTable.iterator it
        with self.lock:
            unforked = []
            for key in self._owners:
                it = self._forks.find(key)
                if it == self._forks.end() or deref(it).second.empty():
                    unforked.append(key)
            for key in unforked:
                del self._owners[key]
            return len(unforked)

    def check_leaks(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.check_leaks`."""
        with self.lock:
            forks = [(_gid(r), [_gid(f) for f in fs]) for r, fs in _fork_table(self)]
            users = [self._pending_users[k] for k in sorted(self._pending_users)]
            children = [(_gid(k), self._pending_children[k]) for k in sorted(self._pending_children)]
        return _shared.leak_error(self.worker_id, forks, users, children)

    def debug_info(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.debug_info`."""
        cdef size_t nforks = 0
        cdef ForkTable.iterator it
        with self.lock:
            it = self._forks.begin()
            while it != self._forks.end():
                nforks += deref(it).second.size()
                inc(it)
            return _shared.debug_info(len(self._owners), len(self._pending_owners), len(self._pending_users),
                                      nforks, len(self._pending_children), len(self._confirmed_users))

    def state(self):
        """See :meth:`distlab.reference.rref_context.RRefContext.state`."""
        with self.lock:
            return _shared.state([_key(k) for k in self._owners], [_key(k) for k in self._pending_owners],
                                 [(_key(r), [_key(f) for f in fs]) for r, fs in _fork_table(self)],
                                 [_key(k) for k in self._pending_users], [_key(k) for k in self._pending_children],
                                 [_key(k) for k in self._confirmed_users], self.next_local_id)


# --- core-only helpers ---
cdef list _fork_table(RRefContext ctx):
    """[(rref key, [fork keys, sorted])] sorted by rref key (the caller holds ``ctx.lock``)."""
    cdef list table = []
    cdef vector[int64_t] keys
    cdef ForkTable.iterator it = ctx._forks.begin()
    while it != ctx._forks.end():
        keys.assign(deref(it).second.begin(), deref(it).second.end())
        cpp_sort(keys.begin(), keys.end())
        table.append((deref(it).first, [k for k in keys]))
        inc(it)
    table.sort()
    return table


cdef class _ControlAck:
    """The done-callback of a control message: run ``on_ack``, or re-send after a timeout (idempotent), or
    record the failure (the reference's ``acked`` closure)."""
    cdef RRefContext ctx
    cdef int dst, kind, attempt
    cdef tuple payload
    cdef object on_ack

    def __cinit__(self, RRefContext ctx, int dst, int kind, tuple payload, on_ack, int attempt):
        self.ctx, self.dst, self.kind, self.payload, self.on_ack, self.attempt = ctx, dst, kind, payload, on_ack, attempt

    def __call__(self, fut):
        exc = fut.exception()
        if exc is None:
            if self.on_ack is not None:
                self.on_ack()
        elif isinstance(exc, DistTimeoutError) and self.attempt < self.ctx.max_retries:
            self.ctx._send_control(self.dst, self.kind, self.payload, self.on_ack, self.attempt + 1)
        else:
            with self.ctx.lock:
                self.ctx.errors.append(control_failed(self.kind, self.payload, self.dst, exc))


cdef class _FinishForkRequest:
    """``on_ack`` of a fork request: ``ctx.finish_fork_request(fork_id, parent)`` (the reference's lambda)."""
    cdef RRefContext ctx
    cdef GloballyUniqueId fork_id
    cdef int parent

    def __cinit__(self, RRefContext ctx, GloballyUniqueId fork_id, int parent):
        self.ctx, self.fork_id, self.parent = ctx, fork_id, parent

    def __call__(self):
        self.ctx.finish_fork_request(self.fork_id, self.parent)
