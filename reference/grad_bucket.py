"""Buckets of the reducer: flat gradient buffers with one view per parameter (part of the reducer twin).

Twinned with ``core/_reducer.pyx`` (``GradBucket`` and the bucket set-up there); re-exported by
:mod:`distlab.reference.reducer`.

A bucket owns one flat array, ``gradients``, and for each of its parameters a *view* into it shaped like the
parameter. Copying a gradient into its view fills the flat array piece by piece; once every piece is in, the whole
bucket goes to MPI in one call. Mirrors ``Reducer::Bucket``, ``initialize_buckets`` and
``initialize_bucket_views`` in reducer.cpp/.hpp, and ``GradBucket`` in c10d's comm.hpp.
"""
from __future__ import annotations

import numpy as np

from distlab.autograd import Tensor

__all__ = ["GradBucket", "Bucket", "build_bucket"]


class GradBucket:
    """What a communication hook receives: one bucket's flat buffer and what it holds.

    Mirrors ``c10d::GradBucket``. A hook reduces :meth:`buffer` across ranks and returns a Future of the result.
    """

    def __init__(self, index, bucket_count, buffer, offsets, lengths, sizes, parameters):
        self._index = index
        self._bucket_count = bucket_count
        self._buffer = buffer
        self._offsets = list(offsets)
        self._lengths = list(lengths)
        self._sizes = list(sizes)
        self._parameters = list(parameters)

    def index(self) -> int:
        """The bucket's position in reduction order (bucket 0 is reduced first)."""
        return self._index

    def buffer(self):
        """The flat array of the bucket's gradients (already divided by the world size unless a hook runs)."""
        return self._buffer

    def set_buffer(self, buffer) -> None:
        """Replace the flat array (a hook that reduces into a new array can hand it back this way)."""
        self._buffer = buffer

    def gradients(self) -> list:
        """Views of :meth:`buffer`, one per parameter, shaped like the parameter."""
        return [self._buffer[o:o + n].reshape(s) for o, n, s in zip(self._offsets, self._lengths, self._sizes)]

    def parameters(self) -> list:
        """The parameters whose gradients this bucket holds."""
        return list(self._parameters)

    def offsets(self) -> list:
        """Where each parameter's gradient starts in :meth:`buffer` (in elements)."""
        return list(self._offsets)

    def lengths(self) -> list:
        """How many elements each parameter's gradient has."""
        return list(self._lengths)

    def sizes(self) -> list:
        """Each parameter's shape."""
        return list(self._sizes)

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._index == self._bucket_count - 1

    def __repr__(self) -> str:
        return f"<GradBucket {self._index}/{self._bucket_count} {len(self._parameters)} params>"


class Bucket:
    """The reducer's own record of a bucket (reducer.hpp ``Bucket``).

    Attributes
    ----------
    variable_indices : list of int
        The parameters in this bucket.
    gradients : ndarray or None
        The flat buffer (dense buckets); for a sparse bucket, the sparse gradient once ready.
    offsets, lengths, sizes : list
        Where each parameter's gradient lives in ``gradients``.
    views_in : list of ndarray
        Views of ``gradients`` that gradients are copied into.
    views_out : list of ndarray
        Views of the reduced result that gradients are copied back from (the same as ``views_in`` unless a
        communication hook returned a new array).
    pending : int
        Gradients still missing this iteration; the bucket is ready at 0.
    expect_sparse_gradient : bool
        A bucket of one sparse-gradient parameter.
    future : Future or None
        The reduction in flight.
    size_limit : int
        The byte limit this bucket was built with (for logging).
    """

    def __init__(self, variable_indices, expect_sparse_gradient, size_limit):
        self.variable_indices = list(variable_indices)
        self.expect_sparse_gradient = expect_sparse_gradient
        self.size_limit = size_limit
        self.gradients = None
        self.offsets, self.lengths, self.sizes = [], [], []
        self.views_in, self.views_out = [], []
        self.pending = len(self.variable_indices)
        self.future = None
        self.launch_us = 0.0


def build_bucket(bucket_index, indices, params, names, expect_sparse, size_limit, reduce_dtype) -> Bucket:
    """Allocate one bucket's flat buffer and views, checking what may share a bucket.

    Mirrors the body of ``initialize_buckets`` and ``initialize_bucket_views`` in reducer.cpp. Every check here
    names the parameters involved (the anchor names them only in debug mode).
    """
    if not indices:
        raise ValueError(f"bucket {bucket_index} is empty: every bucket must hold at least one parameter")
    sparse = [i for i in indices if expect_sparse[i]]
    if sparse and len(indices) > 1:
        raise ValueError(
            f"parameter {names[sparse[0]]!r} expects a sparse gradient and must be alone in its bucket, but "
            f"bucket {bucket_index} holds {len(indices)} parameters: {[names[i] for i in indices]}")
    bucket = Bucket(indices, bool(sparse), size_limit)
    if sparse:
        return bucket  # a sparse gradient is reduced as it is, without a flat buffer
    first = params[indices[0]].data
    for i in indices[1:]:
        data = params[i].data
        if data.dtype != first.dtype or type(data) is not type(first):
            raise TypeError(
                f"bucket {bucket_index} mixes parameters of different dtype or device: {names[indices[0]]!r} is "
                f"{type(first).__module__} {first.dtype}, {names[i]!r} is {type(data).__module__} {data.dtype}; "
                "all parameters of a bucket must share dtype and device")
    dtype = np.dtype(reduce_dtype) if reduce_dtype is not None else first.dtype
    offset = 0
    for i in indices:
        shape = params[i].data.shape
        length = int(np.prod(shape, dtype=np.int64))
        bucket.offsets.append(offset)
        bucket.lengths.append(length)
        bucket.sizes.append(shape)
        offset += length
    xp = np if isinstance(first, np.ndarray) else __import__(type(first).__module__.split(".")[0])
    bucket.gradients = xp.zeros(offset, dtype=dtype)
    bucket.views_in = [bucket.gradients[o:o + n].reshape(s)
                       for o, n, s in zip(bucket.offsets, bucket.lengths, bucket.sizes)]
    bucket.views_out = bucket.views_in
    return bucket


def point_grads_at_views(bucket, params) -> None:
    """gradient_as_bucket_view: make each parameter's ``.grad`` the bucket view itself.

    Mirrors the ``gradient_as_bucket_view`` branch of ``initialize_bucket_views``: an existing gradient is
    copied into the view first, so nothing is lost; afterwards the optimizer reads the bucket directly and no
    copy back is needed after the reduction.
    """
    for view, i in zip(bucket.views_in, bucket.variable_indices):
        grad = params[i].grad
        if grad is not None:
            view[...] = grad.data
        params[i].grad = Tensor._wrap(view)
