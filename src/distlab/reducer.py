"""``distlab.reducer``: the active twin's DDP reducer, plus the communication hooks.

``Reducer``, ``GradBucket`` and ``compute_bucket_assignment_by_size`` come from the twin chosen by
``DISTLAB_IMPL`` (read :mod:`distlab.reference.reducer` for the explanation); the hooks are shared.
"""
from ._backend import load as _load
from .ddp import DistributedDataParallel
from .ddp_comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook

_impl = _load("reducer")
Reducer = _impl.Reducer
GradBucket = _impl.GradBucket
compute_bucket_assignment_by_size = _impl.compute_bucket_assignment_by_size

__all__ = ["Reducer", "GradBucket", "compute_bucket_assignment_by_size", "DistributedDataParallel",
           "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook"]
