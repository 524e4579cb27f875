"""DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``), shared by both twins.

A hook is ``hook(state, bucket: GradBucket) -> Future`` whose value is the reduced flat buffer. Register one with
``ddp.register_comm_hook(state, hook)``; ``state`` is the process group (or None for the DDP module's group).
With a hook registered the reducer no longer divides gradients by the world size: the hook does (so a hook can
choose to sum, average or compress).
"""
from __future__ import annotations

import numpy as np

from ._common.reducer_buckets import sparse_allreduce
from .futures import Future

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "sparse_allreduce", "noop_hook"]


def _group(state, bucket):
    if state is not None:
        return state
    group = getattr(bucket, "process_group", None)
    if group is None:
        from . import comm

        group = comm.world()
    return group


def allreduce_hook(process_group, bucket) -> Future:
    """Average the bucket across ranks: divide by the world size, then allreduce (the default behaviour)."""
    group = _group(process_group, bucket)
    buffer = bucket.buffer()
    buffer /= group.size
    return group.allreduce(buffer, async_op=True, name=f"bucket{bucket.index()}").get_future()


def _compress_hook(process_group, bucket, dtype) -> Future:
    group = _group(process_group, bucket)
    buffer = bucket.buffer()
    compressed = (buffer / group.size).astype(dtype)  # divide before narrowing: keeps sums in range
    future = group.allreduce(compressed, async_op=True, name=f"bucket{bucket.index()} ({np.dtype(dtype).name})")

    def decompress(fut: Future):
        buffer[...] = fut.value()
        return buffer

    return future.get_future().then(decompress)


def fp16_compress_hook(process_group, bucket) -> Future:
    """Halve the bytes on the wire: reduce the bucket in float16, then cast back into the bucket."""
    return _compress_hook(process_group, bucket, np.float16)


def bf16_compress_hook(process_group, bucket) -> Future:
    """Reduce the bucket in bfloat16 (ml_dtypes), which keeps float32's range at half the bytes."""
    import ml_dtypes

    return _compress_hook(process_group, bucket, ml_dtypes.bfloat16)


def noop_hook(_state, bucket) -> Future:
    """No communication: return the bucket as it is (for measuring the reducer's own bookkeeping)."""
    future = Future(description="noop hook")
    future.set_result(bucket.buffer())
    return future
