# Included by _rref.pyx: core twin of distlab.reference.rref_impl (ids, fork data, owner and user RRefs).

cdef class GloballyUniqueId:
    """See :class:`distlab.reference.rref_impl.GloballyUniqueId`."""
    cdef int64_t packed

    def __init__(self, created_on, local_id):
        self.packed = _pack(created_on, local_id)
        if self.packed < 0:
            raise malformed_id(created_on, local_id)

    def key(self):
        """See :meth:`distlab.reference.rref_impl.GloballyUniqueId.key`."""
        return (self.packed >> LOCAL_BITS, self.packed & LOCAL_MASK)

    def __eq__(self, other):
        return isinstance(other, GloballyUniqueId) and (<GloballyUniqueId>other).packed == self.packed

    def __lt__(self, other):
        if not isinstance(other, GloballyUniqueId):
            return NotImplemented
        return self.packed < (<GloballyUniqueId>other).packed

    def __hash__(self):
        return hash(self.packed)

    def __repr__(self):
        return _shared.gid_repr(self.packed >> LOCAL_BITS, self.packed & LOCAL_MASK)

    @property
    def created_on(self):
        """See :attr:`distlab.reference.rref_impl.GloballyUniqueId.created_on`."""
        return self.packed >> LOCAL_BITS

    @property
    def local_id(self):
        """See :attr:`distlab.reference.rref_impl.GloballyUniqueId.local_id`."""
        return self.packed & LOCAL_MASK


cdef class RRefForkData:
    """See :class:`distlab.reference.rref_impl.RRefForkData`."""
    cdef public int owner
    cdef public GloballyUniqueId rref_id
    cdef public GloballyUniqueId fork_id
    cdef public int parent

    def __init__(self, int owner, GloballyUniqueId rref_id, GloballyUniqueId fork_id, int parent):
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.parent = parent

    def to_tuple(self):
        """See :meth:`distlab.reference.rref_impl.RRefForkData.to_tuple`."""
        cdef int64_t r = self.rref_id.packed, f = self.fork_id.packed
        return (self.owner, r >> LOCAL_BITS, r & LOCAL_MASK, f >> LOCAL_BITS, f & LOCAL_MASK, self.parent)

    def __repr__(self):
        return _shared.fork_data_repr(self.owner, self.rref_id, self.fork_id, self.parent)


cdef inline bint _is_worker(object value):
    return type(value) is int and 0 <= value < WORKER_LIMIT


def parse_fork_data(data):
    """See :func:`distlab.reference.rref_impl.parse_fork_data`."""
    cdef tuple t
    cdef int64_t r, f
    if type(data) is not tuple or len(<tuple>data) != FORK_DATA_LEN:
        raise malformed_fork_data(data)
    t = <tuple>data
    r = _pack(t[1], t[2])
    f = _pack(t[3], t[4])
    if r < 0 or f < 0 or not _is_worker(t[0]) or not _is_worker(t[5]):
        raise malformed_fork_data(data)
    return _new_fork_data(t[0], _gid(r), _gid(f), t[5])


cdef class OwnerRRef:
    """See :class:`distlab.reference.rref_impl.OwnerRRef`."""
    cdef public int owner_id
    cdef public GloballyUniqueId rref_id
    cdef public object future
    cdef object __weakref__

    def __init__(self, int owner_id, GloballyUniqueId rref_id, value=UNSET):
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.future = Future(description=value_description(rref_id))
        if value is not UNSET:
            self.future.set_result(value)

    def owner(self):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.owner`."""
        return self.owner_id

    def is_owner(self):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.is_owner`."""
        return True

    def confirmed_by_owner(self):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.confirmed_by_owner`."""
        return True

    def has_value(self):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.has_value`."""
        return self.future.done()

    def set_value(self, value):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.set_value`."""
        self.future.set_result(value)

    def set_error(self, exc):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.set_error`."""
        self.future.set_exception(exc)

    def get_value(self, timeout=None):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.get_value`."""
        return self.future.wait(timeout)

    def get_future(self):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.get_future`."""
        return self.future

    def fork(self, RRefContext ctx):
        """See :meth:`distlab.reference.rref_impl.OwnerRRef.fork`."""
        return _new_fork_data(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return _shared.owner_repr(self.rref_id)


cdef class UserRRef:
    """See :class:`distlab.reference.rref_impl.UserRRef`."""
    cdef public int owner_id
    cdef public GloballyUniqueId rref_id
    cdef public GloballyUniqueId fork_id
    cdef public bint confirmed
    cdef public bint deleted_on_owner
    cdef public bint released
    cdef public bint timed_out
    cdef public int n_pending_children
    cdef public object confirm_future
    cdef public object creation_error
    cdef object __weakref__

    def __init__(self, int owner_id, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        # C fields start zeroed (False, 0) and object fields None: only the ids need setting.
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.fork_id = fork_id

    def owner(self):
        """See :meth:`distlab.reference.rref_impl.UserRRef.owner`."""
        return self.owner_id

    def is_owner(self):
        """See :meth:`distlab.reference.rref_impl.UserRRef.is_owner`."""
        return False

    def confirmed_by_owner(self):
        """See :meth:`distlab.reference.rref_impl.UserRRef.confirmed_by_owner`."""
        return self.confirmed

    def check_usable(self, what):
        """See :meth:`distlab.reference.rref_impl.UserRRef.check_usable`."""
        if self.creation_error is not None:
            raise self.creation_error
        if self.deleted_on_owner:
            raise deleted_error(self.rref_id, self.fork_id, what)
        if self.timed_out:
            raise creation_timeout_error(self.rref_id, self.owner_id, what)

    def fork(self, RRefContext ctx):
        """See :meth:`distlab.reference.rref_impl.UserRRef.fork`."""
        if self.deleted_on_owner:
            raise deleted_error(self.rref_id, self.fork_id, "fork")
        return _new_fork_data(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return _shared.user_repr(self.rref_id, self.fork_id)


# --- core-only helpers ---
cdef inline int64_t _pack(object created_on, object local_id):
    """The packed key of a valid id, or -1 (ids are ints in range: the same check as the reference's)."""
    cdef int overflow = 0
    cdef long long worker, local
    if type(created_on) is not int or type(local_id) is not int:
        return -1
    worker = PyLong_AsLongLongAndOverflow(created_on, &overflow)  # no exception: overflow says out of range
    if overflow or not 0 <= worker < WORKER_LIMIT:
        return -1
    local = PyLong_AsLongLongAndOverflow(local_id, &overflow)
    if overflow or not 0 <= local < LOCAL_LIMIT:
        return -1
    return (<int64_t>worker << LOCAL_BITS) | <int64_t>local


cdef inline GloballyUniqueId _gid(int64_t packed):
    cdef GloballyUniqueId gid = GloballyUniqueId.__new__(GloballyUniqueId)
    gid.packed = packed
    return gid


cdef inline RRefForkData _new_fork_data(int owner, GloballyUniqueId rref_id, GloballyUniqueId fork_id, int parent):
    # no Python argument parsing: the fields are set directly (the ids are already valid)
    cdef RRefForkData fd = RRefForkData.__new__(RRefForkData)
    fd.owner, fd.rref_id, fd.fork_id, fd.parent = owner, rref_id, fork_id, parent
    return fd


cdef inline UserRRef _new_user(int owner_id, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
    cdef UserRRef user = UserRRef.__new__(UserRRef)
    user.owner_id, user.rref_id, user.fork_id = owner_id, rref_id, fork_id
    return user


cdef inline tuple _key(int64_t packed):
    return (packed >> LOCAL_BITS, packed & LOCAL_MASK)
