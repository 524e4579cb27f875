"""Late ranks and the rest of c10d: every new call times out naming them; monitored_barrier's rank 0 names the
first late rank (all of them with wait_all_ranks), every rank that arrived raises rank 0's verdict, a late rank
finds it waiting when it arrives, and ranks whose rank 0 never came name rank 0 (4 ranks: on 2, rank 1 is late).

Ranks ``late`` (the last one on 2 ranks, the last two on 4) sleep through everything else. A reduce and a receive
on device arrays (the strict stand-in) time out the same way.
"""
import time

import numpy as np

from distlab import comm
from distlab.errors import DistTimeoutError
from scenario_checks import host, on, staged_outside_comm, start_counting

pg = comm.world()
r, n = pg.rank, pg.size
late = [n - 1] if n == 2 else [n - 2, n - 1]
first, all_ranks = pg.new_group(list(range(n)), name="first"), pg.new_group(list(range(n)), name="all")
no_lead = pg.new_group(list(range(n)), name="no_lead")
calls = {
    "reduce": lambda g: g.reduce(np.ones(4), dst=0, async_op=True),
    "gather": lambda g: g.gather(np.ones(2), [np.ones(2)] * n if g.rank == 0 else None, async_op=True),
    # a late source: the others wait for their part (a source on time could send it without the late ones)
    "scatter": lambda g: g.scatter(np.ones(2), src=late[0], async_op=True),
    "gather_object": lambda g: g.gather_object(r, [None] * n if g.rank == 0 else None, async_op=True),
    "scatter_object_list": lambda g: g.scatter_object_list([None], src=late[0], async_op=True),
    "all_to_all_single": lambda g: g.all_to_all_single(np.zeros(n), np.zeros(n), async_op=True),
}
groups = {op: pg.new_group(list(range(n)), name=op) for op in calls}
p2p = {kind: pg.new_group(list(range(n)), name=kind) for kind in ("recv_object_list", "irecv", "reduce", "recv")}
on_time = pg.new_group([k for k in range(n) if k not in late], name="on_time")  # None on the late ranks
pg.barrier()
MONITOR = 0.8


def ranks(which):
    return f"Rank {which[0]}" if len(which) == 1 else f"Ranks {', '.join(map(str, which))}"


def expect_timeout(call, *words, missing):
    try:
        call()
    except DistTimeoutError as exc:
        for word in words:
            assert word in str(exc), (word, str(exc))
        assert exc.missing_ranks == missing, (exc.missing_ranks, missing, str(exc))
        return exc
    raise AssertionError(f"must time out: {words}")


if r in late:
    time.sleep(3 * MONITOR + 0.5 * len(calls) + 3.3)
    # The verdicts wait for the late ranks: they raise at once, naming what rank 0 reported.
    start = time.monotonic()
    expect_timeout(lambda: first.monitored_barrier(timeout=MONITOR), "rank 0 reports: Rank", missing=late[:1])
    expect_timeout(lambda: all_ranks.monitored_barrier(timeout=MONITOR, wait_all_ranks=True),
                   f"rank 0 reports: {ranks(late)} failed to pass it", missing=late)
    assert time.monotonic() - start < MONITOR, "the verdict was waiting"
else:
    start = time.monotonic()
    if r == 0:
        exc = expect_timeout(lambda: first.monitored_barrier(timeout=MONITOR),
                             f"[Rank 0]: Rank {late[0]} failed to pass monitored_barrier #1 of group 'first'",
                             f"in {MONITOR * 1000:g} ms", f"rank {late[0]} has entered no collective",
                             missing=late[:1])
        expect_timeout(lambda: all_ranks.monitored_barrier(timeout=MONITOR, wait_all_ranks=True),
                       f"[Rank 0]: {ranks(late)} failed to pass monitored_barrier #1",
                       missing=late)
    else:
        expect_timeout(lambda: first.monitored_barrier(timeout=MONITOR),
                       f"rank {r} reached monitored_barrier #1", f"rank 0 reports: Rank {late[0]} failed",
                       missing=late[:1])
        expect_timeout(lambda: all_ranks.monitored_barrier(timeout=MONITOR, wait_all_ranks=True),
                       f"rank 0 reports: {ranks(late)} failed", missing=late)
    elapsed = time.monotonic() - start
    assert 2 * MONITOR - 0.1 < elapsed < 2 * MONITOR + 4, elapsed
    for op, call in calls.items():
        on_time.barrier()  # every rank on time enters it together
        if r == 0 or op in ("scatter", "scatter_object_list", "all_to_all_single"):
            expect_timeout(lambda: call(groups[op]).wait(timeout=0.5), f"{op} #1 ", "have not entered it",
                           missing=late)
        else:  # a rank off the root of a reduce or gather may finish its part without the late ones (MPI sends small messages eagerly)
            try:
                call(groups[op]).wait(timeout=0.5)
            except DistTimeoutError as exc:
                assert set(late) <= set(exc.missing_ranks), str(exc)
    # point to point from a late rank: the peer is named
    expect_timeout(lambda: p2p["recv_object_list"].recv_object_list([None], src=late[0], async_op=True).wait(
        timeout=0.3), "recv_object_list", f"its peer, rank {late[0]}, never posted", missing=late[:1])
    batch = comm.batch_isend_irecv([comm.P2POp(comm.irecv, np.zeros(2), late[0], group=p2p["irecv"])])
    expect_timeout(lambda: batch[0].wait(timeout=0.3), "recv", f"its peer, rank {late[0]}", missing=late[:1])
    # device arrays (the strict stand-in), staged through the host: a reduce to rank 0 and a receive into one
    start_counting("cuda")
    on_time.barrier()
    reduce = p2p["reduce"].reduce(on("cuda", np.ones(4)), dst=0, async_op=True)
    if r == 0:
        expect_timeout(lambda: reduce.wait(timeout=0.5), "reduce #1 ", "have not entered it", missing=late)
    else:  # off the root it may finish without the late ranks, as above
        try:
            reduce.wait(timeout=0.5)
        except DistTimeoutError as exc:
            assert set(late) <= set(exc.missing_ranks), str(exc)
    into = on("cuda", np.zeros(2))
    expect_timeout(lambda: p2p["recv"].irecv(into, src=late[0]).wait(timeout=0.3), "recv",
                   f"its peer, rank {late[0]}", missing=late[:1])
    assert host(into).tolist() == [0.0, 0.0] and not staged_outside_comm("cuda")
    if r == 0 and n > len(late) + 1:  # some rank other than 0 is on time (4 ranks)
        time.sleep(MONITOR + 1.0)  # the others give up on it first
        # their arrivals wait for it; the late ranks' do not
        expect_timeout(lambda: no_lead.monitored_barrier(timeout=MONITOR), f"[Rank 0]: Rank {late[0]} failed",
                       missing=late[:1])
    elif r != 0:
        expect_timeout(lambda: no_lead.monitored_barrier(timeout=MONITOR),
                       "rank 0, which monitors it, has not entered it", "rank 0 has entered no collective", missing=[0])
print(f"rank {r}: c10d timeouts OK", flush=True)
