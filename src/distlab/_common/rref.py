"""Shared by both RRef twins (``distlab.reference.rref`` and ``distlab.core._rref``), written once.

The twins compile (core) or spell out (reference) the per-message protocol: forks, confirmations, deletions,
counts. Everything else lives here, so the two cannot drift apart: the valid id ranges, construction checks,
every error the protocol raises (same class, same words in both twins), the string forms, the leak report and
the debug counters.
"""
from __future__ import annotations

from distlab._wire import RFD_TUPLE_SIZE, RPC_KIND_CODES, RREF_LOCAL_ID_BITS, RREF_WORKER_ID_BITS
from distlab.errors import (RRefCreationTimeoutError, RRefDeletedError, RRefIdOverflowError, RRefLeakError,
                            RRefProtocolError)

__all__ = [
    "UNSET", "WORKER_ID_LIMIT", "LOCAL_ID_LIMIT", "K_USER_DELETE", "K_FORK_REQUEST", "K_CHILD_ACCEPT",
    "CONTROL_PAYLOAD_LEN", "check_worker_id", "malformed_id", "malformed_fork_data", "malformed_control",
    "id_overflow", "deleted_error", "creation_timeout_error", "duplicate_user", "duplicate_child",
    "control_failed", "gid_repr", "fork_data_repr", "owner_repr", "user_repr", "value_description",
    "pending_owner_description", "confirmation_description", "leak_error", "debug_info", "state",
]


class _Unset:
    """The "no value yet" default of ``OwnerRRef(value=UNSET)`` (None is a valid value)."""

    __slots__ = ()

    def __repr__(self):
        return "UNSET"

    def __reduce__(self):
        return "UNSET"


UNSET = _Unset()

#: Ids are valid when ``0 <= created_on < WORKER_ID_LIMIT`` and ``0 <= local_id < LOCAL_ID_LIMIT`` (ints).
WORKER_ID_LIMIT = 1 << RREF_WORKER_ID_BITS
LOCAL_ID_LIMIT = 1 << RREF_LOCAL_ID_BITS

K_USER_DELETE = RPC_KIND_CODES["user_delete"]
K_FORK_REQUEST = RPC_KIND_CODES["fork_request"]
K_CHILD_ACCEPT = RPC_KIND_CODES["child_accept"]
#: The payload of each control message: (rref id, fork id) as 4 ints, or the child's fork id as 2 ints.
CONTROL_PAYLOAD_LEN = {K_USER_DELETE: 4, K_FORK_REQUEST: 4, K_CHILD_ACCEPT: 2}


# -- construction ---------------------------------------------------------------------------------------------
def check_worker_id(worker_id) -> int:
    """Validate a worker id given to a constructor (an int in [0, WORKER_ID_LIMIT)); return it."""
    if type(worker_id) is not int or not 0 <= worker_id < WORKER_ID_LIMIT:
        raise ValueError(f"RRef worker id must be an int in [0, {WORKER_ID_LIMIT}), got {worker_id!r}")
    return worker_id


# -- errors (both twins raise exactly these) --------------------------------------------------------------------
def malformed_id(created_on, local_id) -> RRefProtocolError:
    return RRefProtocolError(
        f"malformed RRef id ({created_on!r}, {local_id!r}): expected two ints, created_on in "
        f"[0, {WORKER_ID_LIMIT}) and local_id in [0, 2**{RREF_LOCAL_ID_BITS})")


def malformed_fork_data(data) -> RRefProtocolError:
    return RRefProtocolError(
        f"malformed RRef fork data {data!r}: expected a tuple of {RFD_TUPLE_SIZE} ints (owner, rref id, fork id, "
        f"parent) with worker ids in [0, {WORKER_ID_LIMIT}) and local ids in [0, 2**{RREF_LOCAL_ID_BITS})")


def malformed_control(src, kind, payload) -> RRefProtocolError:
    return RRefProtocolError(
        f"malformed RRef control message from worker {src!r}: kind {kind!r}, payload {payload!r} (expected kind "
        f"{K_USER_DELETE} or {K_FORK_REQUEST} with (rref id, fork id) as 4 ints, or {K_CHILD_ACCEPT} with a fork id "
        f"as 2 ints; created_on in [0, {WORKER_ID_LIMIT}) and local_id in [0, 2**{RREF_LOCAL_ID_BITS}))")


def id_overflow(worker_id) -> RRefIdOverflowError:
    return RRefIdOverflowError(f"worker {worker_id} has used all 2**{RREF_LOCAL_ID_BITS} RRef ids")


def deleted_error(rref_id, fork_id, what) -> RRefDeletedError:
    return RRefDeletedError(f"User RRef with RRefId={rref_id!r} and ForkId={fork_id!r} has been deleted. "
                            f"Cannot call {what} on it after deletion.")


def creation_timeout_error(rref_id, owner_id, what) -> RRefCreationTimeoutError:
    return RRefCreationTimeoutError(
        f"RRef creation via rpc.remote() timed out for RRefId={rref_id!r}, and it is possible that the RRef on "
        f"the owner (worker {owner_id}) does not exist; cannot call {what}.")


def duplicate_user(fork_id) -> RRefProtocolError:
    return RRefProtocolError(f"Inconsistent states: attempt to add the same UserRRef twice {fork_id!r}")


def duplicate_child(fork_id) -> RRefProtocolError:
    return RRefProtocolError(f"Inconsistent states: attempt to add the same child fork twice {fork_id!r}")


def control_failed(kind, payload, dst, exc) -> str:
    """The line a context records in ``errors`` when a control message cannot be delivered."""
    return f"control message {kind} {payload} to worker {dst} failed: {exc!r}"


# -- string forms ---------------------------------------------------------------------------------------------
def gid_repr(created_on, local_id) -> str:
    return f"GloballyUniqueId(created_on={created_on}, local_id={local_id})"


def fork_data_repr(owner, rref_id, fork_id, parent) -> str:
    return f"RRefForkData(owner={owner}, rref_id={rref_id!r}, fork_id={fork_id!r}, parent={parent})"


def owner_repr(rref_id) -> str:
    return f"OwnerRRef(rref_id={rref_id!r})"


def user_repr(rref_id, fork_id) -> str:
    return f"UserRRef(rref_id={rref_id!r}, fork_id={fork_id!r})"


def value_description(rref_id) -> str:
    """The description of an OwnerRRef's value future (it names the RRef in a timeout error)."""
    return f"value of OwnerRRef({rref_id!r})"


def pending_owner_description(rref_id, worker_id) -> str:
    return f"OwnerRRef {rref_id!r} on worker {worker_id}"


def confirmation_description(user) -> str:
    return f"confirmation of {user!r}"


# -- shutdown and inspection ----------------------------------------------------------------------------------
def leak_error(worker_id, forks, pending_users, pending_children):
    """An RRefLeakError naming each leaked RRef and fork id, or None (mirrors RRefContext::checkRRefLeaks).

    ``forks`` is ``[(rref_id, [fork_id, ...]), ...]``; ``pending_users`` ``[UserRRef, ...]``; ``pending_children``
    ``[(fork_id, parent RRef), ...]``; each sorted by id.
    """
    lines = [f"Leaking RRef {rid!r} with fork Id {fid!r}" for rid, fids in forks for fid in fids]
    lines += [f"Leaking pending UserRRef {user!r}" for user in pending_users]
    lines += [f"Leaking pending child fork Id {fid!r} of {parent!r}" for fid, parent in pending_children]
    if not lines:
        return None
    return RRefLeakError(f"worker {worker_id}: RRef leak at shutdown:\n" + "\n".join(lines))


def debug_info(owners, pending_owners, pending_users, forks, pending_children, confirmed_users) -> dict:
    """The counters of ``RRefContext.debug_info()`` (mirrors RRefContext::getDebugInfo)."""
    return {
        "num_owner_rrefs": owners,
        "num_pending_futures": pending_owners,
        "num_pending_users": pending_users,
        "num_forks": forks,
        "num_pending_children": pending_children,
        "num_confirmed_users": confirmed_users,
    }


def state(owners, pending_owners, forks, pending_users, pending_children, confirmed_users, next_local_id) -> dict:
    """``RRefContext.state()``: every id as a ``(created_on, local_id)`` tuple, each collection sorted, so the
    twins' states compare equal exactly when they hold the same protocol state."""
    return {
        "owners": sorted(owners),
        "pending_owners": sorted(pending_owners),
        "forks": sorted((rid, tuple(sorted(fids))) for rid, fids in forks),
        "pending_users": sorted(pending_users),
        "pending_children": sorted(pending_children),
        "confirmed_users": sorted(confirmed_users),
        "next_local_id": next_local_id,
    }
