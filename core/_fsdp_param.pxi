# Included by _fsdp_param_group.pyx: the core twin of reference/fsdp_param.py (read it for the explanation).
# The parameter's sizes are C integers, its state a C int, and the module swap goes through the registry dict and
# the generic attribute setter; construction and state dicts are FSDPParamBase's, bound below.


@cython.final
cdef class FSDPParam:
    """See :class:`distlab.reference.fsdp_param.FSDPParam`."""
    cdef public object xp, module_info, fqn, orig_size, orig_dtype, param_class, sharded_param
    cdef public object _sharded_param_data, _unsharded_param, all_gather_output, _sharded_post_forward_param_data
    cdef public object unsharded_accumulated_grad, param_dtype, reduce_dtype, unsharded_dtype, shard_group
    cdef public Py_ssize_t rows, row_numel, shard_size, shard_rank, chunk, shard_offset, shard_length
    cdef public Py_ssize_t padded_sharded_numel, sharded_numel, unsharded_numel
    cdef public Py_ssize_t post_forward_size, post_forward_rank, post_forward_numel
    cdef public long long _storage_generation, _unsharded_generation
    cdef public int sharded_state
    cdef object _sharded_shape  # (shard rows,) + orig_size[1:], made once
    cdef dict __dict__

    # FSDPParamBase's construction and state-dict methods, bound here in its order.
    _init_sharded_param = FSDPParamBase._init_sharded_param
    _sharded_view = FSDPParamBase._sharded_view
    init_post_forward = FSDPParamBase.init_post_forward
    init_dtype_attrs = FSDPParamBase.init_dtype_attrs
    sharded_size = FSDPParamBase.sharded_size
    padded_sharded_size = FSDPParamBase.padded_sharded_size
    sharded_array = FSDPParamBase.sharded_array
    check_load = FSDPParamBase.check_load
    load = FSDPParamBase.load
    _check_sharded = FSDPParamBase._check_sharded
    _copy_into_shard = FSDPParamBase._copy_into_shard
    describe = FSDPParamBase.describe

    def __init__(self, param, module_info, Py_ssize_t shard_size, Py_ssize_t shard_rank,
                 Py_ssize_t post_forward_size, mp_policy, fqn=""):
        """See :class:`distlab.reference.fsdp_param.FSDPParam`."""
        FSDPParamBase._init_sharded_param(self, param, module_info, shard_size, shard_rank, post_forward_size,
                                          mp_policy, fqn)
        self._sharded_shape = (self.shard_length,) + tuple(self.orig_size[1:])
        self._setattr_on_modules(self.sharded_param)

    cpdef object all_gather_input(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.all_gather_input`."""
        return (self._sharded_post_forward_param_data if self.sharded_state == _SHARDED_POST_FORWARD
                else self._sharded_param_data)

    cpdef Py_ssize_t all_gather_input_numel(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.all_gather_input_numel`."""
        return self.post_forward_numel if self.sharded_state == _SHARDED_POST_FORWARD else self.padded_sharded_numel

    cpdef set_all_gather_output(self, view, long long generation):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.set_all_gather_output`."""
        self.all_gather_output, self._storage_generation = view, generation

    cpdef init_unsharded_param(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.init_unsharded_param`."""
        cdef object param = self._unsharded_param
        if param is not None and self._unsharded_generation == self._storage_generation:
            return  # made, and its storage is the same array: nothing to do (every step after the first)
        cdef object rows = self.all_gather_output[:self.rows * self.row_numel].reshape(self.orig_size)
        self._unsharded_generation = self._storage_generation
        if param is not None:
            param.data = rows
            return
        param = self.param_class(rows, requires_grad=self.sharded_param.requires_grad)
        param._fsdp_param = self
        self._unsharded_param = param

    @property
    def unsharded_param(self):
        """See :attr:`distlab.reference.fsdp_param.FSDPParam.unsharded_param`."""
        return self._unsharded_param

    cpdef unsharded_grad_data(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.unsharded_grad_data`."""
        cdef object param = self._unsharded_param
        cdef object grad = None if param is None else param.grad
        return None if grad is None else grad.data

    cpdef to_sharded(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.to_sharded`."""
        self._setattr_on_modules(self.sharded_param)
        self.sharded_state, self._sharded_post_forward_param_data = _SHARDED, None

    cpdef to_sharded_post_forward(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.to_sharded_post_forward`."""
        cdef Py_ssize_t start = self.post_forward_rank * self.post_forward_numel
        cdef Py_ssize_t stop = start + self.post_forward_numel
        self._sharded_post_forward_param_data = self.all_gather_output[start:stop].copy()  # the storage is freed next
        self._setattr_on_modules(self.sharded_param)
        self.sharded_state = _SHARDED_POST_FORWARD

    cpdef to_unsharded(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.to_unsharded`."""
        cdef object param = self._unsharded_param
        cdef bint wanted = self.sharded_param.requires_grad
        if param.requires_grad != wanted:
            param.requires_grad = wanted
        self._setattr_on_modules(param)
        self.sharded_state, self._sharded_post_forward_param_data = _UNSHARDED, None

    cpdef _setattr_on_modules(self, param):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam._setattr_on_modules`."""
        cdef tuple place
        for place in self.module_info.places:
            module = place[0]
            (<dict>module._parameters)[place[1]] = param
            PyObject_GenericSetAttr(module, place[1], param)

    cpdef to_accumulated_grad_if_needed(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.to_accumulated_grad_if_needed`."""
        cdef object held = self.unsharded_grad_data()
        if self.reduce_dtype is None or held is None or held.dtype == self.reduce_dtype:
            return
        self._unsharded_param.grad = None
        self.unsharded_accumulated_grad = held.astype(self.reduce_dtype)

    cpdef accumulate_unsharded_grad_if_needed(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.accumulate_unsharded_grad_if_needed`."""
        cdef object accumulated = self.unsharded_accumulated_grad
        cdef object fresh = None if accumulated is None else self.unsharded_grad_data()
        if fresh is None:
            return
        accumulated += fresh
        self._unsharded_param.grad = None

    cpdef take_unsharded_grad(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.take_unsharded_grad`."""
        cdef object taken = self.unsharded_accumulated_grad
        if taken is not None:
            self.unsharded_accumulated_grad = None
            return taken
        taken = self.unsharded_grad_data()
        if taken is not None:
            self._unsharded_param.grad = None
        return taken

    cpdef accumulate_sharded_grad(self, flat):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.accumulate_sharded_grad`."""
        cdef object param = self.sharded_param
        cdef object rows = flat.reshape(self._sharded_shape)
        cdef object held = param.grad
        if held is not None:
            accumulated = held.data
            accumulated += rows
        else:
            param.grad = Tensor._wrap(rows)
        cdef object hooks = param._post_acc_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                hook(param)
