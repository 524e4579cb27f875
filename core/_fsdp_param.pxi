# Included by _fsdp_param_group.pyx: the core twin of reference/fsdp_param.py (read it for the explanation).
# The parameter's sizes are C integers and its state a C int; construction is the shared prepare_param's set-up,
# kept field by field (PARAM_STATE of distlab._common.fsdp_param), and the state dicts are shared functions.


@cython.final
cdef class FSDPParam:
    """See :class:`distlab.reference.fsdp_param.FSDPParam`."""
    cdef public object xp, module_info, fqn, orig_size, orig_dtype, param_class, sharded_size, sharded_param
    cdef public object sharded_param_data, all_gather_output, unsharded_accumulated_grad, shard_group
    cdef public object param_dtype, reduce_dtype, unsharded_dtype
    cdef public Py_ssize_t rows, row_numel, shard_size, shard_rank, chunk, shard_offset, shard_length
    cdef public Py_ssize_t padded_sharded_numel, sharded_numel, unsharded_numel
    cdef public Py_ssize_t post_forward_size, post_forward_rank, post_forward_numel
    cdef public int sharded_state
    cdef object _unsharded_param, _sharded_post_forward_param_data
    cdef long long _storage_generation, _unsharded_generation
    cdef dict __dict__

    def __init__(self, param, module_info, Py_ssize_t shard_size, Py_ssize_t shard_rank,
                 Py_ssize_t post_forward_size, mp_policy, fqn=""):
        """See :class:`distlab.reference.fsdp_param.FSDPParam`."""
        (self.xp, self.module_info, self.fqn, self.orig_size, self.orig_dtype, self.param_class, self.rows,
         self.row_numel, self.shard_size, self.shard_rank, self.chunk, self.shard_offset, self.shard_length,
         self.padded_sharded_numel, self.sharded_numel, self.unsharded_numel, self.sharded_size,
         self.post_forward_size, self.post_forward_rank, self.post_forward_numel, self.param_dtype,
         self.reduce_dtype, self.unsharded_dtype, self.sharded_param_data, self.sharded_param,
         self.sharded_state) = prepare_param(param, module_info, shard_size, shard_rank, post_forward_size,
                                             mp_policy, fqn)
        self._storage_generation, self._unsharded_generation = -1, -2
        self.sharded_param._fsdp_param = self
        self._setattr_on_modules(self.sharded_param)

    cpdef object all_gather_input(self):
        """See :meth:`distlab.reference.fsdp_param.FSDPParam.all_gather_input`."""
        return (self._sharded_post_forward_param_data if self.sharded_state == _SHARDED_POST_FORWARD
                else self.sharded_param_data)

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
            place[0].register_parameter(place[1], param)

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
        cdef object rows = flat.reshape(self.sharded_size)
        cdef object held = param.grad
        if held is not None:
            accumulated = held.data
            accumulated += rows
        else:
            param.grad = Tensor(rows)
        run_post_accumulate_grad_hooks(param)
