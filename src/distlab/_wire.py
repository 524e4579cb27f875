"""Wire constants shared by both twins (codes that cross process boundaries must be defined once)."""
from __future__ import annotations

__all__ = ["COLLECTIVE_OPS", "REDUCE_OP_CODES", "FINGERPRINT_WORDS", "FINGERPRINT_MAX_DIMS", "FINGERPRINT_VERSION"]

#: Collective operation names and their codes (index in this tuple). Append only: codes travel between ranks.
COLLECTIVE_OPS = (
    "none", "allreduce", "broadcast", "allgather", "allgather_object", "reduce_scatter",
    "alltoall", "barrier", "send", "recv", "gather_object", "broadcast_object",
)

#: Reduce-op names and their codes; 0 means "not a reduction".
REDUCE_OP_CODES = {"": 0, "sum": 1, "avg": 2, "min": 3, "max": 4, "product": 5, "band": 6, "bor": 7}

#: A collective fingerprint is FINGERPRINT_WORDS int64 words:
#: [version, seq, op code, reduce-op code, root, dtype code, ndim, dim0 .. dim(FINGERPRINT_MAX_DIMS-1)]
#: A shape with more dims than fit folds the rest into the last dim slot (their product).
FINGERPRINT_VERSION = 1
FINGERPRINT_MAX_DIMS = 9
FINGERPRINT_WORDS = 7 + FINGERPRINT_MAX_DIMS
