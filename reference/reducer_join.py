"""The reducer's side of Join: how a rank that ran out of inputs shadows one iteration (part of the reducer twin).

Twinned with ``core/_reducer.pyx`` (the same four methods of its ``Reducer``). DDP's join hook
(:mod:`distlab.ddp`) calls these; they mirror the ``Reducer`` methods that torch/nn/parallel/distributed.py's
``_DDPJoinHook`` uses (``_get_zeros_like_grad_buckets``, ``_run_comm_hook``, ``_get_local_used_map``,
``_push_all_rebuilt_params``). The point of each: issue the very collective the training ranks issue in their
backward pass, bucket by bucket and with the same names, contributing zeros.
"""
from __future__ import annotations

import numpy as np

from distlab.autograd import SparseGrad
from distlab.ddp_comm_hooks import sparse_allreduce
from distlab.reference.grad_bucket import GradBucket

__all__ = ["ReducerJoinMixin"]


class ReducerJoinMixin:
    """Join support mixed into :class:`distlab.reference.reducer.Reducer`."""

    def _get_zeros_like_grad_buckets(self):
        """The buckets in reduction order, holding zeros: a joined rank's contribution."""
        buckets = []
        for b, bucket in enumerate(self.buckets):
            params = [self.params[i] for i in bucket.variable_indices]
            if bucket.expect_sparse_gradient:
                shape = params[0].data.shape
                zeros = SparseGrad(np.zeros(0, dtype=np.int64),
                                   np.zeros((0,) + tuple(shape[1:]), dtype=params[0].data.dtype), shape)
            else:
                zeros = np.zeros_like(bucket.gradients)
            buckets.append(GradBucket(b, len(self.buckets), zeros, bucket.offsets, bucket.lengths, bucket.sizes,
                                      params))
        return buckets

    def _run_comm_hook(self, grad_bucket):
        """Reduce one bucket as ``all_reduce_bucket`` would (same collective, same name)."""
        b = grad_bucket.index()
        if self.comm_hook is not None:
            return self.comm_hook(self.comm_hook_state, grad_bucket)
        if isinstance(grad_bucket.buffer(), SparseGrad):
            return sparse_allreduce(self.process_group, grad_bucket.buffer(), name=f"bucket{b}")
        return self.process_group.allreduce(grad_bucket.buffer(), async_op=True, name=f"bucket{b}").get_future()

    def _get_local_used_map(self):
        """A joined rank used no parameter: zeros (the anchor sends its stale map from its last iteration)."""
        return np.zeros(len(self.params), dtype=np.int32)

    def _push_all_rebuilt_params(self):
        """A joined rank records every parameter, so its next shadowed rebuild broadcasts like the others'."""
        if self._should_rebuild_buckets():
            self.rebuilt_param_indices = list(range(len(self.params)))
