# cython: language_level=3
"""Core twin of FSDP's parameter group, :mod:`distlab.reference.fsdp_param_group` (read it, and
reference/fsdp_param.py and reference/fsdp_collectives.py, for the explanation).

One extension holds what the reference splits into three modules, laid out file for file: ``_fsdp_param.pxi``
(the sharded parameter) and ``_fsdp_collectives.pxi`` (copy-in, copy-out, the reduce-scatter's packing) are
included below, and this file holds the group. What is compiled: the per-parameter loops of every step, over
``cdef`` classes with C-typed sizes and states, and host copies by memcpy. Construction, the process groups and the
replay record are the shared :class:`distlab._common.fsdp_param.FSDPParamBase` and
:class:`distlab._common.fsdp_param_group.FSDPParamGroupBase` methods, bound to the classes.
"""
cimport cython
from cpython.object cimport PyObject_GenericSetAttr
from libc.string cimport memcpy, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

from distlab import comm as _comm
from distlab._common.fsdp import (
    FSDP_LANE, TWIN_NAMES, AllGatherResult, ShardedState, TrainingState, collective_name, gradient_divide_factors)
from distlab._common.fsdp_param import ParamModuleInfo, FSDPParamBase
from distlab._common.fsdp_param_group import MeshInfo, FSDPCommContext, FSDPParamGroupBase
from distlab.autograd import is_grad_enabled, Tensor
from distlab.autograd.node import Node as _Node
from distlab.timeline import now_us, get_timeline

__all__ = list(TWIN_NAMES)

# The states as C constants (asserted equal to the shared enums at import).
cdef enum:
    _SHARDED = 0
    _SHARDED_POST_FORWARD = 1
    _UNSHARDED = 2
    _IDLE = 0
    _FORWARD = 1
    _PRE_BACKWARD = 2
    _POST_BACKWARD = 3

assert (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD, ShardedState.UNSHARDED) == (
    _SHARDED, _SHARDED_POST_FORWARD, _UNSHARDED), "distlab.core._fsdp_param_group is out of date with _common.fsdp"
assert (TrainingState.IDLE, TrainingState.FORWARD, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD) == (
    _IDLE, _FORWARD, _PRE_BACKWARD, _POST_BACKWARD), "distlab.core._fsdp_param_group is out of date with _common.fsdp"

include "_fsdp_param.pxi"
include "_fsdp_collectives.pxi"


@cython.final
cdef class FSDPParamGroup:
    """See :class:`distlab.reference.fsdp_param_group.FSDPParamGroup`."""
    cdef public list fsdp_params, _post_forward_indices
    cdef public object modules, mesh_info, post_forward_group, mp_policy, _module_fqn, comm_ctx
    cdef public object _all_gather_result, _pending_reduce, _join_mask, gradient_divide_factor, storage
    cdef public object _orig_dtype, _reduce_dtype, xp, _storage_offsets
    cdef public double _compute_start
    cdef public int _training_state, _sharded_state
    cdef public Py_ssize_t _post_backward_pending
    cdef public bint reduce_grads, all_reduce_grads, reshard_after_backward, unshard_async_op
    cdef dict __dict__

    # FSDPParamGroupBase's construction, process groups and records, bound here in its order.
    _configure = FSDPParamGroupBase._configure
    lazy_init = FSDPParamGroupBase.lazy_init
    _cut_all_gather_outputs = FSDPParamGroupBase._cut_all_gather_outputs
    alloc_storage = FSDPParamGroupBase.alloc_storage
    _reshard_after_forward = FSDPParamGroupBase._reshard_after_forward
    _use_post_forward_mesh = FSDPParamGroupBase._use_post_forward_mesh
    _all_gather_process_group = FSDPParamGroupBase._all_gather_process_group
    _reduce_scatter_process_group = FSDPParamGroupBase._reduce_scatter_process_group
    _all_reduce_process_group = FSDPParamGroupBase._all_reduce_process_group
    is_sharded = FSDPParamGroupBase.is_sharded
    is_sharded_post_forward = FSDPParamGroupBase.is_sharded_post_forward
    is_unsharded = FSDPParamGroupBase.is_unsharded
    use_training_state = FSDPParamGroupBase.use_training_state
    _record = FSDPParamGroupBase._record
    _compute_begins = FSDPParamGroupBase._compute_begins
    _compute_ends = FSDPParamGroupBase._compute_ends
    _with_fqn = FSDPParamGroupBase._with_fqn
    describe = FSDPParamGroupBase.describe

    def __init__(self, list fsdp_params, modules, mesh_info, post_forward_group, mp_policy, str module_fqn=""):
        """See :class:`distlab.reference.fsdp_param_group.FSDPParamGroup`."""
        FSDPParamGroupBase._configure(self, fsdp_params, modules, mesh_info, post_forward_group, mp_policy,
                                      module_fqn)

    cpdef unshard(self, async_op=False):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.unshard`."""
        if self._all_gather_result is not None or self._sharded_state == _UNSHARDED:
            return
        self.lazy_init()
        cdef object over = (self.post_forward_group if self._sharded_state == _SHARDED_POST_FORWARD
                            else self.mesh_info.shard_group)
        if over.size == 1:  # nothing to gather: wait_for_unshard copies the shard
            self._all_gather_result = AllGatherResult(None, None, None, None, (), 1)
            return
        cdef FSDPParam first = self.fsdp_params[0]
        self._all_gather_result = foreach_all_gather(
            self.fsdp_params, over, async_op, self.comm_ctx.all_gather_pool, self.xp, first.unsharded_dtype,
            self._module_fqn)

    cpdef wait_for_unshard(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.wait_for_unshard`."""
        cdef object pending = self._all_gather_result
        if pending is None:
            return
        self.alloc_storage()
        cdef FSDPParam p
        if pending.world_size != 1:
            foreach_all_gather_copy_out(pending, self.fsdp_params, self.comm_ctx.all_gather_pool)
        else:
            for p in self.fsdp_params:
                shard = p.all_gather_input()
                p.all_gather_output[:shard.size] = shard
        self._all_gather_result = None
        for p in self.fsdp_params:
            p.init_unsharded_param()
        self._to_unsharded()

    cpdef reshard(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.reshard`."""
        cdef object keep = self.post_forward_group
        if self._training_state == _FORWARD and keep is not self.mesh_info.shard_group:
            if keep is not None:
                self._to_sharded_post_forward()
            return  # reshard_after_forward=False: kept unsharded until backward ends
        self._to_sharded()

    def pre_forward(self, module, args):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.pre_forward`."""
        _note(self, "pre_forward", None)
        self._training_state = _FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        args = self._register_post_backward_hook(args)
        self._compute_begins()
        return args

    def post_forward(self, module, input, output):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.post_forward`."""
        _note(self, "post_forward", None)
        self._compute_ends("forward")
        self.reshard()
        self._record_post_forward()
        self._training_state = _IDLE
        return output

    cpdef _record_post_forward(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._record_post_forward``."""
        cdef list order = self.comm_ctx.post_forward_order
        self._post_forward_indices.append(len(order))
        order.append(self)

    def pre_backward(self, default_prefetch):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.pre_backward`."""
        if self._training_state != _PRE_BACKWARD:
            _note(self, "pre_backward", default_prefetch)
            self._training_state = _PRE_BACKWARD
            self.unshard(self.unshard_async_op)
            gathering = self._all_gather_result
            if gathering is not None and gathering.all_gather_work is not None:
                gathering.all_gather_work.wait()
            in_flight = self.comm_ctx.reduce_scatter_state
            if in_flight is not None:
                free_reduce_input(in_flight)
            self.wait_for_unshard()
            if default_prefetch:
                self._backward_prefetch()
            _comm.progress()
            self._compute_begins()

    def post_backward(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.post_backward`."""
        _note(self, "post_backward", self._grad_mask())
        self._compute_ends("backward")
        self._training_state = _POST_BACKWARD
        cdef FSDPParam p
        for p in self.fsdp_params:
            p.accumulate_unsharded_grad_if_needed()
        cdef bint resharding = self.reshard_after_backward
        if not self.reduce_grads:  # accumulate without communication
            if resharding:
                self.reshard()
            for p in self.fsdp_params:
                p.to_accumulated_grad_if_needed()
            return
        cdef tuple taken = self._take_grads()
        if resharding:
            self.reshard()
        if not taken[0]:
            return
        cdef object ctx = self.comm_ctx
        cdef object in_flight = ctx.reduce_scatter_state
        if in_flight is not None:
            ctx.reduce_scatter_state = None
            wait_reduce_scatter(in_flight)
        self._wait_for_post_backward()
        cdef object info = self.mesh_info
        self._pending_reduce = foreach_reduce(
            taken[0], taken[1], info.shard_group, self._orig_dtype, self._reduce_dtype, self.xp,
            self.gradient_divide_factor, info.replicate_group, self.all_reduce_grads, self._module_fqn)
        ctx.reduce_scatter_state = self._pending_reduce
        _comm.progress()

    cpdef tuple _grad_mask(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._grad_mask``."""
        if self._join_mask is not None:
            return self._join_mask
        cdef FSDPParam p
        return tuple([p.unsharded_accumulated_grad is not None or p.unsharded_grad_data() is not None
                      for p in self.fsdp_params])

    cpdef tuple _take_grads(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._take_grads``."""
        cdef list params = [], grads = []
        cdef FSDPParam p
        cdef Py_ssize_t i
        cdef object mask = self._join_mask
        for i, p in enumerate(self.fsdp_params):
            if mask is None:
                grad = p.take_unsharded_grad()
            elif mask[i]:  # a joined rank: zeros where the ranks still training reduce a gradient
                grad = self.xp.zeros(p.orig_size, dtype=p.unsharded_dtype)
            else:
                grad = None
            if grad is not None:
                params.append(p)
                grads.append(grad)
        return params, grads

    cpdef finalize_backward(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.finalize_backward`."""
        _note(self, "finalize", None)
        self._wait_for_post_backward()
        cdef object unused = self._all_gather_result
        self._all_gather_result = None
        del self._post_forward_indices[:]
        if unused is None:
            return
        if unused.all_gather_work is not None:  # a prefetch never waited for: complete it
            unused.all_gather_work.wait()
        if unused.world_size != 1:
            self.comm_ctx.all_gather_pool.give_back(unused.all_gather_input)
            self.comm_ctx.all_gather_pool.give_back(unused.flat_output)

    cpdef _wait_for_post_backward(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._wait_for_post_backward``."""
        cdef object pending = self._pending_reduce
        if pending is not None:
            if self.comm_ctx.reduce_scatter_state is pending:
                self.comm_ctx.reduce_scatter_state = None
            self._pending_reduce = None
            finish_reduce(pending)

    cpdef _backward_prefetch(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._backward_prefetch``."""
        cdef list indices = self._post_forward_indices
        cdef Py_ssize_t target = indices.pop() - 1 if indices else -1
        if target >= 0:
            FSDPParamGroup._prefetch_unshard(self.comm_ctx.post_forward_order[target], "backward")
        else:  # nothing follows in this backward: the pool's idle buffers are freed
            self.comm_ctx.all_gather_pool.clear()

    @staticmethod
    def _prefetch_unshard(target, pass_type):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._prefetch_unshard``."""
        cdef FSDPParamGroup group = target
        _note(group, "prefetch", pass_type)
        cdef int previous = group._training_state
        group._training_state = _PRE_BACKWARD if pass_type == "backward" else _FORWARD
        try:
            group.unshard(True)
        finally:
            group._training_state = previous

    cpdef _to_sharded(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_sharded``."""
        cdef FSDPParam p
        if self._sharded_state == _SHARDED:
            return
        for p in self.fsdp_params:
            p.to_sharded()
        self.storage.free()
        self._sharded_state = _SHARDED

    cpdef _to_sharded_post_forward(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_sharded_post_forward``."""
        cdef FSDPParam p
        if self._sharded_state == _SHARDED_POST_FORWARD:
            return
        for p in self.fsdp_params:
            p.to_sharded_post_forward()
        self.storage.free()
        self._sharded_state = _SHARDED_POST_FORWARD

    cpdef _to_unsharded(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_unsharded``."""
        cdef FSDPParam p
        if self._sharded_state == _UNSHARDED:
            return
        for p in self.fsdp_params:
            p.to_unsharded()
        self._sharded_state = _UNSHARDED

    def _register_post_backward_hook(self, args):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._register_post_backward_hook``."""
        cdef list hooked = [0]
        if is_grad_enabled():
            args = _hook_inputs(args, self, hooked)
            self._post_backward_pending = hooked[0]
        return args

    cpdef _post_backward_hook(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._post_backward_hook``."""
        self._post_backward_pending -= 1
        if self._post_backward_pending == 0:
            self.post_backward()


class PostBackwardNode(_Node):
    """See :class:`distlab.reference.fsdp_param_group.PostBackwardNode`."""

    __slots__ = ()

    def __init__(self, tuple next_nodes, group):
        """See :class:`distlab.reference.fsdp_param_group.PostBackwardNode`."""
        _Node.__init__(self, next_nodes, group)

    def apply(self, grad):
        """See :meth:`distlab.reference.fsdp_param_group.PostBackwardNode.apply`."""
        (<FSDPParamGroup>self.saved)._post_backward_hook()
        return (grad,)

    def release(self):
        """See :meth:`distlab.reference.fsdp_param_group.PostBackwardNode.release`."""


# --- core-only helpers ---
cdef inline _note(FSDPParamGroup group, str event, argument):
    """FSDPParamGroupBase._record, inlined: append to the replay record while recording."""
    cdef object ctx = group.comm_ctx
    if ctx.recording:
        ctx.program.append((group, event, argument))


cdef object _hook_inputs(object value, FSDPParamGroup group, list hooked):
    """The reference's ``hooked``: each input that requires a gradient, routed through a PostBackwardNode."""
    if isinstance(value, Tensor):
        if not value.requires_grad:
            return value
        hooked[0] += 1
        return Tensor._wrap(value.data, PostBackwardNode((value._grad_node(),), group))
    if isinstance(value, (list, tuple)):
        return type(value)([_hook_inputs(item, group, hooked) for item in value])
    if isinstance(value, dict):
        return {key: _hook_inputs(item, group, hooked) for key, item in value.items()}
    return value
