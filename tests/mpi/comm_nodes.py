"""The missing-rank side channel between nodes: ranks on other nodes can only be learnt through notes.

On one host DISTLAB_RANKS_PER_NODE splits the ranks into fake nodes, each with its own arrival board; on a
virtual cluster (hosts in blocks of ranks) the argument says how many ranks each host runs.

4 ranks. With 2 ranks per node ({0, 1} and {2, 3}):
  A. rank 3 is late: 0 and 1 learn it from rank 2, which waits and reads rank 3's slot on its own board;
  B. ranks 2 and 3 are late: nobody on their node can answer, so they are named as not answering;
  C. rank 2 gives up early (shorter timeout), rank 3 is late: 0 and 1 hear both.
With 1 rank per node, case A leaves rank 3 without anyone to answer for it.
"""
import os
import sys
import time

import numpy as np

from distlab import comm
from distlab.errors import DistTimeoutError

per_node = int(os.environ.get("DISTLAB_RANKS_PER_NODE") or sys.argv[1])
world = comm.world()
r, n = world.rank, world.size
assert n == 4
LIMIT = 2.0
cases = {k: comm.ProcessGroup(name=f"case{k}", timeout=LIMIT) for k in "ABC"}
meet = {k: comm.ProcessGroup(name=f"meet{k}") for k in "ABC"}
for group in cases.values():
    assert sorted(group._steps.side.remote) == sorted(set(range(n)) - {q for q in range(n) if q // per_node == r // per_node})
    group.barrier()  # seq 1: every rank's last entry is "#1 barrier"


def wait_out(key, late, timeout=None):
    """Ranks not in ``late`` enter an allreduce (#2) that the late ones skip; returns the error's text."""
    group = cases[key]
    if r in late:
        time.sleep(LIMIT + 1.5)  # computing, outside MPI
        return None
    start = time.monotonic()
    try:
        group.allreduce(np.ones(4), name=f"grad{key}", async_op=True).wait(timeout)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert time.monotonic() - start < (timeout or LIMIT) + 2.0
        assert exc.seq == 2 and exc.op == "allreduce"
        return exc


exc = wait_out("A", late=[3])
if exc is not None:
    text = str(exc)
    if per_node == 1:
        assert exc.missing_ranks == [3] and "ranks [3] on other nodes did not answer" in text, text
    elif r == 2:  # rank 3 is on rank 2's own board
        assert exc.missing_ranks == [3] and "rank 3 last entered #1 barrier)" in text, text
    else:
        assert exc.missing_ranks == [3], text
        assert "rank 3 last entered #1 barrier, as rank 2 on its node reports" in text, text
meet["A"].barrier()

if per_node == 2:
    exc = wait_out("B", late=[2, 3])
    if exc is not None:
        assert exc.missing_ranks == [2, 3], str(exc)
        assert "ranks [2, 3] on other nodes did not answer" in str(exc), str(exc)
    meet["B"].barrier()

    # C: rank 2 gives up after 0.5 s and moves on (into a barrier, where its poll loop still answers notes).
    exc = wait_out("C", late=[3], timeout=0.5 if r == 2 else None)
    if exc is not None and r in (0, 1):
        text = str(exc)
        assert exc.missing_ranks == [3], text
        assert "rank 3 last entered #1 barrier, as rank 2 on its node reports" in text, text
        assert "ranks [2] timed out in it before this rank and gave up" in text, text
    meet["C"].barrier()
print(f"rank {r}: side channel across nodes OK ({per_node} per node)", flush=True)
