# Included at the end of _reducer.pyx: the reducer's C helpers (reading a Tensor's slots, the scaled copy
# loop), which only the core needs; the reference twin is reducer.py.
# --- core-only helpers ---
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        pass
    object PyMember_GetOne(const char* obj_addr, PyMemberDef* member)

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    void* Py_TYPE(object obj)


# -- the reducer's state, and its C arrays ---------------------------------------------------------------------
cdef int _adopt(Reducer self, setup) except -1:
    """Keep every field of the set-up (distlab._common.reducer.ReducerSetup), typed."""
    (self.params, self.process_group, self.expect_sparse_gradients, self.auto_bucket_cap, self.bucket_bytes_cap,
     self.first_bucket_bytes_cap, self.find_unused_parameters, self.gradient_as_bucket_view, self.param_names,
     self.reduce_dtype, self.stats, self.used_parameters, self.auto_choice,
     self.static_graph, self.comm_hook, self.comm_hook_state, self.num_iterations, self.expect_autograd_hooks,
     self.require_finalize, self.has_rebuilt_bucket, self.unused_parameters, self.has_marked_unused_parameters,
     self.div_factor, self.forward_work,
     self.forward_work_static_world) = setup
    return 0  # (and _finalize_queued is False, as every C field of a new object)


cdef int _allocate(Reducer self, Py_ssize_t n) except -1:
    """The per-parameter C arrays, zeroed, and what is known of each parameter."""
    cdef Py_ssize_t i
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
    self.used = self.used_parameters.local
    self.used_no_sync = self.used_parameters.no_sync
    self._param_dtypes = [p.data.dtype for p in self.params]
    self._slot_types = [type(p) for p in self.params]
    for i in range(n):
        if _reads_tensor_slots(self.params[i]):
            self.slot_type[i] = <void*>self._slot_types[i]
    return 0


cdef int _allocate_buckets(Reducer self, Py_ssize_t nbuckets) except -1:
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


cdef int _locate(Reducer self, Py_ssize_t i, Py_ssize_t b, Py_ssize_t position, view) except -1:
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

assert sizeof(float) == np.dtype(np.float32).itemsize and sizeof(double) == np.dtype(np.float64).itemsize, \
    "the reducer's C copy loop needs IEEE float32/float64 C types"


cdef inline size_t _itemsize(int kind):
    return sizeof(float) if kind == KIND_F32 else sizeof(double)


cdef inline int _check_index(Py_ssize_t index, Py_ssize_t count) except -1:
    if index < 0 or index >= count:
        raise IndexError(f"index {index} out of range (0..{count - 1})")
    return 0


cdef class _Hook:
    """A parameter's post-accumulate-grad hook: calls the reducer's C-level autograd_hook."""
    cdef Reducer reducer
    cdef Py_ssize_t index

    def __init__(self, Reducer reducer, Py_ssize_t index):
        self.reducer = reducer
        self.index = index

    def __call__(self, _param):
        self.reducer.autograd_hook(self.index)


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
cdef object _ndarray = np.ndarray


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


# -- copies -----------------------------------------------------------------------------------------------------
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


@cython.boundscheck(False)
@cython.wraparound(False)
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
            memcpy(dst, cnp.PyArray_DATA(<cnp.ndarray>data), count * _itemsize(kind))
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
            memcpy(dst, view, count * _itemsize(kind))
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
            if d.buf != s.buf:
                memcpy(d.buf, s.buf, d.len)
            PyBuffer_Release(&s)
            PyBuffer_Release(&d)
            return 0
        PyBuffer_Release(&s)
        PyBuffer_Release(&d)
    dst[...] = src
    return 0


cdef inline bint _copy_into_view(Reducer self, Py_ssize_t index) except -1:
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
