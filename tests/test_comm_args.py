"""The comm layer's argument checks, in this process (a world of one rank): refused before a collective takes its
sequence number, with errors naming the call, the tensor and the dtype; timeouts; reserved tags; the poll loop.
"""
import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distlab import comm
from distlab.comm.work import spin
from distlab.errors import DistTimeoutError, ProcessGroupBrokenError

OPS = ["sum", "avg", "min", "max", "product", "band", "bor"]
BAD_DTYPES = [np.dtype(object), np.dtype("U3"), np.dtype("S2"), np.dtype([("a", "i4"), ("b", "f8")]),
              np.dtype("datetime64[s]"), np.dtype("timedelta64[ms]")]


@pytest.fixture(scope="module")
def pg():
    return comm.ProcessGroup(name="args", timeout=30)


def _zeros(dtype, count=4):
    return np.zeros(count, dtype=dtype)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_unmovable_dtypes_are_refused_before_the_collective(pg, dtype):
    calls = {
        "allreduce": lambda a: pg.allreduce(a, name="w"),
        "broadcast": lambda a: pg.broadcast(a, name="w"),
        "allgather": lambda a: pg.allgather(a, name="w"),
        "alltoall": lambda a: pg.alltoall(a.copy(), a, name="w"),
        "reduce_scatter": lambda a: pg.reduce_scatter(a.copy(), a, name="w"),
        "send": lambda a: pg.send(a, 0, name="w"),
        "recv": lambda a: pg.recv(a, 0, name="w"),
    }
    for what, call in calls.items():
        seq = pg._steps.seq
        with pytest.raises(TypeError) as caught:
            call(_zeros(dtype))
        text = str(caught.value)
        assert text.startswith(f"{what} of 'w': ") and str(dtype) in text, text
        assert pg._steps.seq == seq  # no sequence number taken: the group stays in step with its peers
    pg.barrier()


@pytest.mark.parametrize("dtype, op, words", [
    (np.complex128, "min", "undefined for complex"), (np.complex64, "max", "undefined for complex"),
    (np.int32, "avg", "needs a floating-point array"), (np.float32, "band", "needs an integer or bool"),
    (np.complex64, "bor", "needs an integer or bool"),
])
def test_ops_a_dtype_cannot_take_are_refused(pg, dtype, op, words):
    seq = pg._steps.seq
    with pytest.raises(TypeError, match=words) as caught:
        pg.allreduce(_zeros(dtype), op=op, name="bucket0")
    assert str(caught.value).startswith(f"allreduce of 'bucket0': op '{op}'"), str(caught.value)
    assert str(np.dtype(dtype)) in str(caught.value)
    assert pg._steps.seq == seq


@settings(max_examples=60, deadline=None)
@given(dtype=hnp.scalar_dtypes() | hnp.unicode_string_dtypes() | hnp.nested_dtypes(), op=st.sampled_from(OPS))
def test_allreduce_either_works_or_refuses_cleanly(pg, dtype, op):
    # One rank: the reduction of one contribution is the contribution (avg divides by 1).
    a = _zeros(dtype, 3)
    seq = pg._steps.seq
    try:
        out = pg.allreduce(a, op=op)
    except TypeError as exc:
        assert pg._steps.seq == seq and str(dtype) in str(exc)
    else:
        assert out is a and pg._steps.seq == seq + 1


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0])
def test_bad_timeouts_are_refused(monkeypatch, pg, bad):
    with pytest.raises(ValueError, match=r"ProcessGroup\(timeout\)"):
        comm.ProcessGroup(timeout=bad)
    with pytest.raises(ValueError, match=r"new_group\(timeout\)"):
        pg.new_group([0], timeout=bad)
    work = pg.allreduce(np.ones(2), async_op=True)
    with pytest.raises(ValueError, match=r"Work.wait\(timeout\)"):
        work.wait(timeout=bad)
    work.wait()
    monkeypatch.setenv("DISTLAB_TIMEOUT", str(bad))
    with pytest.raises(ValueError, match="DISTLAB_TIMEOUT"):
        comm.ProcessGroup(name="from-env")


def test_fingerprint_checks_follow_the_variable_unless_the_group_says(pg, monkeypatch):
    monkeypatch.setenv("DISTLAB_DEBUG", "DETAIL")
    with comm.ProcessGroup(name="checked") as checked, \
            comm.ProcessGroup(name="unchecked", fingerprint_checks=False) as unchecked:
        assert checked._steps.detail and not unchecked._steps.detail
        assert unchecked.allreduce(np.ones(2)) is not None
    monkeypatch.setenv("DISTLAB_DEBUG", "OFF")
    with comm.ProcessGroup(name="asked", fingerprint_checks=True) as asked:
        assert asked._steps.detail
    with pytest.raises(TypeError, match="fingerprint_checks"):
        comm.ProcessGroup(name="bad", fingerprint_checks="yes")


def test_node_keys_are_public_and_read_only(pg):
    keys = pg.node_keys
    assert keys.dtype == np.int64 and len(keys) == pg.size and keys[pg.rank] <= pg.rank
    with pytest.raises(ValueError):
        keys[0] = 99


def test_infinite_timeout_is_no_deadline(pg):
    with comm.ProcessGroup(timeout=math.inf, name="patient") as patient:
        assert patient.timeout == math.inf
        assert patient.allreduce(np.ones(2), async_op=True).wait() is True


@pytest.mark.parametrize("tag", [-1, 32760, 32767, 2.0, True])
def test_reserved_and_invalid_tags_are_refused(pg, tag):
    for call in (lambda: pg.send(np.ones(1), 0, tag=tag), lambda: pg.recv(np.ones(1), 0, tag=tag)):
        with pytest.raises(ValueError, match="reserved by distlab"):
            call()


def test_spin_checks_the_deadline_on_every_poll():
    # Each poll takes 50 ms (a Test slowed by a contended MPI lock, a yield on a loaded machine). A deadline
    # checked every 16th poll overshot 0.2 s by 0.6 s; checked on every poll, at most one poll runs past it.
    polls_after_deadline = []
    deadline = [0.0]

    def slow_test():
        import time

        time.sleep(0.05)
        if time.monotonic() > deadline[0]:
            polls_after_deadline.append(1)
        return False

    # the side channel knows nothing: the report (distlab.comm.missing.timeout_error) names no rank
    side = types.SimpleNamespace(remote=[], waiting_seq=0, describe=lambda seq, lead: ([], "no news"),
                                 gave_up=lambda seq: None, rank=0, size=1)
    group = types.SimpleNamespace(side=side, oversubscribed=False, name="fake", mark_broken=lambda reason: None,
                                  interrupt=None)
    import time

    deadline[0] = time.monotonic() + 0.2
    with pytest.raises(DistTimeoutError):
        spin(group, slow_test, deadline[0], 0.2, "allreduce", 1, None, 0, None)
    assert len(polls_after_deadline) <= 1, len(polls_after_deadline)


def test_a_groups_interrupt_ends_a_wait_with_its_error_and_breaks_the_group():
    """What the collectives engine relies on to hear a peer's failure: a wait past its spin phase calls the
    group's ``interrupt``; what it raises ends the wait, and the group refuses further calls (the operation may
    still be in flight)."""
    group = comm.ProcessGroup(name="interrupted", timeout=30)
    calls = []

    class PeerGone(Exception):
        pass

    def interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise PeerGone("rank 1 failed")

    group.interrupt = interrupt
    inbox, outbox = np.zeros(1), np.ones(1)          # MPI may still write into inbox: keep it alive
    with pytest.raises(PeerGone, match="rank 1 failed"):
        group.recv(inbox, 0, tag=5, name="never sent")             # nobody sends: only the interrupt ends it
    assert len(calls) == 3
    with pytest.raises(ProcessGroupBrokenError, match="recv of 'never sent' was interrupted"):
        group.barrier()
    group.comm.Send(outbox, dest=0, tag=5)          # complete the abandoned receive before the group is freed
    assert inbox[0] == 1


def test_non_native_byte_order_is_refused(pg):
    with pytest.raises(TypeError, match="non-native byte order"):
        pg.allreduce(np.zeros(2, dtype=">f8"), name="swapped")
    with pytest.raises(TypeError, match="non-native byte order"):
        pg.broadcast(np.zeros(2, dtype=">i4"))


def test_setup_helpers_refuse_a_null_communicator_and_bad_timeouts():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="COMM_NULL"):
        comm.bounded_barrier(MPI.COMM_NULL, "init_rpc")
    with pytest.raises(ValueError, match="init_rpc: timeout"):
        comm.bounded_dup(MPI.COMM_WORLD, "init_rpc", float("nan"))
    dup = comm.bounded_dup(MPI.COMM_WORLD, "init_rpc", 5)
    assert dup.Get_size() == 1 and comm.bounded_barrier(dup, "x", 5, check=7) == [7]
    dup.Free()


def test_fake_nodes_setting_is_checked(monkeypatch, pg):
    # Read where a group asks MPI for its node layout: over a communicator of its own (groups over COMM_WORLD
    # reuse the layout found by the first one).
    monkeypatch.setenv("DISTLAB_RANKS_PER_NODE", "two")
    with pytest.raises(ValueError, match="DISTLAB_RANKS_PER_NODE='two'"):
        comm.ProcessGroup(pg.comm, name="fake", timeout=5)


def test_a_group_without_a_shared_board_file_still_works(monkeypatch):
    # No /dev/shm file (full, or another mount namespace): the rank keeps a private slot; peers would be asked.
    from distlab.comm import board

    monkeypatch.setattr(board, "_create", lambda nbytes, kind, reserve: None)
    with comm.ProcessGroup(name="private", timeout=5) as group:
        group.allreduce(np.ones(2))
        assert list(group._steps.side.board.readable) == [0] and group._steps.side.board.my_slot[0] == 1


def test_oversubscription_counts_the_ranks_of_a_machine_against_the_cores_they_share():
    import os

    from distlab.comm.board import core_mask, machine_id, machine_oversubscribed

    def mask(*cores):
        return core_mask(cores)

    one, other = 11, 22
    # Four ranks on two virtual hosts of one machine with two cores: oversubscribed, on every rank.
    machines, masks = np.array([one] * 4), np.stack([mask(0, 1)] * 4)
    assert all(machine_oversubscribed(machines, masks, rank) for rank in range(4))
    # Two ranks pinned to a core each: not oversubscribed, though each sees one core.
    assert not machine_oversubscribed(np.array([one, one]), np.stack([mask(0), mask(1)]), 0)
    # Two ranks pinned to the same core are; core 4095 counts.
    assert machine_oversubscribed(np.array([one, one]), np.stack([mask(4095), mask(4095)]), 1)
    # Two machines of two cores, two ranks each: neither is.
    machines = np.array([one, one, other, other])
    assert not any(machine_oversubscribed(machines, np.stack([mask(0, 1)] * 4), rank) for rank in range(4))
    # This process: its mask holds exactly its cores, and its machine id is stable.
    assert np.unpackbits(core_mask().view(np.uint8), bitorder="little").nonzero()[0].tolist() == sorted(
        os.sched_getaffinity(0))
    assert machine_id() == machine_id() > 0


def test_allreduce_pieces_setting_and_size(monkeypatch):
    from distlab.comm.pieces import PIECE_BYTES, PIECES_VAR, choose_piece

    # sqrt(bytes * overhead * bandwidth in pieces), a power of two within the bounds
    streamed = 1 / 192e6  # 2.5 Gbit/s on the virtual cluster
    assert choose_piece(26 * 10**6, 4.3e-4, streamed) == 1 << 20
    assert choose_piece(26 * 10**6, 1e-6, streamed) == PIECE_BYTES[0]
    assert choose_piece(10**9, 1e-2, 1e-10) == PIECE_BYTES[1]
    assert choose_piece(3 << 20, 0.1, streamed) == 0  # less than two pieces
    with comm.ProcessGroup(name="one node") as group:  # one rank, one node: whole, no probe
        assert group._pieces.bytes_for(group, 64 << 20) == 0 and group._pieces.link is False
    monkeypatch.setenv(PIECES_VAR, "0.5")
    with comm.ProcessGroup(name="fixed") as group:
        assert group._pieces.bytes_for(group, 4 << 20) == 1 << 19 and group._pieces.bytes_for(group, 1 << 19) == 0  # < 2 pieces: whole
        a = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: 6 pieces, reduced alone (one rank), unchanged
        group.allreduce(a)
        assert np.array_equal(a, np.arange(3 << 18, dtype=np.float32))
    monkeypatch.setenv(PIECES_VAR, "lots")
    with comm.ProcessGroup(name="bad") as group:
        with pytest.raises(ValueError, match="DISTLAB_ALLREDUCE_PIECES='lots'"):
            group.allreduce(np.zeros(1 << 20, dtype=np.float32))
        assert group._pieces.link is None  # refused again next time
