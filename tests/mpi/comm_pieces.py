"""Large allreduces across (simulated) nodes go in pieces all in flight, with the same bits as whole ones.

Run with DISTLAB_RANKS_PER_NODE set so the ranks form several nodes: the first large allreduce of a group probes
the link and every rank picks the same piece; a group on one node, or with DISTLAB_ALLREDUCE_PIECES=off, stays
whole.
"""
import os

import ml_dtypes
import numpy as np

from distlab import comm
from distlab.comm.pieces import PIECES_VAR, SPLIT_FROM_BYTES

pg = comm.world()
r, n = pg.rank, pg.size
per_node = int(os.environ["DISTLAB_RANKS_PER_NODE"])
rng = np.random.default_rng(7 + r)
count = 5 * (1 << 20) // 4 + 13  # 5 MiB and a ragged tail
arrays = {
    ("sum", "f32"): rng.standard_normal(count).astype(np.float32),
    ("avg", "f64"): rng.standard_normal(count // 2),
    ("max", "i32"): rng.integers(-1000, 1000, count, dtype=np.int32),
    ("sum", "bf16"): rng.standard_normal(count).astype(ml_dtypes.bfloat16),
}


def reduced(group, *, async_op=False):
    out = {}
    for (op, kind), array in arrays.items():
        a = array.copy().reshape(-1, 1) if kind == "f64" else array.copy()  # any shape: pieces cut the flat bytes
        work = group.allreduce(a, op=op, async_op=async_op, name=kind)
        if async_op:
            work.wait()
        out[kind] = a.reshape(-1)
    return out


os.environ[PIECES_VAR] = "off"
whole_group = comm.ProcessGroup(name="whole")
whole = reduced(whole_group)
assert whole_group._pieces.link is False
os.environ[PIECES_VAR] = "auto"
split_group = comm.ProcessGroup(name="split")
split = reduced(split_group)
link = split_group._pieces.link  # probed: (seconds per piece, per byte in pieces), the same on every rank
assert len(link) == 2 and min(link) > 0, link
piece = split_group._pieces.bytes_for(split_group, 26 * 10**6)
assert piece and piece & (piece - 1) == 0, piece
assert pg.allgather_object((link, piece)) == [(link, piece)] * n
os.environ[PIECES_VAR] = "0.25"  # a fixed piece: 20 pieces and a tail, started asynchronously
fixed_group = comm.ProcessGroup(name="fixed")
fixed = reduced(fixed_group, async_op=True)
assert fixed_group._pieces.link == 1 << 18
for kind in whole:
    for other in (split, fixed):
        assert whole[kind].tobytes() == other[kind].tobytes(), kind
# the sum is right, not only equal: every rank's input, reduced here in the same order as MPI's
total = sum(np.random.default_rng(7 + k).standard_normal(count).astype(np.float32) for k in range(n))
assert np.allclose(whole["f32"], total, atol=1e-4)

# a group on one node (its ranks share the simulated node) stays whole, probing nothing
os.environ[PIECES_VAR] = "auto"
for node in range(n // per_node if per_node > 1 else 0):
    group = pg.new_group(list(range(node * per_node, (node + 1) * per_node)))
    if group is not None:
        big = np.ones(SPLIT_FROM_BYTES // 4, dtype=np.float32)
        group.allreduce(big)
        assert group._pieces.link is False and big[0] == per_node
print(f"rank {r}: allreduce pieces OK (26 MB: {f'{piece >> 10} KiB pieces' if piece else 'whole'})", flush=True)
