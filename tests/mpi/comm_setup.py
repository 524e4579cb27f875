"""Set-up that a rank never reaches times out naming it: world(), ProcessGroup(), new_group(), bounded_barrier,
collectives.init().

``world`` (argument): the last rank never creates the world group; the others' ``comm.world()``, then their
``collectives.init()``, fail within DISTLAB_TIMEOUT. ``groups``: each phase runs over a group made while every rank
was present; the last rank skips the phase's call, then every rank meets on a fresh group (a timed-out setup leaves
its communicator unusable).
"""
import sys
import time

from mpi4py import MPI

from distlab import collectives as hvd
from distlab import comm
from distlab.errors import DistTimeoutError

mode = sys.argv[1]
r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
late = n - 1
LIMIT = 2.0  # DISTLAB_TIMEOUT for the world phase, the timeout argument elsewhere


def expect_timeout(what, call, words):
    start = time.monotonic()
    try:
        call()
        raise AssertionError(f"{what}: must time out")
    except DistTimeoutError as exc:
        elapsed = time.monotonic() - start
        assert LIMIT * 0.9 < elapsed < LIMIT + 2.5, (what, elapsed)  # not the late rank's whole sleep
        assert exc.missing_ranks == [late], (what, exc.missing_ranks)
        text = str(exc)
        assert f"ranks [{late}] have not entered it" in text and words in text, text
        assert f"timed out after {LIMIT:g} s on rank {r}" in text, text


if mode == "world":
    if r == late:
        time.sleep(2 * LIMIT + 4)  # busy elsewhere (loading data, say) long after the others gave up
    else:
        expect_timeout("world", comm.world, "ProcessGroup 'world' setup")
        # collectives.init() makes its own group the same way: bounded by DISTLAB_TIMEOUT too, and no engine
        expect_timeout("collectives.init", hvd.init, "ProcessGroup 'collectives' setup")
        assert not hvd.is_initialized()
    print(f"rank {r}: setup timeout reported: OK", flush=True)
    sys.exit(0)

pg = comm.world()
phases = [comm.ProcessGroup(name=f"phase{i}") for i in range(3)]
meet = [comm.ProcessGroup(name=f"meet{i}") for i in range(3)]
checks = [
    ("new_group", lambda: phases[0].new_group(list(range(n)), timeout=LIMIT), "new_group([0, 1"),
    ("ProcessGroup", lambda: comm.ProcessGroup(phases[1].comm, timeout=LIMIT, name="sub"), "ProcessGroup 'sub'"),
    ("bounded_barrier", lambda: comm.bounded_barrier(phases[2].comm, "init_rpc", LIMIT), "init_rpc timed out"),
]
for (what, call, words), meeting in zip(checks, meet):
    if r == late:
        time.sleep(LIMIT + 1.5)
    else:
        expect_timeout(what, call, words)
    meeting.barrier()

# Every rank must pass the same ranks to new_group: a difference is an error on every rank, the group usable.
mine = [0, 1] if r != late else [1, 0]
try:
    pg.new_group(mine)
    raise AssertionError("different rank lists must be refused")
except ValueError as exc:
    assert "passed a different list of ranks" in str(exc), exc
with pg.new_group(list(range(n))) as everyone:
    assert everyone.size == n
pg.barrier()
print(f"rank {r}: setup timeout reported: OK", flush=True)
