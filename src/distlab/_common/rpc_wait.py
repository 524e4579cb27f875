"""Shared by both twins of the RPC wait (``distlab.reference.rpc_wait``, ``distlab.core._rpc_wait``), written once.

The policy every waiting RPC thread follows (how long it polls before it sleeps, how long it sleeps at most, when a
standby thread takes the listener's seat), the ``DISTLAB_RPC_WAIT`` setting, and how the core twin finds the MPI
library that mpi4py loaded, so that it can call ``MPI_Improbe`` itself with the GIL released.

Finding the library is construction-time code: it reads ``/proc/self/maps`` for a mapped ``libmpi`` (MPICH's
``libmpi.so.12``, Open MPI's ``libmpi.so.40``, the standard ABI's ``libmpi_abi.so``), opens it without loading
anything new (``RTLD_NOLOAD``), and keeps it only if its ``MPI_Get_library_version`` is the one mpi4py reports.
The size of a communicator handle (``MPI._sizeof(MPI.Comm)``: 4 for MPICH's int handles, 8 for the pointer
handles of Open MPI and of the standard ABI) says how ``MPI_Improbe`` takes its communicator. Whatever does not
check out leaves the core twin on mpi4py's calls, with the reason (:attr:`Waiter.path`), never on a guess.
"""
from __future__ import annotations

import math
import os

from distlab._env import choice

__all__ = ["REPLY_SPIN", "LISTEN_SPIN", "SLEEP_FIRST", "REPLY_SLEEP_MAX", "LISTEN_SLEEP_MAX", "IDLE_AFTER",
           "IDLE_SLEEP_MAX", "TAKEOVER",
           "STANDBY_POLL", "SELF_TEST_TAG", "check_times", "wait_setting", "libmpi", "comm_handle", "self_test_failed"]

#: A thread waiting for its reply polls (giving up the core at every poll, ``sched_yield``) this long before it
#: sleeps: round trips of tens of microseconds are caught while polling.
REPLY_SPIN = 2e-4
#: The listener polls this long after the last message it received, or after the last send of its worker, before
#: it sleeps: a worker in a conversation answers at once, an idle one costs (almost) no CPU.
LISTEN_SPIN = 1e-3
#: The first sleep after the polling phase; each next one is twice as long, up to the maximum below.
SLEEP_FIRST = 2e-6
#: The longest sleep between polls of a thread waiting for its reply (what a slow call's answer waits at most).
REPLY_SLEEP_MAX = 5e-4
#: The longest sleep between polls of an idle listener (how long a message to an idle worker waits at most).
LISTEN_SLEEP_MAX = 2e-3
#: A waiter that has seen no activity for this long is idle for good (a worker between phases of a job, or a reply
#: that takes long): its sleeps grow on, up to the longer maximum below, so such a worker wakes up less often.
IDLE_AFTER = 0.5
#: The longest sleep between polls once idle for ``IDLE_AFTER``: a message to a worker idle that long waits at most
#: 1% longer than the idleness lasted.
IDLE_SLEEP_MAX = 5e-3
#: A handler that ran this long on the listener's thread has its seat taken by the standby thread, which then
#: listens in its place (a handler that blocks never leaves its worker deaf for much longer). A busy host that
#: stalls a short handler this long only moves the seat to another thread.
TAKEOVER = 2e-3
#: How often the standby thread looks at the seat.
STANDBY_POLL = 1e-3
#: The tag of the message the core twin sends itself (on ``MPI.COMM_SELF``) to check its call of ``MPI_Improbe``.
SELF_TEST_TAG = 31_000

_found: tuple | None = None


def check_times(owner: str, positive: bool = False, **times) -> None:
    """ValueError unless each of ``times`` is a finite number of seconds, at least 0 (above 0 if ``positive``)."""
    for name, value in times.items():
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0 or (positive and value == 0)):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"{owner}({name}={value!r}): a time is a finite number of seconds {bound}")


def wait_setting() -> str:
    """``DISTLAB_RPC_WAIT``: ``auto`` (the default: the core twin calls libmpi when it can) or ``mpi4py``."""
    return choice("DISTLAB_RPC_WAIT", "auto", ("auto", "mpi4py"))


def libmpi() -> tuple:
    """``(address of MPI_Improbe, None)`` in the MPI library mpi4py uses, or ``(None, why not)``."""
    global _found
    if wait_setting() == "mpi4py":
        return None, "DISTLAB_RPC_WAIT=mpi4py"
    if _found is None:
        _found = _find_libmpi()
    return _found


def _find_libmpi() -> tuple:
    import ctypes

    from mpi4py import MPI

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if os.path.basename(line.split()[-1]).startswith(("libmpi.so", "libmpi_abi.so"))})
    except OSError as exc:
        return None, f"cannot read /proc/self/maps ({exc})"
    expected = MPI.Get_library_version().rstrip("\x00").strip()
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, os.RTLD_NOLOAD | os.RTLD_LAZY)
            improbe, version = lib.MPI_Improbe, lib.MPI_Get_library_version
        except (OSError, AttributeError):
            continue
        text = ctypes.create_string_buffer(16384)
        length = ctypes.c_int(0)
        if version(text, ctypes.byref(length)) != 0:
            continue
        if text.value.decode(errors="replace").rstrip("\x00").strip() == expected:
            found.append((path, ctypes.cast(improbe, ctypes.c_void_p).value))
    if len(found) != 1:
        return None, (f"{len(found)} mapped MPI libraries report mpi4py's version {expected.splitlines()[0]!r} "
                      f"(mapped: {paths or 'none'})")
    return found[0][1], None


def comm_handle(comm) -> tuple:
    """``(handle, is_pointer)``: the communicator's C handle as ``MPI_Improbe`` takes it (an int, or a pointer)."""
    from mpi4py import MPI

    size = MPI._sizeof(MPI.Comm)
    if size not in (4, 8):
        raise ValueError(f"an MPI_Comm of {size} bytes (neither an int nor a pointer handle)")
    handle = comm.handle & ((1 << (8 * size)) - 1)
    return handle, size == 8


def self_test_failed(what) -> str:
    """The reason the core twin gives when its own ``MPI_Improbe`` call did not find what mpi4py sent."""
    return f"the libmpi self-test failed ({what})"
