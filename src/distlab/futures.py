"""``Future``: the result of an asynchronous operation (what comm hooks, ``Work.get_future`` and RPC return).

Modelled on ``torch.futures.Future``: ``wait``, ``value``, ``done``, ``then``, ``add_done_callback``,
``set_result``, ``set_exception`` and :func:`collect_all`.

MPI operations progress only while some thread is inside an MPI call, so a future that stands for an MPI request
carries a *driver*: ``wait()`` calls it to push the request to completion (with a timeout) instead of sleeping
on a condition variable that nobody would ever signal.

Timeouts (:func:`check_timeout`, used by every distlab wait): a number of seconds or a ``datetime.timedelta``.
``None`` means the default, ``DISTLAB_TIMEOUT`` (300 s). ``inf`` means no deadline at all (as a very large
``timedelta`` does in PyTorch): the wait may then hang, which is what the bound exists to prevent, so use it only
under a debugger. NaN, negative values and ``0`` are refused: ``0`` means "the default" to c10d's ``Work.wait``
and "no timeout" to torch RPC, and "do not wait" to Python's own waits; rather than guess, distlab asks for
``None`` (the default) or ``is_completed()`` (to poll). :func:`resolve_timeout` is the one place a wait turns its
``timeout`` argument (or None) into seconds. The RPC API is the one exception, as in torch: there ``0`` means
"no timeout" (``distlab.rpc.init_rpc(rpc_timeout=0)``, ``rpc_sync(..., timeout=0)``).

This module does not import MPI: RPC, the autograd engine and tests use futures without an MPI job.
"""
from __future__ import annotations

import datetime
import logging
import math
import numbers
import os
import threading
import time
import types
from typing import Any, Callable, Iterable

from .errors import DistTimeoutError

__all__ = ["Future", "collect_all", "default_timeout", "check_timeout", "resolve_timeout"]

_UNSET = object()
log = logging.getLogger("distlab.futures")


def check_timeout(value, what: str) -> float:
    """Return ``value`` (seconds, or a ``datetime.timedelta``) as float seconds; refuse what is not a timeout.

    Parameters
    ----------
    value : float, int or datetime.timedelta
        The timeout. ``inf`` means no deadline.
    what : str
        The argument or variable it came from, named in the error (``"ProcessGroup(timeout)"``).

    Raises
    ------
    TypeError
        ``value`` is neither a real number nor a ``timedelta``.
    ValueError
        ``value`` is NaN, negative or zero.
    """
    if type(value) is float and 0.0 < value:  # the common case, checked first: it runs on every wait (NaN fails)
        return value
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{what} must be a number of seconds or a datetime.timedelta, got {value!r}")
    if math.isnan(seconds):
        raise ValueError(f"{what} is NaN: a timeout must be a positive number of seconds (inf for no deadline)")
    if seconds < 0:
        raise ValueError(f"{what}={seconds:g} is negative: a timeout must be a positive number of seconds")
    if seconds == 0:
        raise ValueError(f"{what}=0 is ambiguous (torch reads it as 'the default' or 'no timeout', Python as "
                         "'do not wait'): pass None for the default timeout, a positive number of seconds, or "
                         "inf for no deadline; poll with is_completed()")
    return seconds


def default_timeout() -> float:
    """The default timeout of every blocking wait, in seconds: ``DISTLAB_TIMEOUT`` (default 300).

    Checked as :func:`check_timeout` does: ``nan``, negative values and ``0`` are refused, ``inf`` means no deadline.
    """
    value = os.environ.get("DISTLAB_TIMEOUT", "300")
    try:
        timeout = float(value)
    except ValueError:
        raise ValueError(f"DISTLAB_TIMEOUT={value!r} is not a number of seconds") from None
    return check_timeout(timeout, f"DISTLAB_TIMEOUT={value!r}")


def resolve_timeout(value, what: str, default: float | None = None) -> float:
    """The timeout a wait runs under: ``value`` checked by :func:`check_timeout`, or, when it is None, ``default``
    (already checked, say a group's own timeout) or else :func:`default_timeout`."""
    if value is None:
        return default_timeout() if default is None else default
    return check_timeout(value, what)


def _event_wait(event: threading.Event, deadline: float) -> bool:
    """``event.wait`` until the monotonic ``deadline`` (inf: no deadline; ``Event.wait(inf)`` overflows)."""
    if deadline == math.inf:
        return event.wait()
    return event.wait(max(deadline - time.monotonic(), 0.0))


class Future:
    """A value that will be available later, or an exception.

    Parameters
    ----------
    driver : callable, optional
        ``driver(timeout)`` pushes the underlying operation to completion (it completes this future or raises
        :class:`~distlab.errors.DistTimeoutError`); ``timeout`` is None when the waiter gave none, and the
        driver then applies the operation's own (a collective's: its process group's timeout). Futures
        completed by another thread need none.
    description : str, optional
        What this future stands for, used in timeout messages.
    """

    __slots__ = ("_lock", "_event", "_value", "_exception", "_callbacks", "_driver", "_description")
    __class_getitem__ = classmethod(types.GenericAlias)  # ``Future[np.ndarray]``, as torch.futures.Future[T]

    def __init__(self, *, driver: Callable[[float | None], Any] | None = None, description: str = "future"):
        # A plain lock is cheap; the Event a waiting thread sleeps on is made only when someone waits
        # (most futures complete before anyone does: RPC replies, comm hooks chained with then()).
        self._lock = threading.Lock()
        self._event: threading.Event | None = None
        self._value = _UNSET
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future], Any]] = []
        self._driver = driver
        self._description = description

    # -- completion -------------------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once a result or an exception has been set."""
        return self._value is not _UNSET or self._exception is not None

    def set_result(self, value) -> None:
        """Complete the future with ``value`` and run its callbacks. Completing twice is an error."""
        self._complete(value, None)

    def set_exception(self, exception: BaseException) -> None:
        """Complete the future with ``exception`` (raised by ``wait`` and ``value``) and run its callbacks."""
        if not isinstance(exception, BaseException):
            raise TypeError(f"set_exception needs an exception instance, got {type(exception).__name__}")
        self._complete(_UNSET, exception)

    def _complete(self, value, exception) -> None:
        with self._lock:
            if self.done():
                raise RuntimeError(f"{self._description}: the future is already completed")
            if exception is not None:
                self._exception = exception
            else:
                self._value = value
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            self._run_callback(callback)

    def _run_callback(self, callback) -> None:
        # A failing callback must not stop the others, nor lose the error: log it like torch does.
        try:
            callback(self)
        except Exception:  # noqa: BLE001
            log.exception("a Future callback raised")

    # -- waiting ----------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None):
        """Block until completed and return the value (or raise the stored exception).

        Parameters
        ----------
        timeout : float or datetime.timedelta, optional
            Seconds to wait (see :func:`check_timeout`). By default the operation's own timeout when it has
            one (a collective's future: its process group's timeout, as in torch), else ``DISTLAB_TIMEOUT``.

        Raises
        ------
        DistTimeoutError
            The future did not complete in time. A future chained with :meth:`then` to one whose operation timed
            out raises that operation's error (naming its missing ranks).
        """
        if not self.done():
            given = timeout is not None
            timeout = resolve_timeout(timeout, "Future.wait(timeout)")
            deadline = time.monotonic() + timeout
            if self._driver is not None:
                self._driver(timeout if given else None)  # completes this future (perhaps through callbacks) or raises
            if not self.done():
                # Completed by another thread (an RPC reply, or the callback of a parent completed elsewhere
                # that has not yet run): sleep on an event until it is.
                with self._lock:
                    if self._event is None:
                        self._event = threading.Event()
                    event = self._event
                if not self.done() and not _event_wait(event, deadline) and not self.done():
                    raise DistTimeoutError(
                        f"{self._description} did not complete within {timeout:g} s",
                        op=self._description, timeout=timeout,
                    )
        return self.value()

    def value(self):
        """Return the value of a completed future (raise its exception). Not completed is an error."""
        if self._exception is not None:
            raise self._exception
        if self._value is _UNSET:
            raise RuntimeError(f"{self._description} is not completed yet; call wait() first")
        return self._value

    def exception(self) -> BaseException | None:
        """The stored exception of a completed future, or None."""
        return self._exception

    result = wait

    # -- chaining ---------------------------------------------------------------------------------------------
    def add_done_callback(self, callback: Callable[["Future"], Any]) -> None:
        """Run ``callback(self)`` once completed (at once if already completed)."""
        with self._lock:
            if not self.done():
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """Return a new future completed with ``callback(self)``; an exception in either propagates to it.

        Waiting on the new future drives this one. If this one fails (a collective timed out, an RPC raised),
        ``callback`` still runs, as in torch, and ``self.value()`` inside it raises the error, which completes
        the new future. If waiting on this one times out without completing it (an RPC reply that may still
        come), the new future's ``wait`` raises that same :class:`~distlab.errors.DistTimeoutError`.
        """
        chained = Future(driver=self._drive_then, description=f"then({self._description})")

        def run(parent: Future) -> None:
            try:
                chained.set_result(callback(parent))
            except BaseException as exc:  # noqa: BLE001 - propagate whatever the callback raised
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    def _drive_then(self, timeout: float | None) -> None:
        # Waiting on a chained future drives its parent; the parent's callback then completes the child. A parent
        # that failed completed the child with its error already; a parent still pending after its wait timed out
        # has not, so its DistTimeoutError (with the missing ranks) is the child's too.
        try:
            self.wait(timeout)
        except BaseException:  # noqa: BLE001
            if not self.done():
                raise

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("error" if self._exception is not None else "done")
        return f"<distlab.Future {self._description} {state}>"


def collect_all(futures: Iterable[Future]) -> Future:
    """Return a future completed with the list of ``futures`` once every one of them is completed.

    A failed future does not fail the result (inspect each one), as in torch; waiting on the result raises the
    :class:`~distlab.errors.DistTimeoutError` of a future that timed out without completing.
    """
    futures = list(futures)
    combined = Future(driver=lambda timeout: _wait_all(futures, timeout), description="collect_all")
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        combined.set_result([])
        return combined

    def one_done(_fut: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result(futures)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


def _wait_all(futures, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout  # None: each future's own timeout
    for fut in futures:
        try:
            fut.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        except BaseException:  # noqa: BLE001
            if not fut.done():
                raise  # timed out (or could not be driven): the combined future has no result to give
            # else it failed: collect_all completes with failed futures inside
