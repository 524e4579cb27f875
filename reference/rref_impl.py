"""Ids, fork data and the two kinds of RRef (reference twin; mirrors rref_impl.h and types.h).

Part of the RRef component :mod:`distlab.reference.rref` (read its introduction first). Twinned with
``core/_rref_impl.pxi``. Nothing here sends messages: :mod:`distlab.reference.rref_context` drives these objects.
"""
from __future__ import annotations

from distlab._common import rref as shared
from distlab._common.rref import LOCAL_ID_LIMIT, UNSET, WORKER_ID_LIMIT
from distlab._wire import RFD_TUPLE_SIZE
from distlab.futures import Future

__all__ = ["GloballyUniqueId", "RRefForkData", "OwnerRRef", "UserRRef", "parse_fork_data"]


class GloballyUniqueId:
    """Id of an RRef or of a fork: the worker that made it and a counter local to that worker.

    Mirrors types.h ``GloballyUniqueId`` (``RRefId`` and ``ForkId`` are both this type). ``created_on`` is in
    [0, 2**16) and ``local_id`` in [0, 2**40) (``distlab._wire``); anything else is an RRefProtocolError.
    """

    __slots__ = ("created_on", "local_id")

    def __init__(self, /, created_on: int, local_id: int):
        if not (type(created_on) is int and type(local_id) is int
                and 0 <= created_on < WORKER_ID_LIMIT and 0 <= local_id < LOCAL_ID_LIMIT):
            raise shared.malformed_id(created_on, local_id)
        self.created_on = created_on
        self.local_id = local_id

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
        return shared.gid_repr(self.created_on, self.local_id)


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
        return shared.fork_data_repr(self.owner, self.rref_id, self.fork_id, self.parent)


def _is_worker(value) -> bool:
    return type(value) is int and 0 <= value < WORKER_ID_LIMIT


def parse_fork_data(data) -> RRefForkData:
    """Validate a wire tuple and return the :class:`RRefForkData` (RRefProtocolError when malformed)."""
    if not (type(data) is tuple and len(data) == RFD_TUPLE_SIZE and _is_worker(data[0]) and _is_worker(data[5])):
        raise shared.malformed_fork_data(data)
    owner, rref_created_on, rref_local_id, fork_created_on, fork_local_id, parent = data
    try:
        rref_id = GloballyUniqueId(rref_created_on, rref_local_id)
        fork_id = GloballyUniqueId(fork_created_on, fork_local_id)
    except shared.RRefProtocolError:
        raise shared.malformed_fork_data(data) from None
    return RRefForkData(owner, rref_id, fork_id, parent)


class OwnerRRef:
    """The owner's single instance of an RRef: holds the value as a future (value or error).

    Mirrors rref_impl.h ``OwnerRRef`` (``getValue``, ``setValue``, ``setError``, ``hasValue``, ``getFuture``).
    """

    __slots__ = ("owner_id", "rref_id", "future", "__weakref__")

    def __init__(self, /, owner_id: int, rref_id: GloballyUniqueId, value=UNSET):
        self.owner_id = owner_id
        self.rref_id = rref_id
        self.future = Future(description=shared.value_description(rref_id))
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
        return shared.owner_repr(self.rref_id)


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
            raise shared.deleted_error(self.rref_id, self.fork_id, what)
        if self.timed_out:
            raise shared.creation_timeout_error(self.rref_id, self.owner_id, what)

    def fork(self, ctx) -> RRefForkData:
        """Fork data for a new child; forking a deleted UserRRef is an error (mirrors UserRRef::fork)."""
        if self.deleted_on_owner:
            raise shared.deleted_error(self.rref_id, self.fork_id, "fork")
        return RRefForkData(self.owner_id, self.rref_id, ctx.gen_id(), ctx.worker_id)

    def __repr__(self):
        return shared.user_repr(self.rref_id, self.fork_id)
