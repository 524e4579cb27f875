"""Exception types shared by both twins, so ``isinstance`` works whichever twin raised.

Every twin (``distlab.reference`` and ``distlab.core``) raises these classes and no others of its own.
"""
from __future__ import annotations

__all__ = [
    "DistlabError",
    "DistTimeoutError",
    "CollectiveMismatchError",
    "ProcessGroupBrokenError",
    "RankFailedError",
    "CoreNotBuiltError",
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
