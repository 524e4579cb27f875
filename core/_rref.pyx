# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.rref` and :mod:`distlab.reference.rref_context` (read those)."""
import threading

from cython.operator cimport dereference as deref, preincrement as inc
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.algorithm cimport sort as cpp_sort

from distlab._rref_shared import UNSET
from distlab._wire import RFD_TUPLE_SIZE, RPC_KIND_CODES
from distlab.errors import (DistTimeoutError, RRefCreationTimeoutError, RRefDeletedError, RRefLeakError,
                            RRefProtocolError)
from distlab.futures import Future

__all__ = ["GloballyUniqueId", "RRefForkData", "OwnerRRef", "UserRRef", "RRefContext", "parse_fork_data"]

cdef int K_USER_DELETE = RPC_KIND_CODES["user_delete"]
cdef int K_FORK_REQUEST = RPC_KIND_CODES["fork_request"]
cdef int K_CHILD_ACCEPT = RPC_KIND_CODES["child_accept"]
cdef long long _LOCAL_BITS = 40
cdef long long _LOCAL_MASK = (1LL << 40) - 1


cdef inline long long _pack(long long created_on, long long local_id):
    return (created_on << _LOCAL_BITS) | local_id


cdef inline tuple _unpack(long long key):
    return (key >> _LOCAL_BITS, key & _LOCAL_MASK)


cdef class GloballyUniqueId:
    """See distlab.reference.rref.GloballyUniqueId."""
    cdef readonly long long created_on
    cdef readonly long long local_id

    def __init__(self, created_on, local_id):
        self.created_on = created_on
        self.local_id = local_id

    cdef inline long long packed(self):
        return _pack(self.created_on, self.local_id)

    def key(self):
        """See the reference twin."""
        return (self.created_on, self.local_id)

    def __eq__(self, other):
        return isinstance(other, GloballyUniqueId) and self.key() == other.key()

    def __lt__(self, other):
        return self.key() < other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"


cdef GloballyUniqueId _gid_from_key(long long key):
    cdef GloballyUniqueId g = GloballyUniqueId.__new__(GloballyUniqueId)
    g.created_on = key >> _LOCAL_BITS
    g.local_id = key & _LOCAL_MASK
    return g


cdef class RRefForkData:
    """See distlab.reference.rref.RRefForkData."""
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
        """See the reference twin."""
        return (self.owner, self.rref_id.created_on, self.rref_id.local_id,
                self.fork_id.created_on, self.fork_id.local_id, self.parent)

    def __repr__(self):
        return (f"RRefForkData(owner={self.owner}, rref_id={self.rref_id!r}, fork_id={self.fork_id!r}, "
                f"parent={self.parent})")


def parse_fork_data(data):
    """See distlab.reference.rref.parse_fork_data."""
    if not isinstance(data, tuple) or len(data) != RFD_TUPLE_SIZE or not all(type(x) is int for x in data):
        raise RRefProtocolError(f"malformed RRef fork data {data!r}: expected a tuple of {RFD_TUPLE_SIZE} ints")
    owner, rc, rl, fc, fl, parent = data
    return RRefForkData(owner, GloballyUniqueId(rc, rl), GloballyUniqueId(fc, fl), parent)


cdef class OwnerRRef:
    """See distlab.reference.rref.OwnerRRef."""
    cdef public int owner_id
    cdef public GloballyUniqueId rref_id
    cdef public object future
    cdef object __weakref__

    def __init__(self, int owner_id, GloballyUniqueId rref_id, value=UNSET):
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.future = Future(description=f"value of OwnerRRef({rref_id!r})")
        if value is not UNSET:
            self.future.set_result(value)

    def owner(self):
        """See the reference twin."""
        return self.owner_id

    def is_owner(self):
        """See the reference twin."""
        return True

    def confirmed_by_owner(self):
        """See the reference twin."""
        return True

    def has_value(self):
        """See the reference twin."""
        return self.future.done()

    def set_value(self, value):
        """See the reference twin."""
        self.future.set_result(value)

    def set_error(self, exc):
        """See the reference twin."""
        self.future.set_exception(exc)

    def get_value(self, timeout=None):
        """See the reference twin."""
        return self.future.wait(timeout)

    def get_future(self):
        """See the reference twin."""
        return self.future

    def fork(self, RRefContext ctx):
        """See the reference twin."""
        return RRefForkData(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return f"OwnerRRef(rref_id={self.rref_id!r})"


cdef class UserRRef:
    """See distlab.reference.rref.UserRRef."""
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
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.confirmed = False
        self.deleted_on_owner = False
        self.released = False
        self.timed_out = False
        self.n_pending_children = 0
        self.confirm_future = None
        self.creation_error = None

    def owner(self):
        """See the reference twin."""
        return self.owner_id

    def is_owner(self):
        """See the reference twin."""
        return False

    def confirmed_by_owner(self):
        """See the reference twin."""
        return self.confirmed

    def check_usable(self, what):
        """See the reference twin."""
        if self.creation_error is not None:
            raise self.creation_error
        if self.deleted_on_owner:
            raise RRefDeletedError(
                f"User RRef with RRefId={self.rref_id!r} and ForkId={self.fork_id!r} has been deleted. "
                f"Cannot call {what} on it after deletion.")
        if self.timed_out:
            raise RRefCreationTimeoutError(
                f"RRef creation via rpc.remote() timed out for RRefId={self.rref_id!r}, and it is possible that "
                f"the RRef on the owner (worker {self.owner_id}) does not exist; cannot call {what}.")

    def fork(self, RRefContext ctx):
        """See the reference twin."""
        if self.deleted_on_owner:
            raise RRefDeletedError(
                f"User RRef with RRefId={self.rref_id!r} and ForkId={self.fork_id!r} has been deleted. "
                "Cannot call fork an UserRRef after deletion.")
        return RRefForkData(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return f"UserRRef(rref_id={self.rref_id!r}, fork_id={self.fork_id!r})"


cdef GloballyUniqueId _gid(object created_on, object local_id):
    if type(created_on) is not int or type(local_id) is not int:
        raise RRefProtocolError(f"malformed id ({created_on!r}, {local_id!r}): expected two ints")
    return GloballyUniqueId(created_on, local_id)


cdef list _sorted_keys(dict d):
    return sorted(d)


cdef class RRefContext:
    """See distlab.reference.rref_context.RRefContext."""
    cdef public int worker_id
    cdef public int max_retries
    cdef public object lock
    cdef public object trace
    cdef public list errors
    cdef object _send
    cdef long long _next_local_id
    # Python objects keyed by packed ids (int64); the fork counts are plain C++ sets.
    cdef dict _owners
    cdef dict _pending_owners
    cdef dict _pending_users
    cdef dict _pending_children
    cdef dict _confirmed_users
    cdef unordered_map[long long, unordered_set[long long]] _forks
    cdef unordered_set[long long] _deleted_forks

    def __init__(self, int worker_id, send, int max_retries=5, trace=False):
        self.worker_id = worker_id
        self._send = send
        self.max_retries = max_retries
        self.lock = threading.RLock()
        self._next_local_id = 0
        self._owners = {}
        self._pending_owners = {}
        self._pending_users = {}
        self._pending_children = {}
        self._confirmed_users = {}
        self.trace = [] if trace else None
        self.errors = []

    # -- ids and creation
    def gen_id(self):
        """See the reference twin."""
        cdef long long local_id
        with self.lock:
            local_id = self._next_local_id
            self._next_local_id += 1
        return GloballyUniqueId(self.worker_id, local_id)

    def create_owner_rref(self, value=UNSET):
        """See the reference twin."""
        return OwnerRRef(self.worker_id, self.gen_id(), value)

    def create_remote(self, int owner):
        """See the reference twin."""
        cdef OwnerRRef rref
        cdef long long key
        if owner == self.worker_id:
            rref = self.create_owner_rref()
            key = rref.rref_id.packed()
            with self.lock:
                self._owners[key] = rref
                self._forks[key].insert(key)
            return rref, rref.rref_id, rref.rref_id
        rref_id = self.gen_id()
        fork_id = self.gen_id()
        user = UserRRef(owner, rref_id, fork_id)
        self.add_pending_user(fork_id, user)
        return user, rref_id, fork_id

    def handle_remote_call(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See the reference twin."""
        owner = self.get_or_create_owner_rref(rref_id)
        if rref_id.packed() != fork_id.packed():
            self.add_fork_of_owner_if_not_present(rref_id, fork_id)
        else:
            self.del_fork_of_owner(rref_id, fork_id)
        return owner

    def finish_remote(self, UserRRef user, error=None):
        """See the reference twin."""
        if error is None:
            self.del_pending_user(user.fork_id)
            return
        with self.lock:
            self._pending_users.pop(user.fork_id.packed(), None)
            user.creation_error = error
            user.deleted_on_owner = True
            fut = user.confirm_future
        if fut is not None and not fut.done():
            fut.set_exception(error)

    # -- owners
    def get_or_create_owner_rref(self, GloballyUniqueId rref_id):
        """See the reference twin."""
        cdef long long key = rref_id.packed()
        with self.lock:
            owner = self._owners.get(key)
            if owner is not None:
                return owner
            owner = OwnerRRef(self.worker_id, rref_id)
            self._owners[key] = owner
            pending = self._pending_owners.pop(key, None)
        if pending is not None:
            pending.set_result(owner)
        return owner

    def get_owner_rref(self, GloballyUniqueId rref_id):
        """See the reference twin."""
        cdef long long key = rref_id.packed()
        with self.lock:
            owner = self._owners.get(key)
            if owner is None:
                fut = self._pending_owners.get(key)
                if fut is None:
                    fut = Future(description=f"OwnerRRef {rref_id!r} on worker {self.worker_id}")
                    self._pending_owners[key] = fut
                return fut
        fut = Future(description=f"OwnerRRef {rref_id!r}")
        fut.set_result(owner)
        return fut

    # -- forks
    def prepare_child_fork(self, rref):
        """See the reference twin."""
        cdef RRefForkData fd = rref.fork(self)
        cdef long long key
        if rref.is_owner():
            key = fd.rref_id.packed()
            with self.lock:
                self._forks[key].insert(fd.fork_id.packed())
                self._owners[key] = rref
        else:
            self.add_pending_child(fd.fork_id, rref)
        return fd.to_tuple()

    def receive_fork(self, data):
        """See the reference twin."""
        cdef RRefForkData fd = parse_fork_data(data)
        cdef UserRRef user
        if fd.owner == self.worker_id:
            fut = self.get_owner_rref(fd.rref_id)
            if fd.parent == self.worker_id:
                self.del_fork_of_owner(fd.rref_id, fd.fork_id)
            else:
                self._send_control(fd.parent, K_CHILD_ACCEPT, fd.fork_id.key())
            return None, fut
        user = UserRRef(fd.owner, fd.rref_id, fd.fork_id)
        if fd.parent == fd.owner:
            self.add_confirmed_user(user)
            return user, None
        fut = Future(description=f"confirmation of {user!r}")
        user.confirm_future = fut
        self.add_pending_user(fd.fork_id, user)
        parent = fd.parent
        fork_id = user.fork_id
        self._send_control(fd.owner, K_FORK_REQUEST, fd.rref_id.key() + fd.fork_id.key(),
                           lambda: self.finish_fork_request(fork_id, parent))
        return user, fut

    def finish_fork_request(self, GloballyUniqueId fork_id, int parent):
        """See the reference twin."""
        self.del_pending_user(fork_id)
        self._send_control(parent, K_CHILD_ACCEPT, fork_id.key())

    def add_pending_user(self, GloballyUniqueId fork_id, user):
        """See the reference twin."""
        cdef long long key = fork_id.packed()
        with self.lock:
            if key in self._pending_users:
                raise RRefProtocolError(f"Inconsistent states: attempt to add the same UserRRef twice {fork_id!r}")
            self._pending_users[key] = user

    def del_pending_user(self, GloballyUniqueId fork_id):
        """See the reference twin."""
        cdef long long key = fork_id.packed()
        cdef UserRRef user
        with self.lock:
            user = self._pending_users.pop(key, None)
            if user is None:
                return
            user.confirmed = True
            self._confirmed_users[key] = user
            fut = user.confirm_future
        if fut is not None and not fut.done():
            fut.set_result(user)
        self._maybe_delete(user)

    def add_confirmed_user(self, UserRRef user):
        """See the reference twin."""
        with self.lock:
            user.confirmed = True
            self._confirmed_users[user.fork_id.packed()] = user

    def add_pending_child(self, GloballyUniqueId fork_id, rref):
        """See the reference twin."""
        cdef long long key = fork_id.packed()
        with self.lock:
            if key in self._pending_children:
                raise RRefProtocolError(f"Inconsistent states: attempt to add the same child fork twice {fork_id!r}")
            self._pending_children[key] = rref
            rref.n_pending_children += 1

    def del_pending_child(self, GloballyUniqueId fork_id):
        """See the reference twin."""
        with self.lock:
            parent = self._pending_children.pop(fork_id.packed(), None)
            if parent is None:
                return
            parent.n_pending_children -= 1
        self._maybe_delete(parent)

    def add_fork_of_owner_if_not_present(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See the reference twin."""
        cdef long long fkey = fork_id.packed()
        with self.lock:
            if self._deleted_forks.count(fkey):
                return
            self._forks[rref_id.packed()].insert(fkey)

    def del_fork_of_owner(self, GloballyUniqueId rref_id, GloballyUniqueId fork_id):
        """See the reference twin."""
        cdef long long rkey = rref_id.packed()
        cdef long long fkey = fork_id.packed()
        cdef unordered_map[long long, unordered_set[long long]].iterator it
        with self.lock:
            self._deleted_forks.insert(fkey)
            it = self._forks.find(rkey)
            if it == self._forks.end():
                return None
            deref(it).second.erase(fkey)
            if not deref(it).second.empty():
                return None
            self._forks.erase(it)
            deleted = self._owners.pop(rkey, None)
            return deleted

    # -- control messages
    def _send_control(self, int dst, int kind, tuple payload, on_ack=None, int attempt=0):
        """See the reference twin."""
        if self.trace is not None:
            with self.lock:
                self.trace.append((self.worker_id, dst, kind, payload))
        fut = self._send(dst, kind, payload)

        def acked(f):
            exc = f.exception()
            if exc is None:
                if on_ack is not None:
                    on_ack()
            elif isinstance(exc, DistTimeoutError) and attempt < self.max_retries:
                self._send_control(dst, kind, payload, on_ack, attempt + 1)
            else:
                with self.lock:
                    self.errors.append(f"control message {kind} {payload} to worker {dst} failed: {exc!r}")

        fut.add_done_callback(acked)

    def handle(self, int src, int kind, payload):
        """See the reference twin."""
        if not isinstance(payload, tuple):
            raise RRefProtocolError(f"malformed RRef control message from worker {src}: payload {payload!r}")
        if kind == K_USER_DELETE and len(payload) == 4:
            self.del_fork_of_owner(_gid(payload[0], payload[1]), _gid(payload[2], payload[3]))
        elif kind == K_FORK_REQUEST and len(payload) == 4:
            self.add_fork_of_owner_if_not_present(_gid(payload[0], payload[1]), _gid(payload[2], payload[3]))
        elif kind == K_CHILD_ACCEPT and len(payload) == 2:
            self.del_pending_child(_gid(payload[0], payload[1]))
        else:
            raise RRefProtocolError(f"malformed RRef control message from worker {src}: kind {kind}, "
                                    f"payload {payload!r}")
        return None

    # -- deletion
    def release_user(self, UserRRef user):
        """See the reference twin."""
        with self.lock:
            if user.released:
                return
            user.released = True
        self._maybe_delete(user)

    def _maybe_delete(self, rref):
        """See the reference twin."""
        cdef UserRRef user
        if rref.is_owner():
            return
        user = rref
        with self.lock:
            if (not user.released or user.deleted_on_owner or not user.confirmed
                    or user.n_pending_children > 0):
                return
            user.deleted_on_owner = True
            self._confirmed_users.pop(user.fork_id.packed(), None)
        self._send_control(user.owner_id, K_USER_DELETE, user.rref_id.key() + user.fork_id.key())

    # -- shutdown and inspection
    def has_pending(self):
        """See the reference twin."""
        with self.lock:
            return bool(self._pending_users or self._pending_children)

    def idle(self):
        """See the reference twin."""
        with self.lock:
            return not (self._owners or self._pending_users or self._pending_children or self._confirmed_users)

    def delete_all_users(self):
        """See the reference twin."""
        cdef UserRRef user
        with self.lock:
            users = [self._confirmed_users[k] for k in _sorted_keys(self._confirmed_users)]
        for user in users:
            with self.lock:
                user.released = True
            self._maybe_delete(user)
        return len(users)

    def drop_unforked_owners(self):
        """See the reference twin."""
        cdef long long key
        cdef unordered_map[long long, unordered_set[long long]].iterator it
        with self.lock:
            unforked = []
            for key in self._owners:
                it = self._forks.find(key)
                if it == self._forks.end() or deref(it).second.empty():
                    unforked.append(key)
            for key in unforked:
                del self._owners[key]
            return len(unforked)

    cdef list _fork_table(self):
        # [(rref key, sorted fork keys)] sorted by rref key
        cdef list table = []
        cdef vector[long long] fks
        cdef unordered_map[long long, unordered_set[long long]].iterator it = self._forks.begin()
        cdef unordered_set[long long].iterator fit
        while it != self._forks.end():
            fks.clear()
            fit = deref(it).second.begin()
            while fit != deref(it).second.end():
                fks.push_back(deref(fit))
                inc(fit)
            cpp_sort(fks.begin(), fks.end())
            table.append((deref(it).first, [k for k in fks]))
            inc(it)
        table.sort()
        return table

    def check_leaks(self):
        """See the reference twin."""
        with self.lock:
            lines = [f"Leaking RRef {_gid_from_key(rk)!r} with fork Id {_gid_from_key(fk)!r}"
                     for rk, fks in self._fork_table() for fk in fks]
            lines += [f"Leaking pending UserRRef {self._pending_users[f]!r}" for f in _sorted_keys(self._pending_users)]
            lines += [f"Leaking pending child fork Id {_gid_from_key(f)!r} of {self._pending_children[f]!r}"
                      for f in _sorted_keys(self._pending_children)]
        if not lines:
            return None
        return RRefLeakError(f"worker {self.worker_id}: RRef leak at shutdown:\n" + "\n".join(lines))

    def debug_info(self):
        """See the reference twin."""
        cdef size_t nforks = 0
        cdef unordered_map[long long, unordered_set[long long]].iterator it
        with self.lock:
            it = self._forks.begin()
            while it != self._forks.end():
                nforks += deref(it).second.size()
                inc(it)
            return {
                "num_owner_rrefs": len(self._owners),
                "num_pending_futures": len(self._pending_owners),
                "num_pending_users": len(self._pending_users),
                "num_forks": nforks,
                "num_pending_children": len(self._pending_children),
                "num_confirmed_users": len(self._confirmed_users),
            }

    def state(self):
        """See the reference twin."""
        with self.lock:
            return {
                "owners": sorted(_unpack(k) for k in self._owners),
                "pending_owners": sorted(_unpack(k) for k in self._pending_owners),
                "forks": [(_unpack(rk), tuple(_unpack(f) for f in fks)) for rk, fks in self._fork_table()],
                "pending_users": sorted(_unpack(k) for k in self._pending_users),
                "pending_children": sorted(_unpack(k) for k in self._pending_children),
                "confirmed_users": sorted(_unpack(k) for k in self._confirmed_users),
                "next_local_id": self._next_local_id,
            }
