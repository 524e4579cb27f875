"""Bucket assignment: which parameters' gradients are reduced together (part of the reducer twin).

Twinned with ``core/_reducer.pyx`` (``compute_bucket_assignment_by_size`` there); re-exported by
:mod:`distlab.reference.reducer`.

Why buckets: one allreduce per parameter pays MPI's per-call latency a thousand times for a model of a thousand
small parameters; one allreduce for the whole model cannot start until the last gradient exists, so nothing
overlaps with backward. DDP's middle way is to pack gradients into buckets of about ``bucket_cap_mb`` and reduce
each bucket as soon as all of its gradients are ready.

Mirrors ``compute_bucket_assignment_by_size`` in torch/csrc/distributed/c10d/reducer.cpp.
"""
from __future__ import annotations

import numpy as np

from distlab.autograd import Tensor

__all__ = ["compute_bucket_assignment_by_size"]

#: The size limit recorded for a sparse parameter's bucket: it is alone, so no limit applies.
NO_SIZE_LIMIT = 0


def _bucket_key(tensor) -> tuple:
    """Parameters share a bucket only with parameters of the same dtype on the same device."""
    data = tensor.data if isinstance(tensor, Tensor) else tensor  # ndarray.data is a buffer
    device = type(data).__module__.split(".")[0]  # "numpy" or "cupy" (one GPU per rank)
    return (np.dtype(data.dtype).str, device)


def _nbytes(tensor) -> int:
    data = tensor.data if isinstance(tensor, Tensor) else tensor  # ndarray.data is a buffer
    return int(data.size) * np.dtype(data.dtype).itemsize


def compute_bucket_assignment_by_size(tensors, size_limits, expect_sparse_gradient=None, tensor_indices=None):
    """Group ``tensors`` into buckets of at most about ``size_limits`` bytes.

    Parameters
    ----------
    tensors : sequence of Tensor or ndarray
        The parameters, in registration order (or in gradient-arrival order, with ``tensor_indices``).
    size_limits : sequence of int
        Byte limits: the first bucket of each (dtype, device) closes at ``size_limits[0]``, the next at
        ``size_limits[1]``, and so on; the last limit repeats. DDP passes ``[bucket_cap]`` at construction
        and ``[first_bucket_cap, bucket_cap]`` when it rebuilds buckets (a small first bucket starts
        communication early).
    expect_sparse_gradient : sequence of bool, optional
        Per parameter *index*: True puts that parameter in a bucket of its own.
    tensor_indices : sequence of int, optional
        The parameter index of each entry of ``tensors`` (when ``tensors`` is in arrival order). When given,
        buckets keep that order; otherwise buckets are sorted by their smallest parameter index.

    Returns
    -------
    (list of list of int, list of int)
        The buckets (parameter indices) and each bucket's size limit.
    """
    if not size_limits:
        raise ValueError("size_limits must hold at least one byte limit")
    if len(tensors) == 0:
        raise ValueError("compute_bucket_assignment_by_size needs at least one tensor")
    if tensor_indices is not None and len(tensor_indices) != len(tensors):
        raise ValueError(f"tensor_indices has {len(tensor_indices)} entries for {len(tensors)} tensors")
    result = []  # (indices, size_limit) per closed bucket
    open_buckets = {}  # key -> [indices, size, size_limit]; dicts keep first-seen order (deterministic)
    limit_position = {}  # key -> position in size_limits
    for i, tensor in enumerate(tensors):
        index = i if tensor_indices is None else int(tensor_indices[i])
        if getattr(tensor, "is_sparse", False):
            raise TypeError(f"tensor {index} is sparse: parameters must be dense (their gradients may be sparse)")
        if expect_sparse_gradient is not None and expect_sparse_gradient[index]:
            result.append(([index], NO_SIZE_LIMIT))
            continue
        key = _bucket_key(tensor)
        bucket = open_buckets.setdefault(key, [[], 0, 0])
        position = limit_position.setdefault(key, 0)
        bucket[0].append(index)
        bucket[1] += _nbytes(tensor)
        bucket[2] = size_limits[position]
        if bucket[1] >= bucket[2]:  # close at or past the limit, as reducer.cpp does
            result.append((bucket[0], bucket[2]))
            open_buckets[key] = [[], 0, 0]
            limit_position[key] = min(position + 1, len(size_limits) - 1)
    for indices, _size, limit in open_buckets.values():
        if indices:
            result.append((indices, limit))
    if tensor_indices is None:
        # Parameters are used in forward in registration order, so gradients arrive roughly in reverse of it;
        # sorting by smallest index keeps buckets contiguous in that order.
        result.sort(key=lambda bucket: min(bucket[0]))
    return [list(indices) for indices, _ in result], [limit for _, limit in result]
