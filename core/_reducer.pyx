# cython: language_level=3
"""Core twin of the DDP reducer, :mod:`distlab.reference.reducer` (read it for the explanation).

Only the per-gradient, per-bucket and per-iteration path is compiled here; construction, the one-time rebuild,
registration, Join support and error messages are the shared :class:`distlab._common.reducer.ReducerBase`
functions, bound to this class. What differs from the reference: the per-parameter bookkeeping (locators, ready
flags, hook counts, used maps, pending counts, the arrival order) lives in C arrays, each parameter's hook is a
small C-level callable, a parameter's ``grad`` and its ``data`` are read from Tensor's slots, and a
float32/float64 gradient is copied and scaled into its bucket by a C loop over the array's memory, found through
numpy's C API (no numpy call, no buffer export, no temporary).
"""
cimport cython
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

from distlab.comm import progress as _progress
from distlab._common.reducer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    ReducerBase,
    check_hook_result,
    grad_mismatch,
    grad_shape_mismatch,
    marked_twice,
    sparse_allreduce,
    static_graph_changed,
)
from distlab.autograd import SparseGrad, Tensor, queue_callback

__all__ = ["Reducer"]

# Element kinds the C copy loop handles, and their sizes (checked against numpy's at import).
cdef enum:
    KIND_OTHER = 0
    KIND_F32 = 1
    KIND_F64 = 2

assert sizeof(float) == np.dtype(np.float32).itemsize and sizeof(double) == np.dtype(np.float64).itemsize, \
    "the reducer's C copy loop needs IEEE float32/float64 C types"


@cython.final
cdef class Reducer:
    """See :class:`distlab.reference.reducer.Reducer`."""
    # State shared with ReducerBase (Python attributes there, typed here).
    cdef public list params, param_names, expect_sparse_gradients, buckets, unused_parameters, hook_handles
    cdef public object process_group, reduce_dtype, comm_hook, comm_hook_state, local_used_map, used_during_no_sync
    cdef public object local_used_work, div_factor, forward_work, stats
    cdef public long long bucket_bytes_cap, first_bucket_bytes_cap, num_iterations
    cdef public bint find_unused_parameters, gradient_as_bucket_view, static_graph, expect_autograd_hooks
    cdef public bint require_finalize, has_rebuilt_bucket, has_marked_unused_parameters, local_used_map_reduced
    cdef public bint forward_work_static_world, _finalize_queued, auto_bucket_cap
    cdef public object auto_choice
    cdef public Py_ssize_t next_bucket
    # Per parameter (n entries).
    cdef Py_ssize_t n
    cdef int* loc_bucket
    cdef int* loc_pos
    cdef char* ready
    cdef int* _hook_counts
    cdef int* _hook_counts_left
    cdef int* rebuilt  # rebuilt_param_indices: the arrival order until the rebuild
    cdef Py_ssize_t n_rebuilt
    cdef char** dst_ptr  # where the parameter's view starts in its bucket (KIND_F32/F64 only)
    cdef Py_ssize_t* dst_len
    cdef int* kind
    cdef void** slot_type  # params[i]'s class if its grad may be read from Tensor's slot, else NULL
    cdef int[::1] used
    cdef int[::1] used_no_sync
    cdef list _slot_types, _param_dtypes
    # Per bucket.
    cdef Py_ssize_t nbuckets
    cdef int* pending
    cdef int* bucket_params
    cdef char* bucket_sparse
    cdef char* bucket_arena  # the bucket lives in a shared-memory arena (see ReducerBase._reduction_divides)
    cdef list _bucket_names
    cdef double _inv_div  # 1 / div_factor, for the div_factor object in _inv_of
    cdef object _inv_of
    cdef bint _observe  # sampling runtime stats or recording a timeline: only then call into the stats object

    IMPL = "core"
    # ReducerBase's methods (construction, once-per-iteration steps, rebuild, registration, Join), bound here in
    # its order (tests/test_api_parity.py fails if one is missing). No lock, as in the reference: hooks run on the
    # thread that runs backward, one pass at a time.
    _configure = ReducerBase._configure
    _build_buckets = ReducerBase._build_buckets
    get_grad_buckets = ReducerBase.get_grad_buckets
    _grad_bucket = ReducerBase._grad_bucket
    prepare_for_forward = ReducerBase.prepare_for_forward
    search_unused_parameters = ReducerBase.search_unused_parameters
    _mark_unused_parameters_ready = ReducerBase._mark_unused_parameters_ready
    _queue_finalize_backward = ReducerBase._queue_finalize_backward
    mark_variable_ready_sparse = ReducerBase.mark_variable_ready_sparse
    _reduction_divides = ReducerBase._reduction_divides
    _allreduce_dense = ReducerBase._allreduce_dense
    all_reduce_local_used_map = ReducerBase.all_reduce_local_used_map
    _read_reduced_used_map = ReducerBase._read_reduced_used_map
    delay_all_reduce = ReducerBase.delay_all_reduce
    finalize_backward = ReducerBase.finalize_backward
    _set_divide_factor = ReducerBase._set_divide_factor
    rebuild_buckets = ReducerBase.rebuild_buckets
    _choose_bucket_caps = ReducerBase._choose_bucket_caps
    ensure_prior_reduction_finished = ReducerBase.ensure_prior_reduction_finished
    set_static_graph = ReducerBase.set_static_graph
    register_comm_hook = ReducerBase.register_comm_hook
    set_forward_pass_work_handle = ReducerBase.set_forward_pass_work_handle
    get_logging_data = ReducerBase.get_logging_data
    remove_hooks = ReducerBase.remove_hooks
    _get_zeros_like_grad_buckets = ReducerBase._get_zeros_like_grad_buckets
    _run_comm_hook = ReducerBase._run_comm_hook
    _get_local_used_map = ReducerBase._get_local_used_map
    _push_all_rebuilt_params = ReducerBase._push_all_rebuilt_params

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=DEFAULT_BUCKET_BYTES, find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=DEFAULT_FIRST_BUCKET_BYTES, reduce_dtype=None):
        """See :class:`distlab.reference.reducer.Reducer`."""
        self._configure(params, bucket_indices, process_group, expect_sparse_gradients, bucket_bytes_cap,
                        find_unused_parameters, gradient_as_bucket_view, param_names, first_bucket_bytes_cap,
                        reduce_dtype)

    def _init_per_parameter_state(self):
        """See :meth:`distlab.reference.reducer.Reducer._init_per_parameter_state`."""
        cdef Py_ssize_t i
        self._allocate(len(self.params))
        self.used = self.local_used_map
        self.used_no_sync = self.used_during_no_sync
        self._param_dtypes = [p.data.dtype for p in self.params]
        self._slot_types = [type(p) for p in self.params]
        for i in range(self.n):
            if _reads_tensor_slots(self.params[i]):
                self.slot_type[i] = <void*>self._slot_types[i]

    def _make_hook(self, Py_ssize_t index):
        """See :meth:`distlab.reference.reducer.Reducer._make_hook`."""
        return _Hook(self, index)

    def initialize_buckets(self, bucket_indices):
        """See :meth:`distlab.reference.reducer.Reducer.initialize_buckets`."""
        cdef Py_ssize_t b, position
        buckets = self._build_buckets(bucket_indices)
        self._allocate_buckets(len(buckets))
        self.buckets = buckets
        self._bucket_names = [f"bucket{b}" for b in range(self.nbuckets)]
        for b in range(self.nbuckets):
            bucket = buckets[b]
            self.bucket_params[b] = len(bucket.variable_indices)
            self.bucket_sparse[b] = bucket.expect_sparse_gradient
            self.bucket_arena[b] = bucket.arena is not None
            for position in range(self.bucket_params[b]):
                self._locate(bucket.variable_indices[position], b, position,
                             None if self.bucket_sparse[b] else bucket.views_in[position])
        self.next_bucket = 0

    # -- per iteration ----------------------------------------------------------------------------------------
    cpdef prepare_for_backward(self, outputs=()):
        """See :meth:`distlab.reference.reducer.Reducer.prepare_for_backward`."""
        cdef Py_ssize_t b
        self._observe = self.stats.sampling or self.stats.timeline.enabled
        if self._observe:
            self.stats.mark("backward_compute_start")
        self.expect_autograd_hooks = True
        self.n_rebuilt = 0
        memcpy(self.pending, self.bucket_params, self.nbuckets * sizeof(int))
        for bucket in self.buckets:
            bucket.future = None
        self.next_bucket = 0
        self.has_marked_unused_parameters = False
        memset(self.ready, 0, self.n)
        memset(&self.used[0], 0, self.n * sizeof(int))
        self.local_used_map_reduced = False
        if self.static_graph and self.num_iterations > 1:
            memcpy(self._hook_counts_left, self._hook_counts, self.n * sizeof(int))
        if self._dynamic_graph_find_unused():
            self.search_unused_parameters(outputs)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef autograd_hook(self, Py_ssize_t index):
        """See :meth:`distlab.reference.reducer.Reducer.autograd_hook`."""
        _check_index(index, self.n)
        if not self.expect_autograd_hooks:
            self.used_no_sync[index] = 1
            return
        if self._observe:
            self.stats.grad_arrived(index, self.param_names[index])
        if self._dynamic_graph_find_unused() or self._static_graph_first_iteration():
            if _grad_of(self.params[index], self.slot_type[index]) is not None:
                self.used[index] = 1
        if self._static_graph_first_iteration():
            self._hook_counts[index] += 1
            if not self._finalize_queued:
                self._finalize_queued = True
                queue_callback(self.delay_all_reduce)
            return
        if not self.has_marked_unused_parameters:
            self._mark_unused_parameters_ready()
        if self.static_graph:
            if self._hook_counts_left[index] <= 0:
                raise RuntimeError(static_graph_changed(self.param_names, index))
            self._hook_counts_left[index] -= 1
            if self._hook_counts_left[index] > 0:
                return
        if self._should_rebuild_buckets() and self.n_rebuilt < self.n:  # a repeat raises just below
            self.rebuilt[self.n_rebuilt] = <int>index
            self.n_rebuilt += 1
        self.mark_variable_ready(index)
        if self.next_bucket > 0:
            _progress()

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef mark_variable_ready(self, Py_ssize_t index):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready`."""
        cdef Py_ssize_t b
        _check_index(index, self.n)
        if self.ready[index]:
            raise RuntimeError(marked_twice(self.param_names, index, self.static_graph, self.find_unused_parameters))
        self.ready[index] = 1
        self.require_finalize = True
        if self.div_factor is None:
            self._set_divide_factor()
        b = self.loc_bucket[index]
        if self.bucket_sparse[b]:
            self.mark_variable_ready_sparse(index, self.buckets[b])
        elif not self._copy_into_view(index):  # the C copy needs no bucket object; anything else does
            self.mark_variable_ready_dense(index, self.buckets[b], self.loc_pos[index])
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.mark_bucket_ready(b)
        if self.next_bucket == self.nbuckets and not self._finalize_queued:
            self._queue_finalize_backward()

    cpdef mark_variable_ready_dense(self, Py_ssize_t index, bucket, Py_ssize_t position):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready_dense`."""
        cdef double scale
        _check_index(index, self.n)
        if self._copy_into_view(index):
            return
        # Device arrays, reduce dtypes, non-contiguous or foreign gradients: numpy does the (casting) copy.
        grad = _grad_of(self.params[index], self.slot_type[index])
        view = bucket.views_in[position]
        if grad is None:
            view[...] = 0
            return
        data = _data_of(grad)
        if isinstance(data, SparseGrad) or data.dtype != self._param_dtypes[index]:
            raise TypeError(grad_mismatch(self.param_names, index, self._param_dtypes[index], data))
        if data.shape != view.shape:
            raise ValueError(grad_shape_mismatch(self.param_names, index, view.shape, data.shape))
        scale = self._scale_into_bucket(self.loc_bucket[index])
        if data is view:
            if scale != 1.0:
                view *= scale
        elif scale == 1.0:
            view[...] = data
        else:
            np.multiply(data, scale, out=view, casting="unsafe")

    cpdef mark_bucket_ready(self, Py_ssize_t bucket_index):
        """See :meth:`distlab.reference.reducer.Reducer.mark_bucket_ready`."""
        if bucket_index > self.next_bucket:
            return
        while self.next_bucket < self.nbuckets and self.pending[self.next_bucket] == 0:
            self.all_reduce_bucket(self.next_bucket)
            self.next_bucket += 1

    cpdef all_reduce_bucket(self, Py_ssize_t b):
        """See :meth:`distlab.reference.reducer.Reducer.all_reduce_bucket`."""
        _check_index(b, self.nbuckets)
        bucket = self.buckets[b]
        if self.comm_hook is not None:
            future = check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state, self._grad_bucket(b)))
        elif self.bucket_sparse[b]:
            future = sparse_allreduce(self.process_group, bucket.gradients, name=self._bucket_names[b])
        else:
            future = self._allreduce_dense(bucket, bucket.gradients, self._bucket_names[b])
        bucket.future = future
        if self._observe:
            self.stats.bucket_launched(b, bucket.nbytes(), self.bucket_params[b], future)

    cpdef finalize_bucket_dense(self, bucket):
        """See :meth:`distlab.reference.reducer.Reducer.finalize_bucket_dense`."""
        cdef list indices = bucket.variable_indices
        cdef list views_in = bucket.views_in
        cdef list views_out = bucket.views_out
        cdef bint in_place = views_out is views_in
        cdef bint check_unused = self.static_graph or self.find_unused_parameters
        cdef Py_ssize_t position, index
        for position in range(len(indices)):
            index = indices[position]
            if check_unused and self._globally_unused(index):
                continue
            param = self.params[index]
            grad = _grad_of(param, self.slot_type[index])
            data = _data_of(grad) if grad is not None else None
            if self.gradient_as_bucket_view:
                if not in_place:
                    _copy_into(views_in[position], views_out[position])
                if data is not views_in[position]:
                    param.grad = Tensor._wrap(views_in[position])
            elif grad is None:
                param.grad = Tensor._wrap(views_out[position].astype(self._param_dtypes[index], copy=True))
            elif in_place and self.kind[index] != KIND_OTHER:
                _copy_from_view(data, self.dst_ptr[index], self.dst_len[index], self.kind[index], views_in[position])
            else:
                _copy_into(data, views_out[position])

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef bint _globally_unused(self, Py_ssize_t index) except -1:
        if self.used[index]:
            return False
        self._read_reduced_used_map()
        return not self.used[index]

    # -- predicates -------------------------------------------------------------------------------------------
    cpdef bint _should_rebuild_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer._should_rebuild_buckets`."""
        return ((self.static_graph or not self.find_unused_parameters or self.auto_bucket_cap)
                and not self.has_rebuilt_bucket)

    cdef inline bint _dynamic_graph_find_unused(self):
        return self.find_unused_parameters and not self.static_graph

    cdef inline bint _static_graph_first_iteration(self):
        return self.static_graph and self.num_iterations == 1

    def _unmarked_parameters(self):
        """See :meth:`distlab.reference.reducer.Reducer._unmarked_parameters`."""
        return [i for i in range(self.n) if not self.ready[i]]

    # --- core-only helpers ---------------------------------------------------------------------------------
    cdef inline bint _copy_into_view(self, Py_ssize_t index) except -1:
        """``mark_variable_ready_dense`` by C: zeros or ``grad * scale`` into a float32/float64 host view; False
        (nothing done) when the view or the gradient does not qualify."""
        cdef int kind = self.kind[index]
        if kind == KIND_OTHER:
            return False
        grad = _grad_of(self.params[index], self.slot_type[index])
        if grad is None:
            memset(self.dst_ptr[index], 0, self.dst_len[index] * _itemsize(kind))
            return True
        return _scaled_copy(_data_of(grad), self.dst_ptr[index], self.dst_len[index], kind,
                            self._scale_into_bucket(self.loc_bucket[index]))

    cdef inline double _scale_into_bucket(self, Py_ssize_t b) except? -1.0:
        """See :meth:`distlab.reference.reducer.Reducer._scale_into_bucket`."""
        if self.comm_hook is not None or (self.gradient_as_bucket_view and self.bucket_arena[b]
                                          and self.forward_work_static_world):
            return 1.0
        return self._inverse_divide_factor()

    cdef inline double _inverse_divide_factor(self) except? -1.0:
        """``1 / div_factor``, recomputed only when ReducerBase._set_divide_factor set a new factor."""
        if self._inv_of is not self.div_factor:
            self._inv_div = 1.0 / <double>self.div_factor
            self._inv_of = self.div_factor
        return self._inv_div

    @property
    def hook_counts(self):
        """Hooks counted per parameter in the first static-graph iteration (a C array here; a list in the reference)."""
        return [self._hook_counts[i] for i in range(self.n)]

    @property
    def rebuilt_param_indices(self):
        """The gradient arrival order recorded for the rebuild (a C array here; a list in the reference)."""
        return [self.rebuilt[k] for k in range(self.n_rebuilt)]

    @rebuilt_param_indices.setter
    def rebuilt_param_indices(self, indices):
        indices = list(indices)
        if len(indices) > self.n:
            raise ValueError(f"{len(indices)} rebuilt parameter indices for {self.n} parameters")
        for k, i in enumerate(indices):
            self.rebuilt[k] = i
        self.n_rebuilt = len(indices)

    def __cinit__(self, *args, **kwargs):
        self.n = self.nbuckets = self.n_rebuilt = 0
        self.loc_bucket = self.loc_pos = self._hook_counts = self._hook_counts_left = self.rebuilt = NULL
        self.pending = self.bucket_params = self.kind = NULL
        self.ready = self.bucket_sparse = self.bucket_arena = NULL
        self.dst_ptr = NULL
        self.dst_len = NULL
        self.slot_type = NULL

    def __dealloc__(self):
        free(self.loc_bucket); free(self.loc_pos); free(self.ready); free(self._hook_counts)
        free(self._hook_counts_left); free(self.rebuilt); free(self.dst_ptr); free(self.dst_len); free(self.kind)
        free(self.slot_type); free(self.pending); free(self.bucket_params); free(self.bucket_sparse)
        free(self.bucket_arena)

    cdef int _allocate(self, Py_ssize_t n) except -1:
        """The per-parameter C arrays, zeroed."""
        self.n = n
        self.loc_bucket = <int*>calloc(n, sizeof(int))
        self.loc_pos = <int*>calloc(n, sizeof(int))
        self.ready = <char*>calloc(n, sizeof(char))
        self._hook_counts = <int*>calloc(n, sizeof(int))
        self._hook_counts_left = <int*>calloc(n, sizeof(int))
        self.rebuilt = <int*>calloc(n, sizeof(int))
        self.dst_ptr = <char**>calloc(n, sizeof(char*))
        self.dst_len = <Py_ssize_t*>calloc(n, sizeof(Py_ssize_t))
        self.kind = <int*>calloc(n, sizeof(int))
        self.slot_type = <void**>calloc(n, sizeof(void*))
        if not (self.loc_bucket and self.loc_pos and self.ready and self._hook_counts and self._hook_counts_left
                and self.rebuilt and self.dst_ptr and self.dst_len and self.kind and self.slot_type):
            raise MemoryError()
        return 0

    cdef int _allocate_buckets(self, Py_ssize_t nbuckets) except -1:
        """The per-bucket C arrays for a new layout (the old one is dropped)."""
        free(self.pending); free(self.bucket_params); free(self.bucket_sparse); free(self.bucket_arena)
        self.nbuckets = nbuckets
        self.pending = <int*>calloc(max(nbuckets, 1), sizeof(int))
        self.bucket_params = <int*>calloc(max(nbuckets, 1), sizeof(int))
        self.bucket_sparse = <char*>calloc(max(nbuckets, 1), sizeof(char))
        self.bucket_arena = <char*>calloc(max(nbuckets, 1), sizeof(char))
        if not (self.pending and self.bucket_params and self.bucket_sparse and self.bucket_arena):
            raise MemoryError()
        return 0

    cdef int _locate(self, Py_ssize_t i, Py_ssize_t b, Py_ssize_t position, view) except -1:
        """Record parameter i's bucket and slot, and where its view starts if the C copy loop can write it."""
        self.loc_bucket[i] = <int>b
        self.loc_pos[i] = <int>position
        self.kind[i] = KIND_OTHER
        self.dst_ptr[i] = NULL
        self.dst_len[i] = 0
        if view is None:
            return 0  # a sparse bucket has no views
        if type(view) is not np.ndarray or view.dtype != self._param_dtypes[i]:
            return 0  # device memory or a reduce dtype: numpy does the (casting) copy
        if view.dtype == np.float32:
            self.kind[i] = KIND_F32
        elif view.dtype == np.float64:
            self.kind[i] = KIND_F64
        else:
            return 0
        self.dst_ptr[i] = <char*>cnp.PyArray_DATA(<cnp.ndarray>view)
        self.dst_len[i] = view.size
        return 0


include "_reducer.pxi"
