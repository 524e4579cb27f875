"""Buckets of the DDP reducer, shared by both twins: which gradients are reduced together, and how.

Why buckets: one allreduce per parameter pays MPI's per-call latency a thousand times for a model of a thousand
small parameters; one allreduce for the whole model cannot start until the last gradient exists, so nothing
overlaps with backward. DDP's middle way is to pack gradients into buckets of about ``bucket_cap_mb`` and reduce
each bucket as soon as all of its gradients are ready.

A bucket owns one flat array, ``gradients``, and for each of its parameters a *view* into it shaped like the
parameter. Copying a gradient into its view fills the flat array piece by piece; once every piece is in, the whole
bucket goes to MPI in one call.

Everything here runs at construction, at the one-time rebuild, or once per bucket, never per gradient, so both
reducer twins (:mod:`distlab.reference.reducer`, ``distlab.core._reducer``) import it rather than each keeping a
copy. Mirrors ``compute_bucket_assignment_by_size``, ``Reducer::Bucket``, ``initialize_buckets`` and
``initialize_bucket_views`` in torch/csrc/distributed/c10d/reducer.cpp/.hpp, and ``GradBucket`` in c10d's
comm.hpp.
"""
from __future__ import annotations

import numpy as np

from ..autograd import SparseGrad, Tensor, array_module
from ..autograd.accumulate_grad import set_grad_buffer
from ..futures import Future

__all__ = ["NO_SIZE_LIMIT", "compute_bucket_assignment_by_size", "GradBucket", "Bucket", "build_buckets",
           "empty_sparse_grad", "sparse_allreduce"]

#: The size limit recorded for a sparse parameter's bucket: it is alone, so no limit applies.
NO_SIZE_LIMIT = 0


# -- bucket assignment ----------------------------------------------------------------------------------------
def _array_of(tensor):
    return tensor.data if isinstance(tensor, Tensor) else tensor  # (an ndarray's own .data is a buffer)


def _bucket_key(tensor) -> tuple:
    """Parameters share a bucket only with parameters of the same dtype on the same device."""
    data = _array_of(tensor)
    return (np.dtype(data.dtype).str, array_module(data).__name__)  # "numpy" or the device's (one GPU per rank)


def _nbytes(tensor) -> int:
    data = _array_of(tensor)
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
        bucket[2] = int(size_limits[position])
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


# -- what a communication hook sees ---------------------------------------------------------------------------
class GradBucket:
    """What a communication hook receives: one bucket's flat buffer and what it holds.

    Mirrors ``c10d::GradBucket``. A hook reduces :meth:`buffer` across ranks and returns a
    :class:`~distlab.futures.Future` whose value is the reduced buffer (the same array or a new one of the same
    size).
    """

    __slots__ = ("_index", "_bucket_count", "_buffer", "_offsets", "_lengths", "_sizes", "_parameters", "_lazy",
                 "_shadow")

    def __init__(self, index, bucket_count, buffer, offsets, lengths, sizes, parameters):
        self._index = index
        self._bucket_count = bucket_count
        self._buffer = buffer
        self._offsets = list(offsets)
        self._lengths = list(lengths)
        self._sizes = list(sizes)
        self._parameters = list(parameters)
        self._lazy = None
        self._shadow = False

    @classmethod
    def of_bucket(cls, index, bucket_count, bucket, params, buffer=None, shadow=False):
        """The reducer's view of its bucket ``index``: shares the bucket's lists (the accessors copy them) and
        lists the parameters only if the hook asks, so launching a bucket costs nothing per parameter.
        ``shadow``: the zeros a joined rank reduces to match the others (see :meth:`is_shadow`)."""
        grad_bucket = cls.__new__(cls)
        grad_bucket._index, grad_bucket._bucket_count = index, bucket_count
        grad_bucket._buffer = bucket.gradients if buffer is None else buffer
        grad_bucket._offsets, grad_bucket._lengths, grad_bucket._sizes = bucket.offsets, bucket.lengths, bucket.sizes
        grad_bucket._parameters, grad_bucket._lazy = None, (params, bucket.variable_indices)
        grad_bucket._shadow = shadow
        return grad_bucket

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
        if self._parameters is None:
            params, indices = self._lazy
            self._parameters = [params[i] for i in indices]
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

    def is_shadow(self) -> bool:
        """True for the zero bucket a rank that has joined (:class:`~distlab.join.Join`) reduces to match the ranks
        still training (a distlab addition: a hook that keeps state, as PowerSGD's error feedback, then leaves
        it alone and contributes exact zeros)."""
        return self._shadow

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._index == self._bucket_count - 1

    def __repr__(self) -> str:
        return f"<GradBucket {self._index}/{self._bucket_count} {len(self.parameters())} params>"


# -- the reducer's own record of a bucket ---------------------------------------------------------------------
class Bucket:
    """The reducer's record of a bucket (reducer.hpp ``Bucket``).

    Attributes
    ----------
    variable_indices : list of int
        The parameters in this bucket.
    gradients : ndarray or SparseGrad or None
        The flat buffer (dense buckets); for a sparse bucket, the sparse gradient once ready.
    arena : SharedArena or None
        The node-shared memory ``gradients`` lives in (kept alive here: allreduce reduces it in place only while
        its arena lives), or None for private memory.
    offsets, lengths, sizes : list
        Where each parameter's gradient lives in ``gradients``.
    views_in : list of ndarray
        Views of ``gradients`` that gradients are copied into.
    views_out : list of ndarray
        Views of the reduced result that gradients are copied back from (the same as ``views_in`` unless a
        communication hook returned a new array).
    pending : int
        Gradients still missing this iteration; the bucket is ready at 0 (the core twin counts in a C array).
    expect_sparse_gradient : bool
        A bucket of one sparse-gradient parameter.
    future : Future or None
        The reduction in flight.
    size_limit : int
        The byte limit this bucket was built with (for logging).
    """

    __slots__ = ("variable_indices", "expect_sparse_gradient", "size_limit", "gradients", "offsets", "lengths",
                 "sizes", "views_in", "views_out", "pending", "future", "arena")

    def __init__(self, variable_indices, expect_sparse_gradient, size_limit):
        self.variable_indices = list(variable_indices)
        self.expect_sparse_gradient = expect_sparse_gradient
        self.size_limit = size_limit
        self.gradients = None
        self.offsets, self.lengths, self.sizes = [], [], []
        self.views_in, self.views_out = [], []
        self.pending = len(self.variable_indices)
        self.future = None
        self.arena = None  # the shared-memory arena holding ``gradients``, when the group's ranks share a node

    def nbytes(self) -> int:
        """Bytes on the wire for a dense bucket (0 for a sparse one: its size changes every step)."""
        return 0 if self.expect_sparse_gradient else int(self.gradients.nbytes)


def build_buckets(bucket_indices, params, names, expect_sparse, reduce_dtype, gradient_as_bucket_view,
                  size_limits=None, group=None) -> list:
    """Allocate every bucket's flat buffer and views, checking what may share a bucket.

    Mirrors ``initialize_buckets`` and ``initialize_bucket_views`` in reducer.cpp. Every check names the
    parameters involved (the anchor names them only in debug mode). With ``gradient_as_bucket_view``, a parameter
    that already has a gradient gets it copied into its view, and the view becomes its ``.grad``; a parameter
    without one keeps ``None`` until a reduced gradient is written back (as the anchor: a parameter unused on
    every rank must end backward with no gradient, not a zero one that weight decay would then apply).
    """
    flat = sorted(i for bucket in bucket_indices for i in bucket)
    if flat != list(range(len(params))):
        raise ValueError(f"bucket_indices must hold every parameter index 0..{len(params) - 1} exactly once, got "
                         f"{bucket_indices}")
    limits = list(size_limits) if size_limits is not None else [0] * len(bucket_indices)
    buckets = [_build_bucket(b, indices, params, names, expect_sparse, limits[b], reduce_dtype)
               for b, indices in enumerate(bucket_indices)]
    if group is not None and hasattr(group, "shared_arrays"):
        _place_in_shared_memory(buckets, group)
    for bucket in buckets:
        if gradient_as_bucket_view and not bucket.expect_sparse_gradient:
            _point_grads_at_views(bucket, params)
        _set_grad_buffers(bucket, params, gradient_as_bucket_view)
    return buckets


def _device_of(array) -> str:
    """"cpu" for host arrays, "cuda" for device arrays (as torch names a tensor's device in its errors)."""
    return "cpu" if array_module(array) is np else "cuda"


def _build_bucket(bucket_index, indices, params, names, expect_sparse, size_limit, reduce_dtype) -> Bucket:
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
                f"{_device_of(first)} {first.dtype}, {names[i]!r} is {_device_of(data)} {data.dtype}; "
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
    _use_buffer(bucket, array_module(first).zeros(offset, dtype=dtype))
    return bucket


def _use_buffer(bucket, gradients) -> None:
    bucket.gradients = gradients
    bucket.views_in = [gradients[o:o + n].reshape(s) for o, n, s in zip(bucket.offsets, bucket.lengths, bucket.sizes)]
    bucket.views_out = bucket.views_in


def _place_in_shared_memory(buckets, group) -> None:
    """Move the dense host buckets into one shared-memory arena when the group's ranks share a node, and the
    dense device buckets into device memory every rank of the node maps when the group's device collectives go
    through the ipc transport (``ProcessGroup.device_shared_arrays``).

    Collective (every rank builds its buckets at the same point). The group's allreduce then reduces each bucket
    in place, every rank adding up its block of all ranks' copies, instead of copying it through MPI (see
    :mod:`distlab.comm.shared`; no counterpart in the anchor, whose gloo and NCCL buckets are private).
    """
    for on_host, make in ((True, group.shared_arrays), (False, getattr(group, "device_shared_arrays", None))):
        if make is None:
            continue
        dense = [bucket for bucket in buckets
                 if not bucket.expect_sparse_gradient and (type(bucket.gradients) is np.ndarray) == on_host]
        placed = make([(bucket.gradients.size, bucket.gradients.dtype) for bucket in dense])
        if placed is None:  # on every rank, when any rank cannot or will not
            continue
        memory, arrays = placed
        for bucket, gradients in zip(dense, arrays):
            _use_buffer(bucket, gradients)
            bucket.arena = memory


def _point_grads_at_views(bucket, params) -> None:
    """gradient_as_bucket_view: an existing ``.grad`` moves into its view, which becomes the ``.grad``."""
    for view, i in zip(bucket.views_in, bucket.variable_indices):
        grad = params[i].grad
        if grad is not None and grad.data is not view:
            view[...] = grad.data
            params[i].grad = Tensor(view)


def _set_grad_buffers(bucket, params, gradient_as_bucket_view) -> None:
    """gradient_as_bucket_view: backward computes each gradient straight into its view (no counterpart in the
    anchor, which copies it there), on the host or on the device; otherwise, and for a view ``set_grad_buffer``
    refuses (another dtype), no buffer."""
    for position, i in enumerate(bucket.variable_indices):
        view = None if bucket.expect_sparse_gradient or not gradient_as_bucket_view else bucket.views_in[position]
        try:
            set_grad_buffer(params[i], view)
        except ValueError:
            set_grad_buffer(params[i], None)  # the gradient arrives as usual and is copied into the view


# -- sparse gradients -----------------------------------------------------------------------------------------
def empty_sparse_grad(param) -> SparseGrad:
    """A sparse gradient with no rows: what a rank contributes for a sparse parameter it did not use."""
    shape, xp = param.data.shape, array_module(param.data)  # on the parameter's device
    values = xp.zeros((0,) + tuple(shape[1:]), dtype=param.data.dtype)
    return SparseGrad(xp.zeros(0, dtype=np.int64), values, shape)


def sparse_allreduce(process_group, grad: SparseGrad, name=None) -> Future:
    """Sum a row-sparse gradient over ranks: gather every rank's rows, concatenate, coalesce.

    Sparse gradients cannot be summed in place (ranks touch different rows), so, as gloo does for sparse
    allreduce, every rank gathers all (indices, values) pairs and sums them itself.
    """
    work = process_group.allgather_object((grad.indices, grad.values), async_op=True, name=name)

    def combine(fut: Future) -> SparseGrad:
        parts, xp = fut.value(), array_module(grad.values)  # the gathered pieces come back on the device
        indices = xp.concatenate([xp.asarray(i) for i, _ in parts])
        values = xp.concatenate([xp.asarray(v) for _, v in parts])
        return SparseGrad(indices, values, grad.shape).coalesce()

    return work.get_future().then(combine)
