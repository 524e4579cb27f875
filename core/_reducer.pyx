# cython: language_level=3
"""Core twin of the DDP reducer, :mod:`distlab.reference.reducer` (read it for the explanation).

The class defines every method of the reducer, as the reference does (no base class, nothing bound by hand): the
per-gradient, per-bucket and per-iteration path compiled, the rest calling the functions of
:mod:`distlab._common.reducer` that the reference calls. What differs from the reference: the per-parameter
bookkeeping (locators, ready flags, hook counts, used maps, pending counts, the arrival order) lives in C arrays,
each parameter's hook is a small C-level callable, a parameter's ``grad`` and its ``data`` are read from Tensor's
slots, and a float32/float64 gradient is copied and scaled into its bucket by a C loop over the array's memory,
found through numpy's C API (no numpy call, no buffer export, no temporary).
"""
cimport cython
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

from distlab.comm import progress as _progress
from distlab._common.reducer import (DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, allreduce_bucket,
                                     check_hook_result, check_prior_reduction, declare_static_graph, divide_factor,
                                     finished_buckets, grad_bucket, grad_buckets, grad_mismatch, grad_shape_mismatch,
                                     logging_data, make_buckets, marked_twice, prepare_reducer, queue_finalize,
                                     rebuilt_layout, register_hooks, release_parameters, set_comm_hook,
                                     sparse_allreduce, sparse_bucket_gradient, static_graph_changed,
                                     unreachable_parameters, zeros_like_grad_buckets)
from distlab.autograd import SparseGrad, Tensor, queue_callback

__all__ = ["Reducer"]

ctypedef int* int_array
ctypedef char* flag_array
cdef enum:  # element kinds the C copy loop handles (their sizes are checked against numpy's at import)
    KIND_OTHER = 0
    KIND_F32 = 1
    KIND_F64 = 2


@cython.final
cdef class Reducer:
    """See :class:`distlab.reference.reducer.Reducer`."""
    # The reducer's state (REDUCER_STATE of distlab._common.reducer; Python attributes in the reference, typed here).
    cdef public list params, param_names, expect_sparse_gradients, buckets, unused_parameters, hook_handles
    cdef public object process_group, reduce_dtype, comm_hook, comm_hook_state, used_parameters
    cdef public object div_factor, forward_work, stats
    cdef public long long bucket_bytes_cap, first_bucket_bytes_cap, num_iterations
    cdef public bint find_unused_parameters, gradient_as_bucket_view, static_graph, expect_autograd_hooks
    cdef public bint require_finalize, has_rebuilt_bucket, has_marked_unused_parameters
    cdef public bint forward_work_static_world, auto_bucket_cap
    cdef public object auto_choice
    cdef public Py_ssize_t next_bucket
    cdef bint _finalize_queued
    # Per parameter (n entries; C arrays start NULL, as every C field of a new object is zero): its bucket and
    # position, ready flag, hook counts, the arrival order (rebuilt_param_indices, n_rebuilt of them until the
    # rebuild), where its view starts in its bucket and how long it is (dst_ptr, dst_len: KIND_F32/F64 only), its
    # kind, and its class if its grad may be read from Tensor's slot (else NULL).
    cdef Py_ssize_t n, n_rebuilt
    cdef int_array loc_bucket, loc_pos, _hook_counts, _hook_counts_left, rebuilt, kind
    cdef char* ready
    cdef char** dst_ptr
    cdef Py_ssize_t* dst_len
    cdef void** slot_type
    cdef int[::1] used  # used_parameters.local and .no_sync
    cdef int[::1] used_no_sync
    cdef list _slot_types, _param_dtypes
    # Per bucket: pending gradients, parameters, sparse, in a shared-memory arena (see _reduction_divides).
    cdef Py_ssize_t nbuckets
    cdef int_array pending, bucket_params
    cdef flag_array bucket_sparse, bucket_arena
    cdef list _bucket_names
    cdef double _inv_div  # 1 / div_factor, for the div_factor object in _inv_of
    cdef object _inv_of
    cdef bint _observe  # sampling runtime stats or recording a timeline: only then call into the stats object

    IMPL = "core"

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=DEFAULT_BUCKET_BYTES, find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=DEFAULT_FIRST_BUCKET_BYTES, reduce_dtype=None):
        """See :class:`distlab.reference.reducer.Reducer`."""
        setup = prepare_reducer(params, process_group, expect_sparse_gradients, bucket_bytes_cap,
                                find_unused_parameters, gradient_as_bucket_view, param_names,
                                first_bucket_bytes_cap, reduce_dtype)
        _adopt(self, setup)
        _allocate(self, len(self.params))  # the per-parameter bookkeeping, in C arrays
        self.initialize_buckets(bucket_indices)
        self.hook_handles = register_hooks(self.params, self._make_hook)

    def _make_hook(self, Py_ssize_t index):
        """See :meth:`distlab.reference.reducer.Reducer._make_hook`."""
        return _Hook(self, index)

    def initialize_buckets(self, bucket_indices):
        """See :meth:`distlab.reference.reducer.Reducer.initialize_buckets`."""
        cdef Py_ssize_t b, position
        buckets = make_buckets(self, bucket_indices)
        _allocate_buckets(self, len(buckets))
        self.buckets = buckets
        self._bucket_names = [f"bucket{b}" for b in range(self.nbuckets)]
        for b in range(self.nbuckets):
            bucket = buckets[b]
            self.bucket_params[b] = len(bucket.variable_indices)
            self.bucket_sparse[b] = bucket.expect_sparse_gradient
            self.bucket_arena[b] = bucket.arena is not None
            for position in range(self.bucket_params[b]):
                _locate(self, bucket.variable_indices[position], b, position,
                        None if self.bucket_sparse[b] else bucket.views_in[position])
        self.next_bucket = 0

    def get_grad_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer.get_grad_buckets`."""
        return grad_buckets(self.buckets, self.params)

    # -- per iteration ----------------------------------------------------------------------------------------
    cpdef prepare_for_forward(self):
        """See :meth:`distlab.reference.reducer.Reducer.prepare_for_forward`."""
        self.num_iterations += 1
        self.stats.start_iteration(self.num_iterations)

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
        self.used_parameters.reset()
        if self.static_graph and self.num_iterations > 1:
            memcpy(self._hook_counts_left, self._hook_counts, self.n * sizeof(int))
        if self._dynamic_graph_find_unused():
            self.search_unused_parameters(outputs)

    def search_unused_parameters(self, outputs):
        """See :meth:`distlab.reference.reducer.Reducer.search_unused_parameters`."""
        self.unused_parameters = unreachable_parameters(self.params, outputs)
        self.used_parameters.take_no_sync()

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

    cdef int _mark_unused_parameters_ready(self) except -1:
        """See :meth:`distlab.reference.reducer.Reducer._mark_unused_parameters_ready`."""
        cdef Py_ssize_t k
        self.has_marked_unused_parameters = True
        for k in range(len(self.unused_parameters)):
            self.mark_variable_ready(self.unused_parameters[k])
        return 0

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
        elif not _copy_into_view(self, index):  # the C copy needs no bucket object; anything else does
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
        if _copy_into_view(self, index):
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

    cpdef mark_variable_ready_sparse(self, Py_ssize_t index, bucket):
        """See :meth:`distlab.reference.reducer.Reducer.mark_variable_ready_sparse`."""
        bucket.gradients = sparse_bucket_gradient(self, index)

    cdef inline bint _reduction_divides(self, Py_ssize_t b):
        """See :meth:`distlab.reference.reducer.Reducer._reduction_divides` (bucket ``b``)."""
        return (self.gradient_as_bucket_view and self.bucket_arena[b] and self.comm_hook is None
                and self.forward_work_static_world)

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
            future = check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state,
                                                                      grad_bucket(self.buckets, b, self.params)))
        elif self.bucket_sparse[b]:
            future = sparse_allreduce(self.process_group, bucket.gradients, name=self._bucket_names[b])
        else:
            future = self._allreduce_dense(b, bucket.gradients, self._bucket_names[b])
        bucket.future = future
        if self._observe:
            self.stats.bucket_launched(b, bucket.nbytes(), self.bucket_params[b], future)

    cdef _allreduce_dense(self, Py_ssize_t b, gradients, str name):
        """See :meth:`distlab.reference.reducer.Reducer._allreduce_dense` (bucket ``b``)."""
        return allreduce_bucket(self.process_group, gradients, name, self._reduction_divides(b))

    cdef int _queue_finalize_backward(self) except -1:
        """See :meth:`distlab.reference.reducer.Reducer._queue_finalize_backward`."""
        self._finalize_queued = True
        queue_finalize(self)
        return 0

    def all_reduce_local_used_map(self):
        """See :meth:`distlab.reference.reducer.Reducer.all_reduce_local_used_map`."""
        self.used_parameters.start_sum(self.process_group)

    def delay_all_reduce(self):
        """See :meth:`distlab.reference.reducer.Reducer.delay_all_reduce`."""
        cdef Py_ssize_t b, position
        self.unused_parameters = [i for i in range(self.n) if self._hook_counts[i] == 0]
        self.require_finalize = True
        self._set_divide_factor()
        for b in range(self.nbuckets):
            bucket = self.buckets[b]
            for position in range(self.bucket_params[b]):
                if self.bucket_sparse[b]:
                    self.mark_variable_ready_sparse(bucket.variable_indices[position], bucket)
                else:
                    self.mark_variable_ready_dense(bucket.variable_indices[position], bucket, position)
        self.used_parameters.start_sum(self.process_group)  # all_reduce_local_used_map
        for b in range(self.nbuckets):
            self.all_reduce_bucket(b)
        self.next_bucket = self.nbuckets
        self.finalize_backward()

    def finalize_backward(self):
        """See :meth:`distlab.reference.reducer.Reducer.finalize_backward`."""
        self._finalize_queued = False
        for bucket in finished_buckets(self):
            self.finalize_bucket_dense(bucket)

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
                    param.grad = Tensor(views_in[position])
            elif grad is None:
                param.grad = Tensor(views_out[position].astype(self._param_dtypes[index], copy=True))
            elif in_place and self.kind[index] != KIND_OTHER:
                _copy_from_view(data, self.dst_ptr[index], self.dst_len[index], self.kind[index], views_in[position])
            else:
                _copy_into(data, views_out[position])

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef bint _globally_unused(self, Py_ssize_t index) except -1:
        return not self.used[index] and self.used_parameters.globally_unused(index)

    cdef int _set_divide_factor(self) except -1:
        """See :meth:`distlab.reference.reducer.Reducer._set_divide_factor`."""
        if self.div_factor is None:
            self.div_factor = divide_factor(self.process_group, self.forward_work, self.forward_work_static_world)
            self.forward_work = None
        return 0

    # -- the one-time rebuild ---------------------------------------------------------------------------------
    def rebuild_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer.rebuild_buckets`."""
        self.ensure_prior_reduction_finished()
        if not self._should_rebuild_buckets() or self.n_rebuilt == 0:
            return False
        indices = rebuilt_layout(self, self.rebuilt_param_indices)
        if indices is None:
            return False
        self.n_rebuilt = 0
        self.initialize_buckets(indices)
        return True

    def ensure_prior_reduction_finished(self):
        """See :meth:`distlab.reference.reducer.Reducer.ensure_prior_reduction_finished`."""
        check_prior_reduction(self, self._unmarked_parameters)

    # -- configuration ----------------------------------------------------------------------------------------
    def set_static_graph(self):
        """See :meth:`distlab.reference.reducer.Reducer.set_static_graph`."""
        declare_static_graph(self)

    def register_comm_hook(self, state, hook):
        """See :meth:`distlab.reference.reducer.Reducer.register_comm_hook`."""
        set_comm_hook(self, state, hook)

    def set_forward_pass_work_handle(self, work, use_static_world_size):
        """See :meth:`distlab.reference.reducer.Reducer.set_forward_pass_work_handle`."""
        self.forward_work, self.forward_work_static_world = work, use_static_world_size

    def get_logging_data(self):
        """See :meth:`distlab.reference.reducer.Reducer.get_logging_data`."""
        return logging_data(self, self.IMPL)

    def remove_hooks(self):
        """See :meth:`distlab.reference.reducer.Reducer.remove_hooks`."""
        release_parameters(self)

    # -- Join (see the reference) -----------------------------------------------------------------------------
    def _get_zeros_like_grad_buckets(self):
        """See :meth:`distlab.reference.reducer.Reducer._get_zeros_like_grad_buckets`."""
        return zeros_like_grad_buckets(self.buckets, self.params)

    def _run_comm_hook(self, grad_bucket):
        """See :meth:`distlab.reference.reducer.Reducer._run_comm_hook`."""
        cdef Py_ssize_t b = grad_bucket.index()
        _check_index(b, self.nbuckets)
        if self.comm_hook is not None:
            return check_hook_result(self.comm_hook, self.comm_hook(self.comm_hook_state, grad_bucket))
        if self.bucket_sparse[b]:
            return sparse_allreduce(self.process_group, grad_bucket.buffer(), name=self._bucket_names[b])
        return self._allreduce_dense(b, grad_bucket.buffer(), self._bucket_names[b])

    def _get_local_used_map(self):
        """See :meth:`distlab.reference.reducer.Reducer._get_local_used_map`."""
        return np.zeros(self.n, dtype=np.int32)

    def _push_all_rebuilt_params(self):
        """See :meth:`distlab.reference.reducer.Reducer._push_all_rebuilt_params`."""
        if self._should_rebuild_buckets():
            self.rebuilt_param_indices = range(self.n)

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
    cdef inline double _scale_into_bucket(self, Py_ssize_t b) except? -1.0:
        """See :meth:`distlab.reference.reducer.Reducer._scale_into_bucket` (bucket ``b``)."""
        if self.comm_hook is not None or self._reduction_divides(b):
            return 1.0
        if self._inv_of is not self.div_factor:  # 1 / div_factor, recomputed only for a new factor
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

    def __dealloc__(self):
        free(self.loc_bucket); free(self.loc_pos); free(self.ready); free(self._hook_counts)
        free(self._hook_counts_left); free(self.rebuilt); free(self.dst_ptr); free(self.dst_len); free(self.kind)
        free(self.slot_type); free(self.pending); free(self.bucket_params); free(self.bucket_sparse)
        free(self.bucket_arena)


include "_reducer.pxi"
