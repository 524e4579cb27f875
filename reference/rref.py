"""RRefs: remote references with PyTorch's reference-counting protocol (reference twin).

Twinned with ``core/_rref.pyx``, which also holds the twin of :mod:`distlab.reference.rref_context`.

An RRef names a value that lives on one worker, its *owner*. The owner holds the single ``OwnerRRef`` (the value,
as a future); every other worker that holds the RRef holds a ``UserRRef`` with its own fork id. The owner counts
the forks of each RRef and deletes the ``OwnerRRef`` when the count drops to zero. Two guarantees make that safe
without assuming any message order (mirrors rref_impl.h, Note [RRef Protocol], and docs/source/rpc/rref.rst):

G1
    The owner is notified when any UserRRef is deleted (a ``user_delete`` control message, sent exactly once).
G2
    A parent RRef is not deleted until the owner has confirmed the child (the parent keeps a *pending child*
    until a ``child_accept`` arrives; a user is a *pending user* until the owner confirms it).

The protocol state is in :class:`~distlab.reference.rref_context.RRefContext`; this module holds the ids, the
fork data and the two RRef kinds. Nothing here touches MPI: the context emits control messages through an
injectable sender, so the same code runs under the MPI agent (:mod:`distlab.rpc`) and under an in-process
deterministic scheduler (the equivalence and reordering tests).
"""
from __future__ import annotations

from distlab._rref_shared import UNSET
from distlab._wire import RFD_TUPLE_SIZE
from distlab.errors import RRefCreationTimeoutError, RRefDeletedError, RRefProtocolError
from distlab.futures import Future

__all__ = ["GloballyUniqueId", "RRefForkData", "OwnerRRef", "UserRRef", "RRefContext", "parse_fork_data"]



class GloballyUniqueId:
    """Id of an RRef or of a fork: the worker that made it and a counter local to that worker.

    Mirrors types.h ``GloballyUniqueId`` (``RRefId`` and ``ForkId`` are both this type).
    """

    __slots__ = ("created_on", "local_id")

    def __init__(self, /, created_on: int, local_id: int):
        self.created_on = int(created_on)
        self.local_id = int(local_id)

    def key(self) -> tuple:
        """``(created_on, local_id)``: what travels on the wire and what sorts ids."""
        return (self.created_on, self.local_id)

    def __eq__(self, other):
        return isinstance(other, GloballyUniqueId) and self.key() == other.key()

    def __lt__(self, other):
        return self.key() < other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"


class RRefForkData:
    """What travels when an RRef is sent: owner, RRef id, the new fork id, and the parent (sender).

    Mirrors rref_impl.h ``RRefForkData`` (its py::tuple form, without the type string: values are Python
    objects here). Wire form: :meth:`to_tuple`, ``RFD_TUPLE_SIZE`` ints (layout in ``distlab._wire``).
    """

    __slots__ = ("owner", "rref_id", "fork_id", "parent")

    def __init__(self, /, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, parent: int):
        self.owner = owner
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.parent = parent

    def to_tuple(self) -> tuple:
        """The wire form ``(owner, rref.created_on, rref.local_id, fork.created_on, fork.local_id, parent)``."""
        return (self.owner, self.rref_id.created_on, self.rref_id.local_id,
                self.fork_id.created_on, self.fork_id.local_id, self.parent)

    def __repr__(self):
        return (f"RRefForkData(owner={self.owner}, rref_id={self.rref_id!r}, fork_id={self.fork_id!r}, "
                f"parent={self.parent})")


def parse_fork_data(data) -> RRefForkData:
    """Validate a wire tuple and return the :class:`RRefForkData` (RRefProtocolError when malformed)."""
    if not isinstance(data, tuple) or len(data) != RFD_TUPLE_SIZE or not all(type(x) is int for x in data):
        raise RRefProtocolError(f"malformed RRef fork data {data!r}: expected a tuple of {RFD_TUPLE_SIZE} ints")
    owner, rc, rl, fc, fl, parent = data
    return RRefForkData(owner, GloballyUniqueId(rc, rl), GloballyUniqueId(fc, fl), parent)


class OwnerRRef:
    """The owner's single instance of an RRef: holds the value as a future (value or error).

    Mirrors rref_impl.h ``OwnerRRef`` (``getValue``, ``setValue``, ``setError``, ``hasValue``, ``getFuture``).
    """

    __slots__ = ("owner_id", "rref_id", "future", "__weakref__")

    def __init__(self, /, owner_id: int, rref_id: GloballyUniqueId, value=UNSET):
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.future = Future(description=f"value of OwnerRRef({rref_id!r})")
        if value is not UNSET:
            self.future.set_result(value)

    def owner(self) -> int:
        """The owner's worker id (this worker)."""
        return self.owner_id

    def is_owner(self) -> bool:
        """Always True."""
        return True

    def confirmed_by_owner(self) -> bool:
        """Always True: the owner knows itself."""
        return True

    def has_value(self) -> bool:
        """True once a value or an error is set."""
        return self.future.done()

    def set_value(self, value) -> None:
        """Set the value (once)."""
        self.future.set_result(value)

    def set_error(self, exc: BaseException) -> None:
        """Set an error (once): ``get_value`` and ``to_here`` raise it."""
        self.future.set_exception(exc)

    def get_value(self, timeout=None):
        """The value, waiting up to ``timeout`` seconds for it (raises the stored error)."""
        return self.future.wait(timeout)

    def get_future(self) -> Future:
        """The future completed with the value or error."""
        return self.future

    def fork(self, ctx) -> RRefForkData:
        """Fork data for a new child of this RRef (mirrors RRef::fork)."""
        return RRefForkData(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return f"OwnerRRef(rref_id={self.rref_id!r})"


class UserRRef:
    """A user's handle on an RRef owned elsewhere: ids, confirmation and deletion state, no value.

    Mirrors rref_impl.h ``UserRRef``. ``deleted_on_owner`` is set when the deletion notice is sent (G1: sent
    once); ``released`` when the application dropped it (the notice may wait for confirmation, G2).
    """

    __slots__ = ("owner_id", "rref_id", "fork_id", "confirmed", "deleted_on_owner", "released", "timed_out",
                 "n_pending_children", "confirm_future", "creation_error", "__weakref__")

    def __init__(self, /, owner_id: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId):
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

    def owner(self) -> int:
        """The owner's worker id."""
        return self.owner_id

    def is_owner(self) -> bool:
        """Always False."""
        return False

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows this fork."""
        return self.confirmed

    def check_usable(self, what: str) -> None:
        """Raise if this UserRRef was deleted or its creation timed out (mirrors UserRRef::toHere checks)."""
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

    def fork(self, ctx) -> RRefForkData:
        """Fork data for a new child; forking a deleted UserRRef is an error (mirrors UserRRef::fork)."""
        if self.deleted_on_owner:
            raise RRefDeletedError(
                f"User RRef with RRefId={self.rref_id!r} and ForkId={self.fork_id!r} has been deleted. "
                "Cannot call fork an UserRRef after deletion.")
        return RRefForkData(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return f"UserRRef(rref_id={self.rref_id!r}, fork_id={self.fork_id!r})"


from .rref_context import RRefContext  # noqa: E402 (the context uses the classes above)
