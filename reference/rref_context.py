"""The RRef context: one per worker, the state of the RRef protocol (reference twin).

Part of the RRef component :mod:`distlab.reference.rref`. Twinned with ``core/_rref_context.pxi``.

Mirrors rref_context.cpp ``RRefContext``. State (all guarded by one lock):

``owners``
    RRef id -> OwnerRRef, for RRefs this worker owns that have (or had) forks.
``pending_owners``
    RRef id -> Future of the OwnerRRef, for an RRef used here before its creation arrived.
``forks``
    RRef id -> set of fork ids (the owner's reference count).
``pending_users``
    fork id -> UserRRef not yet confirmed by the owner (G2: it may not be deleted yet).
``pending_children``
    fork id -> parent RRef, kept until the owner has confirmed the child (G2).
``confirmed_users``
    fork id -> UserRRef confirmed by the owner (graceful shutdown deletes them, G1).
``deleted_forks``
    fork ids whose deletion the owner applied: a duplicated or retried ``fork_request`` that arrives late must
    not resurrect them (control messages are idempotent).

Every control message (``user_delete``, ``fork_request``, ``child_accept``) goes through the injected
``send(dst, kind, payload) -> Future`` and is retried when its acknowledgement times out; receivers apply each at
most once. No message order is assumed. Errors and reports come from ``distlab._common.rref`` (shared).
"""
from __future__ import annotations

import threading

from distlab._common import rref as shared
from distlab._common.rref import K_CHILD_ACCEPT, K_FORK_REQUEST, K_USER_DELETE, LOCAL_ID_LIMIT, UNSET
from distlab.errors import DistTimeoutError, RRefProtocolError
from distlab.futures import Future

from .rref_impl import GloballyUniqueId, OwnerRRef, UserRRef, parse_fork_data

__all__ = ["RRefContext"]


class RRefContext:
    """The RRef protocol state of one worker.

    Parameters
    ----------
    worker_id : int
        This worker's id.
    send : callable
        ``send(dst, kind, payload) -> Future``: sends a control message; the future completes with the
        receiver's acknowledgement (what :meth:`handle` returned there) or fails.
    max_retries : int
        How often a control message is re-sent after its acknowledgement timed out.
    trace : bool
        Record every control message sent in :attr:`trace` (for the twins' equivalence tests).

    Attributes
    ----------
    next_local_id : int
        The local part of the next id :meth:`gen_id` hands out (a counter below ``2**40``).
    """

    def __init__(self, /, worker_id: int, send, max_retries: int = 5, trace: bool = False):
        self.worker_id = shared.check_worker_id(worker_id)
        self._send = send
        self.max_retries = max_retries
        self.lock = threading.RLock()
        self.next_local_id = 0
        self.owners = {}
        self.pending_owners = {}
        self.forks = {}
        self.pending_users = {}
        self.pending_children = {}
        self.confirmed_users = {}
        self.deleted_forks = set()
        self.trace = [] if trace else None
        self.errors = []

    # -- ids and creation -------------------------------------------------------------------------------------
    def gen_id(self):
        """A new GloballyUniqueId(worker_id, counter) (mirrors RRefContext::genGloballyUniqueId)."""
        with self.lock:
            local_id = self.next_local_id
            if local_id >= LOCAL_ID_LIMIT:
                raise shared.id_overflow(self.worker_id)
            self.next_local_id += 1
        return GloballyUniqueId(self.worker_id, local_id)

    def create_owner_rref(self, value=UNSET):
        """A local OwnerRRef, not registered until it is forked (mirrors RRefContext::createOwnerRRef)."""
        return OwnerRRef(self.worker_id, self.gen_id(), value)

    def create_remote(self, owner: int):
        """Make the caller's side of ``remote(owner, ...)``; return ``(rref, rref_id, fork_id)``.

        To another worker: a new UserRRef, kept as a pending user until the owner acknowledges (mirrors
        python_functions.cpp pyRemote + createUserRRef + addPendingUser). To self: an OwnerRRef registered with
        itself as a fork until the request is handled (mirrors RRefContext::addSelfAsFork).
        """
        if owner == self.worker_id:
            rref = self.create_owner_rref()
            with self.lock:
                self.owners[rref.rref_id] = rref
                self.forks.setdefault(rref.rref_id, set()).add(rref.rref_id)
            return rref, rref.rref_id, rref.rref_id
        rref_id = self.gen_id()
        fork_id = self.gen_id()
        user = UserRRef(owner, rref_id, fork_id)
        self.add_pending_user(fork_id, user)
        return user, rref_id, fork_id

    def handle_remote_call(self, rref_id, fork_id):
        """Owner side of ``remote``: get or create the OwnerRRef and register the caller's fork.

        Mirrors request_callback assignOwnerRRef: ``rref_id == fork_id`` only for a remote to self, whose self
        fork is dropped here.
        """
        owner = self.get_or_create_owner_rref(rref_id)
        if rref_id != fork_id:
            self.add_fork_of_owner_if_not_present(rref_id, fork_id)
        else:
            self.del_fork_of_owner(rref_id, fork_id)
        return owner

    def finish_remote(self, user, error=None) -> None:
        """The owner answered the caller's ``remote``: confirm the pending user; on error, nothing to delete."""
        if error is None:
            self.del_pending_user(user.fork_id)
            return
        with self.lock:
            self.pending_users.pop(user.fork_id, None)
            user.creation_error = error
            user.deleted_on_owner = True  # the owner never registered this fork: no deletion notice is due
            fut = user.confirm_future
        if fut is not None and not fut.done():
            fut.set_exception(error)

    # -- owners -----------------------------------------------------------------------------------------------
    def get_or_create_owner_rref(self, rref_id):
        """The OwnerRRef for ``rref_id``, created (and pending users of it woken) if new."""
        with self.lock:
            owner = self.owners.get(rref_id)
            if owner is not None:
                return owner
            owner = OwnerRRef(self.worker_id, rref_id)
            self.owners[rref_id] = owner
            pending = self.pending_owners.pop(rref_id, None)
        if pending is not None:
            pending.set_result(owner)
        return owner

    def get_owner_rref(self, rref_id) -> Future:
        """A future of the OwnerRRef; pending when the RRef is used before it is created (pending owners)."""
        with self.lock:
            owner = self.owners.get(rref_id)
            if owner is None:
                fut = self.pending_owners.get(rref_id)
                if fut is None:
                    fut = Future(description=shared.pending_owner_description(rref_id, self.worker_id))
                    self.pending_owners[rref_id] = fut
                return fut
        fut = Future(description=f"OwnerRRef {rref_id!r}")
        fut.set_result(owner)
        return fut

    # -- forks ------------------------------------------------------------------------------------------------
    def prepare_child_fork(self, rref) -> tuple:
        """Fork ``rref`` for sending; return the fork data tuple (mirrors RRefContext::prepareChildFork).

        Owner: register the fork at once (Note [Early Fork Registration]). User: keep the RRef as a pending
        child until the owner confirms the child (G2; Note [Useful Phantom Fork ID for User to Owner Call]).
        """
        fd = rref.fork(self)
        if rref.is_owner():
            with self.lock:
                self.forks.setdefault(fd.rref_id, set()).add(fd.fork_id)
                self.owners[fd.rref_id] = rref
        else:
            self.add_pending_child(fd.fork_id, rref)
        return fd.to_tuple()

    def receive_fork(self, data):
        """Turn received fork data into an RRef; return ``(rref, future)``.

        Owner: ``rref`` is None and ``future`` completes with the OwnerRRef (which may not exist yet). User: a
        new UserRRef and, when the owner must confirm it first, a future completed on confirmation (user
        functions run only after that). Mirrors RRefContext::getOrCreateRRef + notifyOwnerAndParentOfFork.
        """
        fd = parse_fork_data(data)
        if fd.owner == self.worker_id:
            fut = self.get_owner_rref(fd.rref_id)
            if fd.parent == self.worker_id:
                # Owner sent the RRef to itself: drop the fork added while pickling.
                self.del_fork_of_owner(fd.rref_id, fd.fork_id)
            else:
                # See Note [Useful Phantom Fork ID for User to Owner Call]: accept the parent's child (G2).
                self._send_control(fd.parent, K_CHILD_ACCEPT, fd.fork_id.key())
            return None, fut
        user = UserRRef(fd.owner, fd.rref_id, fd.fork_id)
        if fd.parent == fd.owner:
            # Early fork registration: the owner added this fork before sending it.
            self.add_confirmed_user(user)
            return user, None
        fut = Future(description=shared.confirmation_description(user))
        user.confirm_future = fut
        self.add_pending_user(fd.fork_id, user)
        parent = fd.parent
        self._send_control(fd.owner, K_FORK_REQUEST, fd.rref_id.key() + fd.fork_id.key(),
                           lambda: self.finish_fork_request(user.fork_id, parent))
        return user, fut

    def finish_fork_request(self, fork_id, parent: int) -> None:
        """The owner accepted a forked child: confirm it and tell its parent (mirrors finishForkRequest)."""
        self.del_pending_user(fork_id)
        self._send_control(parent, K_CHILD_ACCEPT, fork_id.key())

    def add_pending_user(self, fork_id, user) -> None:
        """Keep ``user`` alive until the owner confirms it (G2)."""
        with self.lock:
            if fork_id in self.pending_users:
                raise shared.duplicate_user(fork_id)
            self.pending_users[fork_id] = user

    def del_pending_user(self, fork_id) -> None:
        """The owner confirmed the user: move it to confirmed users; send its deferred deletion if released.

        Tolerates duplicates (idempotent control messages).
        """
        with self.lock:
            user = self.pending_users.pop(fork_id, None)
            if user is None:
                return
            user.confirmed = True
            self.confirmed_users[fork_id] = user
            fut = user.confirm_future
        if fut is not None and not fut.done():
            fut.set_result(user)
        self._maybe_delete(user)

    def add_confirmed_user(self, user) -> None:
        """Record a user the owner already knows (mirrors RRefContext::addConfirmedUser)."""
        with self.lock:
            user.confirmed = True
            self.confirmed_users[user.fork_id] = user

    def add_pending_child(self, fork_id, rref) -> None:
        """Keep the parent ``rref`` alive until the owner confirms the child ``fork_id`` (G2)."""
        with self.lock:
            if fork_id in self.pending_children:
                raise shared.duplicate_child(fork_id)
            self.pending_children[fork_id] = rref
            rref.n_pending_children += 1

    def del_pending_child(self, fork_id) -> None:
        """The child is confirmed: release the parent (and send its deferred deletion). Tolerates duplicates."""
        with self.lock:
            parent = self.pending_children.pop(fork_id, None)
            if parent is None:
                return
            parent.n_pending_children -= 1
        self._maybe_delete(parent)

    def add_fork_of_owner_if_not_present(self, rref_id, fork_id) -> None:
        """Owner: count a fork, unless already counted or already deleted (idempotent fork requests)."""
        with self.lock:
            if fork_id in self.deleted_forks:
                return
            self.forks.setdefault(rref_id, set()).add(fork_id)

    def del_fork_of_owner(self, rref_id, fork_id):
        """Owner: drop a fork; when none remain, drop the OwnerRRef. Duplicates tolerated.

        Mirrors RRefContext::delForkOfOwner. Returns the deleted OwnerRRef or None.
        """
        with self.lock:
            self.deleted_forks.add(fork_id)
            forks = self.forks.get(rref_id)
            if forks is None:
                return None
            forks.discard(fork_id)
            if forks:
                return None
            del self.forks[rref_id]
            deleted = self.owners.pop(rref_id, None)
            return deleted

    # -- control messages -------------------------------------------------------------------------------------
    def _send_control(self, dst: int, kind: int, payload: tuple, on_ack=None, attempt: int = 0) -> None:
        """Send a control message; re-send it when the acknowledgement times out (it is idempotent)."""
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
                    self.errors.append(shared.control_failed(kind, payload, dst, exc))

        fut.add_done_callback(acked)

    def handle(self, src: int, kind: int, payload) -> None:
        """Apply a received control message (idempotent); the return value is the acknowledgement.

        A payload that is not the kind's tuple of valid id ints is an RRefProtocolError (nothing is applied).
        """
        if not (type(kind) is int and type(payload) is tuple and len(payload) == shared.CONTROL_PAYLOAD_LEN.get(kind)):
            raise shared.malformed_control(src, kind, payload)
        try:
            first = GloballyUniqueId(payload[0], payload[1])
            second = GloballyUniqueId(payload[2], payload[3]) if len(payload) == 4 else None
        except RRefProtocolError:
            raise shared.malformed_control(src, kind, payload) from None
        if kind == K_USER_DELETE:
            # G1: a user's deletion notice (rref id, fork id).
            self.del_fork_of_owner(first, second)
        elif kind == K_FORK_REQUEST:
            # A user forked to another user; the child asks to be counted (rref id, fork id).
            self.add_fork_of_owner_if_not_present(first, second)
        else:
            # G2: the owner knows the child (fork id); the parent may be deleted now.
            self.del_pending_child(first)
        return None

    # -- deletion ---------------------------------------------------------------------------------------------
    def release_user(self, user) -> None:
        """The application dropped ``user``: send its deletion notice once, when G2 allows (mirrors tryDel)."""
        with self.lock:
            if user.released:
                return
            user.released = True
        self._maybe_delete(user)

    def _maybe_delete(self, rref) -> None:
        if rref.is_owner():
            return
        with self.lock:
            if (not rref.released or rref.deleted_on_owner or not rref.confirmed
                    or rref.n_pending_children > 0):
                return
            rref.deleted_on_owner = True
            self.confirmed_users.pop(rref.fork_id, None)
        self._send_control(rref.owner_id, K_USER_DELETE, rref.rref_id.key() + rref.fork_id.key())

    # -- shutdown and inspection ------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        """True while users await confirmation or parents await their children's (graceful shutdown waits)."""
        with self.lock:
            return bool(self.pending_users or self.pending_children)

    def idle(self) -> bool:
        """True when this worker owns nothing, awaits nothing and holds no confirmed user (shutdown is done)."""
        with self.lock:
            return not (self.owners or self.pending_users or self.pending_children or self.confirmed_users)

    def delete_all_users(self) -> int:
        """Send the deletion notice of every confirmed user (graceful shutdown; G1). Returns how many."""
        with self.lock:
            users = [self.confirmed_users[k] for k in sorted(self.confirmed_users)]
        for user in users:
            with self.lock:
                user.released = True
            self._maybe_delete(user)
        return len(users)

    def drop_unforked_owners(self) -> int:
        """Forget OwnerRRefs that have no fork (graceful shutdown). Returns how many."""
        with self.lock:
            unforked = [k for k in self.owners if not self.forks.get(k)]
            for key in unforked:
                del self.owners[key]
            return len(unforked)

    def check_leaks(self):
        """An RRefLeakError naming each leaked RRef and fork id, or None (mirrors checkRRefLeaks)."""
        with self.lock:
            forks = [(rid, sorted(self.forks[rid])) for rid in sorted(self.forks)]
            pending_users = [self.pending_users[f] for f in sorted(self.pending_users)]
            pending_children = [(f, self.pending_children[f]) for f in sorted(self.pending_children)]
        return shared.leak_error(self.worker_id, forks, pending_users, pending_children)

    def debug_info(self) -> dict:
        """Counts: owner RRefs, pending futures (owners), pending users, forks, pending children, confirmed."""
        with self.lock:
            return shared.debug_info(len(self.owners), len(self.pending_owners), len(self.pending_users),
                                     sum(len(v) for v in self.forks.values()), len(self.pending_children),
                                     len(self.confirmed_users))

    def state(self) -> dict:
        """The whole state as sorted plain tuples (equivalence tests compare the twins with it)."""
        with self.lock:
            return shared.state([k.key() for k in self.owners], [k.key() for k in self.pending_owners],
                                [(k.key(), [f.key() for f in v]) for k, v in self.forks.items()],
                                [k.key() for k in self.pending_users], [k.key() for k in self.pending_children],
                                [k.key() for k in self.confirmed_users], self.next_local_id)
