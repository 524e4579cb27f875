# Included at the end of _reducer.pyx: the reducer's C helpers (reading a Tensor's slots, the scaled copy
# loop), which only the core needs; the reference twin is reducer.py.
# --- core-only helpers ---

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
