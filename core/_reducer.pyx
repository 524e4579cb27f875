# cython: language_level=3
"""Core twin of the DDP reducer: :mod:`distlab.reference.reducer`, :mod:`distlab.reference.bucketing` and
:mod:`distlab.reference.grad_bucket` in one module (read those for the explanation).

What differs: the per-parameter bookkeeping (locators, ready flags, hook counts, used maps, pending counts, the
arrival order) lives in C arrays, each parameter's hook is a small C-level callable, a parameter's ``grad`` and
its ``data`` are read from Tensor's slots, and a float32/float64 gradient is copied and scaled into its bucket by
a C loop over the array's memory, found through numpy's C API (no numpy call, no buffer export, no temporary).
Launching a bucket builds no per-parameter Python object: the GradBucket shares the bucket's lists.
"""
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        pass
    object PyMember_GetOne(const char* obj_addr, PyMemberDef* member)

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    void* Py_TYPE(object obj)

from distlab import _reducer_support as support
from distlab import comm as _comm
from distlab.autograd import SparseGrad, Tensor, graph_leaves, queue_callback
from distlab.ddp_comm_hooks import sparse_allreduce

__all__ = ["Reducer", "GradBucket", "compute_bucket_assignment_by_size"]

MiB = 1024 * 1024
NO_SIZE_LIMIT = 0

cdef object _F32 = np.dtype(np.float32)
cdef object _F64 = np.dtype(np.float64)
cdef object _ndarray = np.ndarray


# -- reading a Tensor's slots ---------------------------------------------------------------------------------
# Tensor keeps ``grad`` and ``data`` in __slots__. Python's attribute lookup (type lookup, descriptor check, call)
# costs more than the rest of a small parameter's bookkeeping, so the hot path reads the slot through its member
# definition, as the slot descriptor itself would. Only for objects whose class resolves the name to Tensor's own
# slot (checked once per parameter at construction; for gradients, the exact type Tensor): anything else, a
# subclass with a ``grad`` property for instance, goes through ordinary getattr.
cdef PyMemberDef* _member_of(object slot) except NULL:
    if type(slot).__name__ != "member_descriptor":
        raise TypeError(f"expected a __slots__ member descriptor, got {type(slot).__name__}")
    return (<PyMemberDescrObject*>slot).d_member


cdef object _GRAD_SLOT = Tensor.__dict__["grad"]
cdef object _DATA_SLOT = Tensor.__dict__["data"]
cdef PyMemberDef* _GRAD_MEMBER = _member_of(_GRAD_SLOT)
cdef PyMemberDef* _DATA_MEMBER = _member_of(_DATA_SLOT)


cdef bint _reads_tensor_slots(object param):
    """True when ``param.grad`` is Tensor's own slot (so it may be read directly)."""
    cls = type(param)
    return (isinstance(param, Tensor) and getattr(cls, "grad", None) is _GRAD_SLOT
            and cls.__getattribute__ is Tensor.__getattribute__)


cdef inline object _grad_of(object param, void* slot_type):
    """``param.grad``, read from the slot when ``param`` is still of the class checked at construction."""
    if slot_type != NULL and <void*>Py_TYPE(param) == slot_type:
        return PyMember_GetOne(<const char*><void*>param, _GRAD_MEMBER)
    return param.grad


cdef inline object _data_of(object tensor):
    """``tensor.data``, read from the slot for a plain Tensor."""
    if type(tensor) is Tensor:
        return PyMember_GetOne(<const char*><void*>tensor, _DATA_MEMBER)
    return tensor.data


# -- bucketing (reference: bucketing.py) ---------------------------------------------------------------------
def _bucket_key(tensor):
    """See :func:`distlab.reference.bucketing._bucket_key`."""
    data = tensor.data if isinstance(tensor, Tensor) else tensor  # ndarray.data is a buffer
    return (np.dtype(data.dtype).str, type(data).__module__.split(".")[0])


def compute_bucket_assignment_by_size(tensors, size_limits, expect_sparse_gradient=None, tensor_indices=None):
    """See :func:`distlab.reference.bucketing.compute_bucket_assignment_by_size`."""
    cdef Py_ssize_t i, index, position, nlimits
    cdef long long nbytes
    if not size_limits:
        raise ValueError("size_limits must hold at least one byte limit")
    if len(tensors) == 0:
        raise ValueError("compute_bucket_assignment_by_size needs at least one tensor")
    if tensor_indices is not None and len(tensor_indices) != len(tensors):
        raise ValueError(f"tensor_indices has {len(tensor_indices)} entries for {len(tensors)} tensors")
    limits = [int(x) for x in size_limits]
    nlimits = len(limits)
    result = []
    open_buckets = {}
    limit_position = {}
    for i in range(len(tensors)):
        tensor = tensors[i]
        index = i if tensor_indices is None else int(tensor_indices[i])
        if getattr(tensor, "is_sparse", False):
            raise TypeError(f"tensor {index} is sparse: parameters must be dense (their gradients may be sparse)")
        if expect_sparse_gradient is not None and expect_sparse_gradient[index]:
            result.append(([index], NO_SIZE_LIMIT))
            continue
        key = _bucket_key(tensor)
        bucket = open_buckets.get(key)
        if bucket is None:
            bucket = open_buckets[key] = [[], 0, 0]
        position = limit_position.setdefault(key, 0)
        data = tensor.data if isinstance(tensor, Tensor) else tensor  # ndarray.data is a buffer
        nbytes = <long long>data.size * np.dtype(data.dtype).itemsize
        bucket[0].append(index)
        bucket[1] += nbytes
        bucket[2] = limits[position]
        if bucket[1] >= bucket[2]:
            result.append((bucket[0], bucket[2]))
            open_buckets[key] = [[], 0, 0]
            limit_position[key] = min(position + 1, nlimits - 1)
    for indices, _size, limit in open_buckets.values():
        if indices:
            result.append((indices, limit))
    if tensor_indices is None:
        result.sort(key=lambda bucket: min(bucket[0]))
    return [list(indices) for indices, _ in result], [limit for _, limit in result]


# -- buckets (reference: grad_bucket.py) ---------------------------------------------------------------------
class GradBucket:
    """See :class:`distlab.reference.grad_bucket.GradBucket`."""

    def __init__(self, index, bucket_count, buffer, offsets, lengths, sizes, parameters):
        """See :class:`distlab.reference.grad_bucket.GradBucket`."""
        self._index = index
        self._bucket_count = bucket_count
        self._buffer = buffer
        self._offsets = list(offsets)
        self._lengths = list(lengths)
        self._sizes = list(sizes)
        self._parameters = list(parameters)

    def index(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.index`."""
        return self._index

    def buffer(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.buffer`."""
        return self._buffer

    def set_buffer(self, buffer):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.set_buffer`."""
        self._buffer = buffer

    def gradients(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.gradients`."""
        return [self._buffer[o:o + n].reshape(s) for o, n, s in zip(self._offsets, self._lengths, self._sizes)]

    def parameters(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.parameters`."""
        if self._parameters is None:
            all_params, indices = self._lazy_parameters
            self._parameters = [all_params[i] for i in indices]
        return list(self._parameters)

    def offsets(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.offsets`."""
        return list(self._offsets)

    def lengths(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.lengths`."""
        return list(self._lengths)

    def sizes(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.sizes`."""
        return list(self._sizes)

    def is_last(self):
        """See :meth:`distlab.reference.grad_bucket.GradBucket.is_last`."""
        return self._index == self._bucket_count - 1

    def __repr__(self):
        return f"<GradBucket {self._index}/{self._bucket_count} {len(self.parameters())} params>"


cdef object _grad_bucket_of(Py_ssize_t b, Py_ssize_t count, _Bucket bucket, list params):
    """The reducer's own GradBucket for bucket b: shares the bucket's lists (the accessors copy them) and builds
    the parameter list only if a hook asks, so launching a bucket costs nothing per parameter."""
    grad_bucket = GradBucket.__new__(GradBucket)
    grad_bucket._index, grad_bucket._bucket_count, grad_bucket._buffer = b, count, bucket.gradients
    grad_bucket._offsets, grad_bucket._lengths, grad_bucket._sizes = bucket.offsets, bucket.lengths, bucket.sizes
    grad_bucket._parameters, grad_bucket._lazy_parameters = None, (params, bucket.variable_indices)
    return grad_bucket


cdef class _Bucket:
    """See :class:`distlab.reference.grad_bucket.Bucket`."""
    cdef public list variable_indices, offsets, lengths, sizes, views_in, views_out
    cdef public object gradients, future
    cdef public bint expect_sparse_gradient
    cdef public long long size_limit

    def __init__(self, variable_indices, expect_sparse_gradient, size_limit):
        self.variable_indices = list(variable_indices)
        self.expect_sparse_gradient = expect_sparse_gradient
        self.size_limit = size_limit
        self.gradients = None
        self.offsets, self.lengths, self.sizes = [], [], []
        self.views_in, self.views_out = [], []
        self.future = None


def _build_bucket(bucket_index, indices, params, names, expect_sparse, size_limit, reduce_dtype):
    """See :func:`distlab.reference.grad_bucket.build_bucket`."""
    if not indices:
        raise ValueError(f"bucket {bucket_index} is empty: every bucket must hold at least one parameter")
    sparse = [i for i in indices if expect_sparse[i]]
    if sparse and len(indices) > 1:
        raise ValueError(
            f"parameter {names[sparse[0]]!r} expects a sparse gradient and must be alone in its bucket, but "
            f"bucket {bucket_index} holds {len(indices)} parameters: {[names[i] for i in indices]}")
    bucket = _Bucket(indices, bool(sparse), size_limit)
    if sparse:
        return bucket
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


cdef inline bint _plain_array(object data, int kind, Py_ssize_t count):
    """True when ``data`` is a native-order, C-contiguous numpy array of ``count`` elements of the kind's dtype.

    Read straight from the array struct (numpy's C API): no buffer export, which costs more than the copy itself
    for the small gradients of a many-parameter model.
    """
    cdef cnp.ndarray array
    if type(data) is not _ndarray:
        return False
    array = <cnp.ndarray>data
    return (cnp.PyArray_TYPE(array) == <int>(cnp.NPY_FLOAT32 if kind == KIND_F32 else cnp.NPY_FLOAT64)
            and cnp.PyArray_IS_C_CONTIGUOUS(array) and cnp.PyArray_ISNOTSWAPPED(array)
            and cnp.PyArray_SIZE(array) == count)


cdef bint _scaled_copy(object data, char* dst, Py_ssize_t count, int kind, double scale) except -1:
    """``dst[:count] = data * scale`` by a C loop when ``data`` is a C-contiguous array of the kind's dtype.

    Returns False (nothing done) when ``data`` does not qualify, so the caller takes numpy's path. Works in place
    when ``data`` is the bucket view itself (gradient_as_bucket_view).
    """
    cdef Py_ssize_t k
    cdef float* f_dst
    cdef float* f_src
    cdef float f_scale
    cdef double* d_dst
    cdef double* d_src
    if not _plain_array(data, kind, count):
        return False
    if scale == 1.0:  # a communication hook divides by itself: a plain copy (or nothing, in place)
        if cnp.PyArray_DATA(<cnp.ndarray>data) != <void*>dst:
            memcpy(dst, cnp.PyArray_DATA(<cnp.ndarray>data), count * (4 if kind == KIND_F32 else 8))
        return True
    if kind == KIND_F32:
        f_dst = <float*>dst
        f_src = <float*>cnp.PyArray_DATA(<cnp.ndarray>data)
        f_scale = <float>scale
        for k in range(count):
            f_dst[k] = f_src[k] * f_scale
    else:
        d_dst = <double*>dst
        d_src = <double*>cnp.PyArray_DATA(<cnp.ndarray>data)
        for k in range(count):
            d_dst[k] = d_src[k] * scale
    return True


cdef int _copy_from_view(object grad, char* view, Py_ssize_t count, int kind, object view_array) except -1:
    """``grad[...] = view`` by memcpy from the bucket view's known address (numpy's setitem otherwise)."""
    cdef void* dst
    if _plain_array(grad, kind, count) and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>grad):
        dst = cnp.PyArray_DATA(<cnp.ndarray>grad)
        if dst != <void*>view:
            memcpy(dst, view, count * (4 if kind == KIND_F32 else 8))
        return 0
    grad[...] = view_array
    return 0


cdef int _copy_into(object dst, object src) except -1:
    """``dst[...] = src`` for same-dtype C-contiguous host arrays by memcpy (numpy's setitem otherwise)."""
    cdef Py_buffer d, s
    if type(dst) is _ndarray and type(src) is _ndarray and dst.dtype is src.dtype:
        try:
            PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except BufferError:
            dst[...] = src
            return 0
        try:
            PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS)
        except BufferError:
            PyBuffer_Release(&d)
            dst[...] = src
            return 0
        if s.len == d.len:
            memcpy(d.buf, s.buf, d.len)
            PyBuffer_Release(&s)
            PyBuffer_Release(&d)
            return 0
        PyBuffer_Release(&s)
        PyBuffer_Release(&d)
    dst[...] = src
    return 0


cdef class _Hook:
    """A parameter's post-accumulate-grad hook: calls the reducer's C-level autograd_hook."""
    cdef Reducer reducer
    cdef Py_ssize_t index

    def __init__(self, Reducer reducer, Py_ssize_t index):
        self.reducer = reducer
        self.index = index

    def __call__(self, _param):
        self.reducer._autograd_hook(self.index)


# Element kinds the C copy loop handles.
cdef enum:
    KIND_OTHER = 0
    KIND_F32 = 1
    KIND_F64 = 2


cdef class Reducer:
    """See :class:`distlab.reference.reducer.Reducer`."""
    cdef public list params, param_names, expect_sparse_gradients, buckets, unused_parameters
    cdef public list hook_handles
    cdef public object process_group, reduce_dtype, comm_hook, comm_hook_state, local_used_map
    cdef public object used_during_no_sync, local_used_work, div_factor, forward_work, stats
    cdef public long long bucket_bytes_cap, first_bucket_bytes_cap
    cdef public bint find_unused_parameters, gradient_as_bucket_view, static_graph, expect_autograd_hooks
    cdef public bint require_finalize, has_rebuilt_bucket, has_marked_unused_parameters, local_used_map_reduced
    cdef public bint forward_work_static_world, _finalize_queued
    cdef bint _observe  # sampling runtime stats or recording a timeline: only then call into the stats object
    cdef public long long num_iterations
    cdef public Py_ssize_t next_bucket
    cdef Py_ssize_t n
    cdef int* loc_bucket
    cdef int* loc_pos
    cdef char* ready
    cdef void** slot_type  # params[i]'s class if its grad may be read from Tensor's slot, else NULL
    cdef list _slot_types  # keeps those classes alive
    cdef int* hook_counts
    cdef int* hook_counts_left
    cdef int* pending
    cdef int* rebuilt  # rebuilt_param_indices: the arrival order of the first iteration
    cdef Py_ssize_t n_rebuilt
    cdef char** dst_ptr
    cdef Py_ssize_t* dst_len
    cdef int* kind
    cdef int[::1] used
    cdef int[::1] used_no_sync
    cdef list _param_dtypes, _views_by_param
    cdef double _inv_div

    def __cinit__(self, *args, **kwargs):
        self.n = 0
        self.loc_bucket = self.loc_pos = self.hook_counts = self.hook_counts_left = self.pending = NULL
        self.ready = NULL
        self.slot_type = NULL
        self.rebuilt = NULL
        self.n_rebuilt = 0
        self.dst_ptr = NULL
        self.dst_len = NULL
        self.kind = NULL

    def __dealloc__(self):
        free(self.loc_bucket); free(self.loc_pos); free(self.ready); free(self.hook_counts)
        free(self.hook_counts_left); free(self.pending); free(self.dst_ptr); free(self.dst_len); free(self.kind)
        free(self.rebuilt); free(self.slot_type)

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=25 * MiB, find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=1 * MiB, reduce_dtype=None):
        """See :class:`distlab.reference.reducer.Reducer`."""
        self.params = list(params)
        if not self.params:
            raise ValueError("the reducer needs at least one parameter that requires grad")
        n = self.n = len(self.params)
        self.process_group = process_group
        self.expect_sparse_gradients = [bool(s) for s in (expect_sparse_gradients or [False] * n)]
        self.bucket_bytes_cap = int(bucket_bytes_cap)
        self.first_bucket_bytes_cap = int(first_bucket_bytes_cap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.param_names = list(param_names) if param_names is not None else [f"param{i}" for i in range(n)]
        self.reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
        if self.gradient_as_bucket_view and self.reduce_dtype is not None:
            raise ValueError("gradient_as_bucket_view cannot be used with a reduce_dtype: a bucket in another "
                             "dtype cannot be the parameters' .grad")
        self.static_graph = False
        self.comm_hook = None
        self.comm_hook_state = None
        self.num_iterations = 0
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self.has_rebuilt_bucket = False
        self.unused_parameters = []
        self.has_marked_unused_parameters = False
        self.local_used_map = np.zeros(n, dtype=np.int32)
        self.used_during_no_sync = np.zeros(n, dtype=np.int32)
        self.used = self.local_used_map
        self.used_no_sync = self.used_during_no_sync
        self.local_used_work = None
        self.local_used_map_reduced = False
        self.loc_bucket = <int*>calloc(n, sizeof(int))
        self.loc_pos = <int*>calloc(n, sizeof(int))
        self.ready = <char*>calloc(n, sizeof(char))
        self.hook_counts = <int*>calloc(n, sizeof(int))
        self.hook_counts_left = <int*>calloc(n, sizeof(int))
        self.dst_ptr = <char**>calloc(n, sizeof(char*))
        self.dst_len = <Py_ssize_t*>calloc(n, sizeof(Py_ssize_t))
        self.kind = <int*>calloc(n, sizeof(int))
        self.rebuilt = <int*>calloc(n, sizeof(int))
        self.slot_type = <void**>calloc(n, sizeof(void*))
        if not (self.rebuilt and self.slot_type and self.loc_bucket and self.loc_pos and self.ready
                and self.hook_counts and self.hook_counts_left
                and self.dst_ptr and self.dst_len and self.kind):
            raise MemoryError()
        self._param_dtypes = [p.data.dtype for p in self.params]
        self._slot_types = [type(p) for p in self.params]
        for i in range(n):
            if _reads_tensor_slots(self.params[i]):
                self.slot_type[i] = <void*>self._slot_types[i]
        self.div_factor = None
        self.forward_work = None
        self.forward_work_static_world = True
        self.stats = support.ReducerStats(process_group.rank)
        self._finalize_queued = False
        self.initialize_buckets(bucket_indices)
        self.hook_handles = [p.register_post_accumulate_grad_hook(_Hook(self, i))
                             for i, p in enumerate(self.params)]

    # -- buckets ----------------------------------------------------------------------------------------------
    def initialize_buckets(self, bucket_indices):
        """See :meth:`distlab.reference.reducer.Reducer.initialize_buckets`."""
        cdef Py_ssize_t b, position, i
        flat = sorted(i for bucket in bucket_indices for i in bucket)
        if flat != list(range(self.n)):
            raise ValueError(f"bucket_indices must hold every parameter index 0..{self.n - 1} exactly "
                             f"once, got {bucket_indices}")
        self.buckets = [_build_bucket(b, indices, self.params, self.param_names, self.expect_sparse_gradients,
                                      0, self.reduce_dtype) for b, indices in enumerate(bucket_indices)]
        free(self.pending)
        self.pending = <int*>calloc(max(len(self.buckets), 1), sizeof(int))
        if self.pending == NULL:
            raise MemoryError()
        self._views_by_param = [None] * self.n
        for b, bucket in enumerate(self.buckets):
            for position, i in enumerate(bucket.variable_indices):
                self.loc_bucket[i] = b
                self.loc_pos[i] = position
                self._locate_view(i, bucket, position)
            if self.gradient_as_bucket_view and not bucket.expect_sparse_gradient:
                self._point_grads_at_views(bucket)
        self.next_bucket = 0

    cdef _locate_view(self, Py_ssize_t i, _Bucket bucket, Py_ssize_t position):
        """Record where parameter i's view starts, so the C copy loop can write it without numpy."""
        cdef Py_ssize_t address
        self.kind[i] = KIND_OTHER
        self.dst_ptr[i] = NULL
        if bucket.expect_sparse_gradient:
            return
        view = bucket.views_in[position]
        self._views_by_param[i] = view
        if type(view) is not _ndarray or view.dtype != self._param_dtypes[i]:
            return  # device memory or a reduce dtype: numpy does the (casting) copy
        if view.dtype == _F32:
            self.kind[i] = KIND_F32
        elif view.dtype == _F64:
            self.kind[i] = KIND_F64
        else:
            return
        address = view.ctypes.data
        self.dst_ptr[i] = <char*>address
        self.dst_len[i] = view.size

    def _point_grads_at_views(self, bucket):
        for view, i in zip(bucket.views_in, bucket.variable_indices):
            grad = self.params[i].grad
            if grad is not None:
                view[...] = grad.data
            self.params[i].grad = Tensor._wrap(view)

    def get_grad_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer.get_grad_buckets`."""
        return [self._grad_bucket(b) for b in range(len(self.buckets))]

    def _grad_bucket(self, b):
        return _grad_bucket_of(b, len(self.buckets), self.buckets[b], self.params)

    @property
    def rebuilt_param_indices(self):
        """See :attr:`distlab.reference.reducer.Reducer.rebuilt_param_indices`."""
        return [self.rebuilt[k] for k in range(self.n_rebuilt)]

    @rebuilt_param_indices.setter
    def rebuilt_param_indices(self, indices):
        indices = list(indices)
        if len(indices) > self.n:
            raise ValueError(f"{len(indices)} rebuilt parameter indices for {self.n} parameters")
        for k, i in enumerate(indices):
            self.rebuilt[k] = i
        self.n_rebuilt = len(indices)

    # -- per iteration ----------------------------------------------------------------------------------------
    def prepare_for_forward(self):
        """See :meth:`distlab.reference.reducer.Reducer.prepare_for_forward`."""
        self.num_iterations += 1
        self.stats.start_iteration(self.num_iterations)

    def prepare_for_backward(self, outputs=()):
        """See :meth:`distlab.reference.reducer.Reducer.prepare_for_backward`."""
        cdef Py_ssize_t b
        self.stats.mark("backward_compute_start")
        self._observe = self.stats.sampling or self.stats.timeline.enabled
        self.expect_autograd_hooks = True
        self.rebuilt_param_indices = []
        for b in range(len(self.buckets)):
            self.pending[b] = len((<_Bucket>self.buckets[b]).variable_indices)
            (<_Bucket>self.buckets[b]).future = None
        self.next_bucket = 0
        self.has_marked_unused_parameters = False
        memset(self.ready, 0, self.n)
        memset(&self.used[0], 0, self.n * sizeof(int))
        self.local_used_map_reduced = False
        if self.static_graph and self.num_iterations > 1:
            memcpy(self.hook_counts_left, self.hook_counts, self.n * sizeof(int))
        if self._dynamic_graph_find_unused():
            self.search_unused_parameters(outputs)

    def search_unused_parameters(self, outputs):
        """See :meth:`distlab.reference.reducer.Reducer.search_unused_parameters`."""
        reachable = graph_leaves(list(outputs))
        self.unused_parameters = [i for i, p in enumerate(self.params) if p not in reachable]
        memcpy(&self.used[0], &self.used_no_sync[0], self.n * sizeof(int))
        memset(&self.used_no_sync[0], 0, self.n * sizeof(int))

    def autograd_hook(self, Py_ssize_t index):
        """See :meth:`distlab.reference.reducer.Reducer.autograd_hook`."""
        if not 0 <= index < self.n:
            raise IndexError(f"parameter index {index} out of range (the reducer has {self.n} parameters)")
        self._autograd_hook(index)

    cdef int _autograd_hook(self, Py_ssize_t index) except -1:
        if not self.expect_autograd_hooks:
            self.used_no_sync[index] = 1
            return 0
        if self._observe:
            self.stats.grad_arrived(index, self.param_names[index])
        if (not self.static_graph and self.find_unused_parameters) or self._static_first():
            if self.params[index].grad is not None:
                self.used[index] = 1
        if self._static_first():
            self.hook_counts[index] += 1
            if not self._finalize_queued:
                self._finalize_queued = True
                queue_callback(self.delay_all_reduce)
            return 0
        if not self.has_marked_unused_parameters:
            self.has_marked_unused_parameters = True
            for unused in self.unused_parameters:
                self._mark_variable_ready(unused)
        if self.static_graph:
            if self.hook_counts_left[index] <= 0:
                raise RuntimeError(support.static_graph_changed(self.param_names, index))
            self.hook_counts_left[index] -= 1
            if self.hook_counts_left[index] > 0:
                return 0
        if (self.static_graph or not self.find_unused_parameters) and not self.has_rebuilt_bucket:
            if self.n_rebuilt < self.n:  # a second arrival raises in _mark_variable_ready below
                self.rebuilt[self.n_rebuilt] = index
                self.n_rebuilt += 1
        self._mark_variable_ready(index)
        if self.next_bucket > 0:
            _comm.progress()
        return 0

    def mark_variable_ready(self, index):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready`."""
        self._mark_variable_ready(index)

    cdef int _mark_variable_ready(self, Py_ssize_t index) except -1:
        cdef Py_ssize_t b
        cdef _Bucket bucket
        if self.ready[index]:
            raise RuntimeError(support.marked_twice(self.param_names, index, self.static_graph,
                                                    self.find_unused_parameters))
        self.ready[index] = 1
        self.require_finalize = True
        if self.div_factor is None:
            self._set_divide_factor()
        b = self.loc_bucket[index]
        bucket = <_Bucket>self.buckets[b]
        if bucket.expect_sparse_gradient:
            self.mark_variable_ready_sparse(index, bucket)
        else:
            self._mark_dense(index, bucket, self.loc_pos[index])
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._mark_bucket_ready(b)
        if self.next_bucket == len(self.buckets) and not self._finalize_queued:
            self._finalize_queued = True
            if not self.static_graph and self.find_unused_parameters:
                self.all_reduce_local_used_map()
            queue_callback(self.finalize_backward)
        return 0

    def mark_variable_ready_dense(self, index, bucket, position):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready_dense`."""
        self._mark_dense(index, bucket, position)

    cdef int _mark_dense(self, Py_ssize_t index, _Bucket bucket, Py_ssize_t position) except -1:
        cdef double scale
        grad = _grad_of(self.params[index], self.slot_type[index])
        if grad is None:
            bucket.views_in[position][...] = 0
            return 0
        data = _data_of(grad)
        scale = 1.0 if self.comm_hook is not None else self._inv_div  # a hook divides by itself
        if self.kind[index] != KIND_OTHER:  # _scaled_copy checks the array itself
            if _scaled_copy(data, self.dst_ptr[index], self.dst_len[index], self.kind[index], scale):
                return 0
        # Slow path: device arrays, reduce dtypes, non-contiguous or wrong-dtype gradients.
        if type(data) is not _ndarray or data.dtype is not self._param_dtypes[index]:
            if isinstance(data, SparseGrad) or data.dtype != self._param_dtypes[index]:
                raise TypeError(support.grad_mismatch(self.param_names, index, self._param_dtypes[index], data))
        view = bucket.views_in[position]
        if data is view:
            if scale != 1.0:
                view *= scale
        elif scale == 1.0:
            view[...] = data
        else:
            np.multiply(data, scale, out=view, casting="unsafe")
        return 0

    def mark_variable_ready_sparse(self, index, bucket):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready_sparse`."""
        grad = self.params[index].grad
        if grad is None:
            shape = self.params[index].data.shape
            values = np.zeros((0,) + tuple(shape[1:]), dtype=self.params[index].data.dtype)
            grad = SparseGrad(np.zeros(0, dtype=np.int64), values, shape)
        elif not isinstance(grad, SparseGrad):
            raise TypeError(support.grad_mismatch(self.param_names, index, self.params[index].data.dtype,
                                                  grad.data))
        bucket.gradients = grad if self.comm_hook is not None else grad * (1.0 / self.div_factor)

    def mark_bucket_ready(self, bucket_index):
        """See :meth:`distlab.reference.reducer.Reducer.mark_bucket_ready`."""
        self._mark_bucket_ready(bucket_index)

    cdef int _mark_bucket_ready(self, Py_ssize_t bucket_index) except -1:
        cdef Py_ssize_t nbuckets = len(self.buckets)
        if bucket_index > self.next_bucket:
            return 0
        while self.next_bucket < nbuckets and self.pending[self.next_bucket] == 0:
            self.all_reduce_bucket(self.next_bucket)
            self.next_bucket += 1
        return 0

    def all_reduce_bucket(self, b):
        """See :meth:`distlab.reference.reducer.Reducer.all_reduce_bucket`."""
        cdef _Bucket bucket = self.buckets[b]
        if bucket.expect_sparse_gradient and self.comm_hook is None:
            bucket.future = sparse_allreduce(self.process_group, bucket.gradients, name=f"bucket{b}")
        elif self.comm_hook is None:
            bucket.future = self.process_group.allreduce(bucket.gradients, async_op=True,
                                                         name=f"bucket{b}").get_future()
        else:
            bucket.future = self.comm_hook(self.comm_hook_state, self._grad_bucket(b))
        nbytes = bucket.gradients.nbytes if not bucket.expect_sparse_gradient else 0
        self.stats.bucket_launched(b, nbytes, len(bucket.variable_indices), bucket.future)

    def all_reduce_local_used_map(self):
        """See :meth:`distlab.reference.reducer.Reducer.all_reduce_local_used_map`."""
        self.local_used_work = self.process_group.allreduce(self.local_used_map.copy(), async_op=True,
                                                            name="local_used_map")

    def delay_all_reduce(self):
        """See :meth:`distlab.reference.reducer.Reducer.delay_all_reduce`."""
        cdef Py_ssize_t index, b
        self.unused_parameters = [i for i in range(self.n) if self.hook_counts[i] == 0]
        self.require_finalize = True
        self._set_divide_factor()
        for index in range(self.n):
            bucket = self.buckets[self.loc_bucket[index]]
            if bucket.expect_sparse_gradient:
                self.mark_variable_ready_sparse(index, bucket)
            else:
                self._mark_dense(index, bucket, self.loc_pos[index])
        self.all_reduce_local_used_map()
        for b in range(len(self.buckets)):
            self.all_reduce_bucket(b)
        self.next_bucket = len(self.buckets)
        self.finalize_backward()

    def finalize_backward(self):
        """See :meth:`distlab.reference.reducer.Reducer.finalize_backward`."""
        cdef _Bucket bucket
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self._finalize_queued = False
        for b in range(len(self.buckets)):
            bucket = self.buckets[b]
            result = bucket.future.wait()
            if bucket.expect_sparse_gradient:
                self.params[bucket.variable_indices[0]].grad = result
                continue
            if result is not bucket.gradients:
                bucket.views_out = [result[o:o + n].reshape(s)
                                    for o, n, s in zip(bucket.offsets, bucket.lengths, bucket.sizes)]
            self.finalize_bucket_dense(bucket)
            bucket.views_out = bucket.views_in
        self.div_factor = None
        if self._static_first():
            memcpy(self.hook_counts_left, self.hook_counts, self.n * sizeof(int))
        self.stats.end_iteration()

    def finalize_bucket_dense(self, bucket):
        """See :meth:`distlab.reference.reducer.Reducer.finalize_bucket_dense`."""
        cdef _Bucket bk = bucket
        cdef Py_ssize_t position, index
        cdef bint check_unused = self.static_graph or self.find_unused_parameters
        views_in, views_out = bk.views_in, bk.views_out
        for position in range(len(bk.variable_indices)):
            index = bk.variable_indices[position]
            if check_unused and self._globally_unused(index):
                continue
            view_in, view_out = views_in[position], views_out[position]
            param = self.params[index]
            grad = _grad_of(param, self.slot_type[index])
            data = _data_of(grad) if grad is not None else None
            if self.gradient_as_bucket_view:
                if view_out is not view_in:
                    view_in[...] = view_out
                if data is not view_in:
                    param.grad = Tensor._wrap(view_in)
            elif grad is None:
                param.grad = Tensor._wrap(view_out.astype(param.data.dtype, copy=True))
            elif view_out is view_in and self.kind[index] != KIND_OTHER:
                _copy_from_view(data, self.dst_ptr[index], self.dst_len[index], self.kind[index], view_out)
            else:
                _copy_into(data, view_out)

    cdef bint _globally_unused(self, Py_ssize_t index) except -1:
        if self.used[index]:
            return False
        if not self.local_used_map_reduced:
            self.local_used_map[:] = self.local_used_work.result()
            self.local_used_map_reduced = True
        return not self.used[index]

    # -- rebuild, static graph, hooks, join -------------------------------------------------------------------
    def rebuild_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer.rebuild_buckets`."""
        self.ensure_prior_reduction_finished()
        if not ((self.static_graph or not self.find_unused_parameters) and not self.has_rebuilt_bucket) \
                or not self.rebuilt_param_indices:
            return False
        order = self.rebuilt_param_indices
        if self.static_graph:
            order = order + [i for i in self.unused_parameters if i not in order]
        if sorted(order) != list(range(self.n)):
            return False
        tensors = [self.params[i] for i in order]
        indices, _limits = compute_bucket_assignment_by_size(
            tensors, [self.first_bucket_bytes_cap, self.bucket_bytes_cap], self.expect_sparse_gradients, order)
        indices = self.process_group.broadcast_object(indices, src=0, name="rebuild_buckets")
        self.has_rebuilt_bucket = True
        self.rebuilt_param_indices = []
        self.initialize_buckets(indices)
        return True

    def ensure_prior_reduction_finished(self):
        """See :meth:`distlab.reference.reducer.Reducer.ensure_prior_reduction_finished`."""
        if self.require_finalize:
            unmarked = [i for i in range(self.n) if not self.ready[i]]
            raise RuntimeError(support.prior_reduction_unfinished(
                self.process_group.rank, self.param_names, unmarked, self.static_graph, self.find_unused_parameters))

    def set_static_graph(self):
        """See :meth:`distlab.reference.reducer.Reducer.set_static_graph`."""
        if self.num_iterations != 0:
            raise RuntimeError("set_static_graph() must be called before the first iteration (before the first "
                               "forward pass), right after DistributedDataParallel is constructed")
        self.static_graph = True

    def register_comm_hook(self, state, hook):
        """See :meth:`distlab.reference.reducer.Reducer.register_comm_hook`."""
        if not callable(hook):
            raise TypeError(f"the communication hook must be callable, got {type(hook).__name__}")
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once: a communication hook is already "
                               f"registered ({getattr(self.comm_hook, '__name__', self.comm_hook)!r})")
        self.comm_hook, self.comm_hook_state = hook, state

    def set_forward_pass_work_handle(self, work, use_static_world_size):
        """See :meth:`distlab.reference.reducer.Reducer.set_forward_pass_work_handle`."""
        self.forward_work, self.forward_work_static_world = work, bool(use_static_world_size)

    def _set_divide_factor(self):
        if self.div_factor is not None:
            return
        self.div_factor = self.process_group.size
        if self.forward_work is not None and not self.forward_work_static_world:
            self.div_factor = int(self.forward_work.result()[0])
        self.forward_work = None
        self._inv_div = 1.0 / self.div_factor

    cdef inline bint _static_first(self):
        return self.static_graph and self.num_iterations == 1

    def _dynamic_graph_find_unused(self):
        return not self.static_graph and self.find_unused_parameters

    # -- Join: what a rank that ran out of inputs needs to shadow an iteration (DDP's join hook) ---------------
    def _get_zeros_like_grad_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer._get_zeros_like_grad_buckets`."""
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
        """See :meth:`distlab.reference.reducer.Reducer._run_comm_hook`."""
        b = grad_bucket.index()
        if self.comm_hook is not None:
            return self.comm_hook(self.comm_hook_state, grad_bucket)
        if isinstance(grad_bucket.buffer(), SparseGrad):
            return sparse_allreduce(self.process_group, grad_bucket.buffer(), name=f"bucket{b}")
        return self.process_group.allreduce(grad_bucket.buffer(), async_op=True, name=f"bucket{b}").get_future()

    def _get_local_used_map(self):
        """See :meth:`distlab.reference.reducer.Reducer._get_local_used_map`."""
        return np.zeros(self.n, dtype=np.int32)

    def _push_all_rebuilt_params(self):
        """See :meth:`distlab.reference.reducer.Reducer._push_all_rebuilt_params`."""
        if (self.static_graph or not self.find_unused_parameters) and not self.has_rebuilt_bucket:
            self.rebuilt_param_indices = list(range(len(self.params)))

    def get_logging_data(self):
        """See :meth:`distlab.reference.reducer.Reducer.get_logging_data`."""
        return self.stats.logging_data({
            "world_size": self.process_group.size, "num_parameters": self.n,
            "bucket_sizes": [b.gradients.nbytes if b.gradients is not None else 0 for b in self.buckets],
            "bucket_indices": [list(b.variable_indices) for b in self.buckets],
            "has_rebuilt_buckets": self.has_rebuilt_bucket, "num_iterations": self.num_iterations,
            "find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "bucket_cap_bytes": self.bucket_bytes_cap, "first_bucket_cap_bytes": self.first_bucket_bytes_cap,
            "comm_hook": None if self.comm_hook is None else getattr(self.comm_hook, "__name__", repr(self.comm_hook)),
            "impl": "core"})

    def remove_hooks(self):
        """See :meth:`distlab.reference.reducer.Reducer.remove_hooks`."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
