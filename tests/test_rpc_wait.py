"""The RPC wait (twinned ``rpc_wait``): the waiter that polls then sleeps, and the listener's seat, in one process.

Messages come on a duplicate of ``MPI.COMM_SELF`` (this process sends to itself). Both twins must match the same
messages and report them alike; the core twin must say how it waits (libmpi, or mpi4py and why), never guess.
"""
from __future__ import annotations

import threading
import time

import pytest

from distlab import _backend
from distlab._common import rpc_wait as shared

MPI = pytest.importorskip("mpi4py.MPI")


def _trace(mod) -> list:
    """What a waiter makes of a few messages this process sends itself: matched or not, source, tag, bytes."""
    comm = MPI.COMM_SELF.Dup()
    waiter = mod.Waiter(comm, 1e-4, 1e-3)
    out = []
    try:
        requests = [comm.Isend([bytes(range(n)), MPI.BYTE], 0, tag) for n, tag in ((3, 7), (5, 8), (1, 7))]
        for source, tag in ((0, 8), (MPI.ANY_SOURCE, 7), (0, 7), (0, 7), (0, 9)):
            found = waiter.probe(source, tag, 0.2)
            got = (found,)
            if found:
                status = waiter.status
                data = bytearray(status.Get_count(MPI.BYTE))
                waiter.message.Recv([data, MPI.BYTE])
                got += (status.Get_source(), status.Get_tag(), bytes(data))
            out.append(got)
        MPI.Request.Waitall(requests)
    finally:
        comm.Free()
    return out


def test_a_waiter_matches_messages_in_order_and_times_out_when_none_comes(rpc_wait):
    assert _trace(rpc_wait) == [(True, 0, 8, bytes(range(5))), (True, 0, 7, bytes(range(3))),
                                (True, 0, 7, bytes(range(1))), (False,), (False,)]


def test_the_twins_wait_alike():
    if not _backend.core_available():
        pytest.skip(_backend.BUILD_HINT)
    twins = _backend.load_twins("rpc_wait")
    assert _trace(twins["core"]) == _trace(twins["reference"])


def test_wake_ends_a_wait_at_once(rpc_wait):
    comm = MPI.COMM_SELF.Dup()
    waiter = rpc_wait.Waiter(comm, 0.0, 1e-3)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(waiter.probe(0, 5, 60.0)))
    thread.start()
    time.sleep(0.05)
    waiter.wake()
    thread.join(30)   # without the wake, the probe would wait its 60 s
    assert not thread.is_alive() and outcome == [False]
    comm.Free()


def test_a_touch_wakes_a_sleeping_waiter_for_the_message_that_follows(rpc_wait):
    comm = MPI.COMM_SELF.Dup()
    waiter = rpc_wait.Waiter(comm, 0.0, 30.0)   # no polling phase, and sleeps that would grow to 30 s
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(waiter.probe(0, 5, 60.0)))
    thread.start()
    time.sleep(2.6)   # by now it sleeps, each twice the last: the one under way began at about 2.1 s, ends at 4.2
    assert waiter.idle
    request = comm.Isend([b"x", MPI.BYTE], 0, 5)
    waiter.touch()
    thread.join(0.9)  # woken by the touch, not by the end of its sleep
    assert not thread.is_alive() and outcome == [True]
    waiter.message.Recv([bytearray(1), MPI.BYTE])
    request.Wait()
    comm.Free()


def test_idle_only_while_sleeping_between_polls(rpc_wait):
    comm = MPI.COMM_SELF.Dup()
    waiter = rpc_wait.Waiter(comm, 0.0, 1e-3)
    assert not waiter.idle               # made, not yet waiting
    assert waiter.probe(0, 5, 0.05) is False
    assert not waiter.idle               # the wait is over: a sleep that ended leaves no trace
    comm.Free()


class _CountingComm:
    """A communicator on which no message ever comes: it notes when each poll happened."""

    def __init__(self):
        self.polls = []

    def Improbe(self, source, tag, status):
        self.polls.append(time.monotonic())


def test_a_waiter_idle_for_good_sleeps_longer(rpc_wait, monkeypatch):
    monkeypatch.setenv("DISTLAB_RPC_WAIT", "mpi4py")   # the core twin polls through the (counting) comm too
    comm = _CountingComm()
    waiter = rpc_wait.Waiter(comm, 0.0, 1e-3)
    start = time.monotonic()
    assert waiter.probe(0, 5, shared.IDLE_AFTER + 1.0) is False
    late = [t for t in comm.polls if t - start > shared.IDLE_AFTER + 0.1]
    # sleeps of up to 1 ms would poll some 900 times in that last 0.9 s; sleeps of up to IDLE_SLEEP_MAX, 180
    assert 0 < len(late) <= 1.5 * 0.9 / shared.IDLE_SLEEP_MAX


def test_a_wake_ends_one_wait_only(rpc_wait):
    comm = MPI.COMM_SELF.Dup()
    waiter = rpc_wait.Waiter(comm, 0.0, 1e-3)
    waiter.wake()
    assert waiter.probe(0, 5, 30.0) is False   # the wake ends the next wait at once
    requests = []
    sender = threading.Timer(0.1, lambda: requests.append(comm.Isend([b"x", MPI.BYTE], 0, 5)))
    sender.start()
    assert waiter.probe(0, 5, 30.0) is True    # and only that one: this wait lasts until the message comes
    waiter.message.Recv([bytearray(1), MPI.BYTE])
    sender.join()
    requests[0].Wait()
    comm.Free()


def test_the_core_twin_says_how_it_waits(monkeypatch):
    if not _backend.core_available():
        pytest.skip(_backend.BUILD_HINT)
    core = _backend.load("rpc_wait", "core")
    reference = _backend.load("rpc_wait", "reference")
    assert reference.Waiter(MPI.COMM_SELF, 0.0, 1e-3).path == "mpi4py"
    assert core.Waiter(MPI.COMM_SELF, 0.0, 1e-3).path == "libmpi"   # the mpich wheel's library, found and checked
    monkeypatch.setenv("DISTLAB_RPC_WAIT", "mpi4py")
    assert core.Waiter(MPI.COMM_SELF, 0.0, 1e-3).path == "mpi4py (DISTLAB_RPC_WAIT=mpi4py)"
    monkeypatch.delenv("DISTLAB_RPC_WAIT")
    monkeypatch.setattr(shared, "_found", (None, "no libmpi mapped"))   # as where the library cannot be found
    waiter = core.Waiter(MPI.COMM_SELF, 0.0, 1e-3)
    assert waiter.path == "mpi4py (no libmpi mapped)"
    assert _trace(core) == _trace(reference)   # and it still waits right, through mpi4py
    monkeypatch.setenv("DISTLAB_RPC_WAIT", "sometimes")
    with pytest.raises(ValueError, match="DISTLAB_RPC_WAIT='sometimes' is not one of auto, mpi4py"):
        core.Waiter(MPI.COMM_SELF, 0.0, 1e-3)


def test_the_library_is_the_one_mpi4py_loaded():
    address, reason = shared._find_libmpi()
    assert address and reason is None
    handle, is_pointer = shared.comm_handle(MPI.COMM_WORLD)
    assert is_pointer == (MPI._sizeof(MPI.Comm) == 8) and handle == MPI.COMM_WORLD.handle & (
        (1 << (8 * MPI._sizeof(MPI.Comm))) - 1)


# -- the seat -----------------------------------------------------------------------------------------------------
def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out[0]


def test_the_seat_is_held_by_one_thread(rpc_wait):
    seat = rpc_wait.Seat(0.01, 0.001)
    assert seat.holder is None and not seat.listening()
    assert seat.take() and seat.listening() and seat.holder == threading.get_ident()
    assert not _in_thread(seat.take) and not _in_thread(seat.listening)   # held by this thread
    seat.leave()                                    # away running a handler: not listening, still the holder
    assert not seat.listening() and seat.away_since is not None
    assert seat.come_back() and seat.listening() and seat.away_since is None
    assert not _in_thread(seat.come_back)          # only the holder comes back
    seat.release()
    assert seat.holder is None and _in_thread(seat.take)


def test_a_standby_takes_the_seat_of_a_holder_away_too_long(rpc_wait):
    seat = rpc_wait.Seat(0.05, 0.005)
    assert seat.take()
    assert not _in_thread(lambda: seat.watch(0.2))   # the holder listens: nothing to take
    seat.leave()
    seat.come_back()
    assert not _in_thread(lambda: seat.watch(0.2))   # away only briefly: nothing to take either
    seat.leave()
    standby = []
    assert _in_thread(lambda: (seat.watch(10.0), standby.append(seat.holder))[0])
    assert standby == [seat.holder] and seat.holder != threading.get_ident()
    assert not seat.come_back() and not seat.listening()   # back too late: the standby listens now


def test_a_standby_watching_a_listening_holder_sees_it_leave(rpc_wait):
    seat = rpc_wait.Seat(0.05, 0.005)
    assert seat.take()
    out = []
    thread = threading.Thread(target=lambda: out.append(seat.watch(30.0)))
    thread.start()        # the holder listens: the standby waits for it to leave
    time.sleep(0.1)
    seat.leave()          # and stays away: the standby takes the seat after the takeover, not after its 30 s
    thread.join(10)
    assert not thread.is_alive() and out == [True] and not seat.come_back()


def test_stop_ends_a_watch(rpc_wait):
    seat = rpc_wait.Seat(0.05, 0.005)
    out = []
    thread = threading.Thread(target=lambda: out.append(seat.watch(60.0)))
    thread.start()
    time.sleep(0.05)
    seat.stop()
    thread.join(30)
    assert not thread.is_alive() and out == [False]
