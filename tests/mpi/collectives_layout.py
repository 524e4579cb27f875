"""hvd.local_rank/local_size/cross_rank/cross_size on N ranks, against the node layout computed by hand.

Nodes are DISTLAB_RANKS_PER_NODE consecutive ranks (the comm layer's simulation), or one node when unset (one
machine). The last node may be smaller (3 ranks, 2 per node: nodes {0, 1} and {2}).
"""
import os

from distlab import collectives as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
per_node = int(os.environ.get("DISTLAB_RANKS_PER_NODE") or size)
node = [r // per_node for r in range(size)]
local = [r % per_node for r in range(size)]
expected = (local[rank], node.count(node[rank]), node[rank], local.count(local[rank]))
got = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
assert got == expected, f"rank {rank}: (local_rank, local_size, cross_rank, cross_size) = {got}, expected {expected}"
hvd.shutdown()
print(f"layout OK {got}", flush=True)
