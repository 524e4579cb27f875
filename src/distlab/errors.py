"""Exception types shared by both twins, so ``isinstance`` works whichever twin raised.

Every twin (``distlab.reference`` and ``distlab.core``) raises these classes and no others of its own.
"""
from __future__ import annotations

__all__ = [
    "DistlabError",
    "DistTimeoutError",
    "CollectiveMismatchError",
    "ProcessGroupBrokenError",
    "ProcessFailedError",
    "RankFailedError",
    "CoreNotBuiltError",
    "MpiNotFoundError",
    "FaultToleranceUnsupportedError",
    "CommHookError",
    "RpcError",
    "RpcThreadLevelError",
    "RpcMessageError",
    "RpcDeviceError",
    "RemoteError",
    "RRefError",
    "RRefDeletedError",
    "RRefCreationTimeoutError",
    "RRefLeakError",
    "RRefProtocolError",
    "RRefIdOverflowError",
    "DistAutogradError",
    "AutogradContextNotFoundError",
    "AutogradIdOverflowError",
    "DistBackwardError",
    "MessageFormatError",
    "CacheStateError",
    "CollectiveError",
    "DuplicateNameError",
    "NotInitializedError",
    "StallShutdownError",
    "CacheEvictionWarning",
    "StallWarning",
    "ClusterError",
    "ClusterPermissionError",
    "CheckpointException",
]


class DistlabError(RuntimeError):
    """Base class of every error distlab raises on purpose."""


class DistTimeoutError(DistlabError, TimeoutError):
    """A blocking wait ran past its timeout.

    Attributes
    ----------
    op : str
        The operation that was waited on (``"allreduce"``, ``"barrier"``, ...).
    seq : int
        The operation's sequence number in its process group (every rank numbers collectives the same way).
    name : str or None
        The tensor or bucket the operation carried, when the caller named it.
    missing_ranks : list of int
        Ranks that had not entered this operation when the wait gave up (found through a side channel).
    timeout : float
        The timeout, in seconds.
    """

    def __init__(self, message, *, op=None, seq=None, name=None, missing_ranks=(), timeout=None):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.name = name
        self.missing_ranks = list(missing_ranks)
        self.timeout = timeout


class CollectiveMismatchError(DistlabError, ValueError):
    """Ranks called different collectives, or the same one with different shapes, dtypes or roots.

    Raised on every rank by ``DISTLAB_DEBUG=DETAIL``. ``groups`` maps each distinct fingerprint description to
    the ranks that sent it.
    """

    def __init__(self, message, *, seq=None, groups=None):
        super().__init__(message)
        self.seq = seq
        self.groups = dict(groups or {})


class ProcessGroupBrokenError(DistlabError):
    """A process group is unusable: an earlier operation on it timed out and may still be in flight."""


class ProcessFailedError(ProcessGroupBrokenError):
    """Processes of a group have failed (died): what every survivor's operation on the group raises under fault
    tolerance (ULFM's ``MPI_ERR_PROC_FAILED``, or ``MPI_ERR_REVOKED`` once a peer revoked the group), and what a
    recovery step that cannot finish raises. The group is unusable until it is rebuilt on the survivors
    (:mod:`distlab.comm.ulfm`).

    Attributes
    ----------
    failed_ranks : list of int
        The failed processes' ranks in ``COMM_WORLD`` (the world the job started with), sorted.
    group_ranks : list of int
        The same processes' ranks in the group the error arose on.
    group : str or None
        That group's name.
    op : str or None
        The operation that failed (``"allreduce"``, ``"shrink"``, ...).
    revoked : bool
        The group had been revoked (by this rank or a peer) when the operation failed.
    error_class : int or None
        The MPI error class (``MPI.ERR_PROC_FAILED`` or ``MPI.ERR_REVOKED``), when MPI reported one.
    """

    def __init__(self, message, *, failed_ranks=(), group_ranks=(), group=None, op=None, revoked=False,
                 error_class=None):
        super().__init__(message)
        self.failed_ranks = sorted(int(r) for r in failed_ranks)
        self.group_ranks = sorted(int(r) for r in group_ranks)
        self.group = group
        self.op = op
        self.revoked = bool(revoked)
        self.error_class = error_class

    def __reduce__(self):  # keeps the ranks when the error travels (RPC, distlab.run)
        return _rebuild_process_failed_error, (str(self), self.failed_ranks, self.group_ranks, self.group, self.op,
                                               self.revoked, self.error_class)


def _rebuild_process_failed_error(message, failed_ranks, group_ranks, group, op, revoked, error_class):
    return ProcessFailedError(message, failed_ranks=failed_ranks, group_ranks=group_ranks, group=group, op=op,
                              revoked=revoked, error_class=error_class)


class FaultToleranceUnsupportedError(DistlabError):
    """Fault tolerance (ULFM: revoke, agree, shrink) was asked of an MPI that cannot provide it: MPICH's ch4
    device (the ``mpich`` wheel's) has only stubs for it, and Open MPI provides it only when started with
    ``--with-ft ulfm`` (``distlab run --fault-tolerance``). The message names the reason and what to do."""


class RankFailedError(DistlabError):
    """A function run with :func:`distlab.run` raised on one or more ranks.

    Attributes
    ----------
    rank : int
        The first rank that failed.
    remote_traceback : str
        That rank's formatted traceback.
    failures : dict
        Every failed rank mapped to its traceback text.
    """

    def __init__(self, message, *, rank=None, remote_traceback="", failures=None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.failures = dict(failures or {})


class CoreNotBuiltError(ImportError):
    """The Cython core twin was requested (``DISTLAB_IMPL=core`` or ``auto``) but is not compiled."""


class MpiNotFoundError(ImportError):
    """No MPI library that mpi4py could load is installed (or ``MPI4PY_LIBMPI`` / ``DISTLAB_MPI`` name one that
    is not there); the message says how to install one."""


class CommHookError(DistlabError, TypeError):
    """A DDP communication hook broke its contract: it returned something other than a
    :class:`~distlab.futures.Future`, or its Future completed with something other than the reduced bucket.

    Both a TypeError (what it is) and a RuntimeError (what torch raises, "callback must return a
    torch.futures.Future"), so that code written for either catches it.
    """


# -- RPC and RRefs (distlab.rpc, twinned rref protocol) -------------------------------------------------------
class RpcError(DistlabError):
    """Base class of RPC errors: the agent is not running, a message is malformed, a worker is unknown."""


class RpcThreadLevelError(RpcError):
    """The MPI library does not provide ``MPI_THREAD_MULTIPLE``, which the RPC agent's listener thread needs."""


class RpcMessageError(RpcError):
    """A malformed RPC message: wrong magic, wire version or checksum, sizes out of bounds, missing buffers.

    Attributes
    ----------
    kind, flags, mid : int or None
        The message's kind, flags and message id when its header could be trusted (checksum intact), else None:
        the agent then answers the sender's request with this error instead of leaving it to time out.
    sizes : tuple of int or None
        The out-of-band buffer sizes the refused message announced, when they were checked and found within
        bounds: the listener receives those buffers into nothing, so they are not taken for a later message's.
    """

    def __init__(self, message, *, kind=None, flags=None, mid=None):
        super().__init__(message)
        self.kind = kind
        self.flags = flags
        self.mid = mid
        self.sizes = None

    def __reduce__(self):  # travels back to the sender of the malformed request
        return _rebuild_rpc_message_error, (str(self), self.kind, self.flags, self.mid)


def _rebuild_rpc_message_error(message, kind, flags, mid):
    return RpcMessageError(message, kind=kind, flags=flags, mid=mid)


class RpcDeviceError(RpcError, ValueError):
    """Device arrays and RPC: an array on a device no device map covers for its destination, a device map that
    names a device a worker lacks or maps two devices to one, or a device record this worker cannot honour."""


class RemoteError(RpcError):
    """A function run through RPC raised on the remote worker.

    Attributes
    ----------
    worker_name : str
        The worker the exception was raised on.
    exc_type : str
        The qualified name of the remote exception's type.
    remote_traceback : str
        The remote worker's formatted traceback.
    remote_exception : BaseException or None
        The remote exception itself when it could be pickled, else None.
    """

    def __init__(self, message, *, worker_name="", exc_type="", remote_traceback="", remote_exception=None):
        super().__init__(message)
        self.worker_name = worker_name
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.remote_exception = remote_exception


class RRefError(DistlabError):
    """Base class of RRef protocol errors (ANCHORS section 5)."""


class RRefDeletedError(RRefError):
    """A UserRRef was used (``to_here``, fork, proxy) after its deletion notice was sent to the owner."""


class RRefCreationTimeoutError(RRefError):
    """``to_here`` (or a fork) on an RRef whose ``remote()`` creation timed out: the OwnerRRef may not exist."""


class RRefLeakError(RRefError):
    """Shutdown found RRefs still referenced; the message names every leaked RRef id and fork id."""


class RRefProtocolError(RRefError):
    """Inconsistent RRef protocol state: a message that cannot be applied (malformed or impossible)."""


class RRefIdOverflowError(RRefError, OverflowError):
    """A worker's RRef id counter is exhausted (ids are ``(worker id, local id)`` with ``RREF_LOCAL_ID_BITS``
    bits of local id; see :mod:`distlab._wire`)."""


# -- distributed autograd (distlab.distributed_autograd, twinned autograd containers) ------------------------
class DistAutogradError(DistlabError):
    """Base class of distributed autograd errors (ANCHORS section 4): use before init, re-init with another worker
    id, a nested context on one thread, no current context, a duplicate send/recv function, an unknown message id."""


class AutogradContextNotFoundError(DistAutogradError, LookupError):
    """No autograd context with this id exists on this worker ("could not find autograd context")."""


class AutogradIdOverflowError(DistAutogradError, OverflowError):
    """A worker's 48-bit context or message id counter is exhausted (it would overflow into the worker id bits)."""


class DistBackwardError(DistAutogradError):
    """A distributed backward pass failed; the message names the worker it failed on.

    Attributes
    ----------
    worker_id : int
        The worker whose engine (or gradient RPC) raised.
    context_id : int
        The autograd context of the pass.
    """

    def __init__(self, message, *, worker_id=None, context_id=None):
        super().__init__(message)
        self.worker_id = worker_id
        self.context_id = context_id

    def __reduce__(self):  # keep the attributes when the error travels back through RPC
        return _rebuild_dist_backward_error, (str(self), self.worker_id, self.context_id)


def _rebuild_dist_backward_error(message, worker_id, context_id):
    return DistBackwardError(message, worker_id=worker_id, context_id=context_id)


# -- negotiated collectives (distlab.collectives, twinned negotiation engine) ---------------------------------
class MessageFormatError(DistlabError, ValueError):
    """A negotiation message could not be decoded: truncated, trailing bytes, a wrong magic or version, or a field
    out of its range (an unknown type or dtype, a negative dimension, a NaN scale factor, an unknown flag)."""


class CacheStateError(DistlabError):
    """The response cache was used against its rules (e.g. overwriting an INVALID entry, an unknown bit)."""


class CollectiveError(DistlabError):
    """A negotiated collective failed on every rank (e.g. ranks submitted a tensor with different shapes).

    Attributes
    ----------
    names : list of str
        The tensors the error response covered.
    """

    def __init__(self, message, *, names=()):
        super().__init__(message)
        self.names = list(names)


class DuplicateNameError(DistlabError, ValueError):
    """A tensor name was submitted while a collective of the same name is still in flight on this rank."""


class NotInitializedError(DistlabError):
    """distlab.collectives was used before ``init()``, after ``shutdown()``, or after the engine stopped."""


class StallShutdownError(DistlabError):
    """The stall inspector shut the collectives down (``DISTLAB_STALL_SHUTDOWN_TIME`` was exceeded)."""


class CacheEvictionWarning(RuntimeWarning):
    """The response cache evicted an entry because it was full (shown once per cache)."""


class StallWarning(RuntimeWarning):
    """Some ranks submitted a tensor and others have not, for longer than ``DISTLAB_STALL_CHECK_TIME``."""


# -- the virtual cluster (distlab.cluster) ----------------------------------------------------------------------
class ClusterError(DistlabError):
    """The virtual cluster could not be built, inspected or removed (a bad name, a missing tool, a netlink error)."""


class ClusterPermissionError(ClusterError, PermissionError):
    """Building network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); the message says how to run it."""


# -- checkpoints (distlab.checkpoint) ----------------------------------------------------------------------------
class CheckpointException(DistlabError):
    """A checkpoint could not be saved or loaded; raised on every rank (torch's ``CheckpointException``).

    Attributes
    ----------
    failures : dict
        Every rank that failed mapped to its reason (one line naming the file and the key where there is one).
    """

    def __init__(self, message, failures=None):
        super().__init__(message)
        self.failures = dict(failures or {})
