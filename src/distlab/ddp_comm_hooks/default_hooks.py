"""The default DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``).

A hook is ``hook(state, bucket: GradBucket) -> Future`` whose value is the reduced flat buffer. Register one with
``ddp.register_comm_hook(state, hook)``; ``state`` is the process group (or None for the DDP module's group).
With a hook registered the reducer no longer divides gradients by the world size: the hook does (so a hook can
choose to sum, average or compress).
"""
from __future__ import annotations

import numpy as np

from .._common.reducer_buckets import sparse_allreduce
from ..futures import Future

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "sparse_allreduce", "noop_hook",
           "OptimizerHookState", "hook_then_optimizer"]


def _group(state, bucket):
    if state is not None:
        return state
    group = getattr(bucket, "process_group", None)
    if group is None:
        from .. import comm

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


class OptimizerHookState:
    """What :func:`hook_then_optimizer` needs (torch's ``_OptimizerHookState``): the optimizer, and the
    parameters it updates (None: every parameter of the buckets).

    Parameters
    ----------
    optimizer : distlab.optim.Optimizer
        Its :meth:`~distlab.optim.Optimizer.step_param` updates one parameter.
    params : iterable of Tensor, optional
    """

    __slots__ = ("optimizer", "params_to_optimize")

    def __init__(self, optimizer, params=None):
        if not callable(getattr(optimizer, "step_param", None)):
            raise TypeError(f"{type(optimizer).__name__} has no step_param(param, grad): it cannot update one "
                            "parameter at a time")
        self.optimizer = optimizer
        self.params_to_optimize = None if params is None else {id(p) for p in params}


def hook_then_optimizer(hook, optimizer_state: OptimizerHookState):
    """Wrap ``hook`` so that each bucket's parameters are updated as soon as the bucket is reduced.

    Mirrors torch's ``optimizer_overlap_hooks._hook_then_optimizer``. The update runs when the bucket's future
    completes (while later buckets are still on the wire, or backward still computes), so the optimizer step
    overlaps communication instead of following it. Updating a parameter during backward is safe: its
    gradient exists, so the graph node that used it has run. The returned hook's future completes with the
    reduced buffer, as the hook's own did.
    """
    wanted = optimizer_state.params_to_optimize

    def hook_then_optimizer_hook(state, bucket):
        def step(fut):
            reduced = fut.value()
            bucket.set_buffer(reduced)
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                if wanted is None or id(param) in wanted:
                    optimizer_state.optimizer.step_param(param, grad)
            return reduced

        return hook(state, bucket).then(step)

    hook_then_optimizer_hook.__name__ = f"{getattr(hook, '__name__', 'hook')}_then_optimizer"
    return hook_then_optimizer_hook
