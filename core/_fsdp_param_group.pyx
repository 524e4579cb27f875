# cython: language_level=3
"""Core twin of FSDP's parameter group, :mod:`distlab.reference.fsdp_param_group` (read it, and
reference/fsdp_param.py and reference/fsdp_collectives.py, for the explanation).

One extension holds what the reference splits into three modules, laid out file for file: ``_fsdp_param.pxi``
(the sharded parameter) and ``_fsdp_collectives.pxi`` (copy-in, copy-out, the reduce-scatter's packing) are
included below, and this file holds the group. What is compiled: the per-parameter loops of every step, over
``cdef`` classes with C-typed sizes and states, and host copies by memcpy. Construction, the storage's layout and
the replay record are the shared functions of :mod:`distlab._common.fsdp_param` and
:mod:`distlab._common.fsdp_param_group` (the set-ups each class keeps field by field, typed).
"""
cimport cython
from libc.string cimport memcpy, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

from distlab import comm as _comm
from distlab._common.fsdp import (
    FSDP_LANE, TWIN_NAMES, AllGatherResult, ShardedState, TrainingState, collective_name, gradient_divide_factors)
from distlab._common.fsdp_param import ParamModuleInfo, prepare_param
from distlab._common.fsdp_param_group import (
    MeshInfo, FSDPCommContext, compute_begins, compute_ends, prepare_group, storage_layout)
from distlab._common.fsdp_storage import UnshardedStorage
from distlab.autograd import is_grad_enabled, run_post_accumulate_grad_hooks, Tensor
from distlab.autograd.node import Node as _Node
from distlab.autograd.ops import record
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
    cdef public list fsdp_params
    cdef public object modules, mesh_info, post_forward_group, mp_policy, module_fqn, comm_ctx
    cdef public object orig_dtype, reduce_dtype, xp, sharded_flat, gradient_divide_factor, user_divide_factor
    cdef public object join_mask, storage
    cdef public int training_state, sharded_state
    cdef public bint reduce_grads, all_reduce_grads, reshard_after_backward, unshard_async_op
    cdef list _post_forward_indices, _storage_offsets
    cdef object _all_gather_result, _pending_reduce
    cdef Py_ssize_t _post_backward_pending
    cdef double _compute_start
    cdef dict __dict__

    def __init__(self, list fsdp_params, modules, mesh_info, post_forward_group, mp_policy, str module_fqn=""):
        """See :class:`distlab.reference.fsdp_param_group.FSDPParamGroup`."""
        (self.fsdp_params, self.modules, self.mesh_info, self.post_forward_group, self.mp_policy, self.module_fqn,
         self.comm_ctx, self.orig_dtype, self.reduce_dtype, self.xp, self.sharded_flat, self.training_state,
         self.sharded_state,
         self.reduce_grads, self.all_reduce_grads, self.reshard_after_backward, self.gradient_divide_factor,
         self.user_divide_factor, self.unshard_async_op, self.join_mask,
         self.storage) = prepare_group(fsdp_params, modules, mesh_info, post_forward_group, mp_policy, module_fqn)
        self._post_forward_indices = []

    cpdef lazy_init(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.lazy_init`."""
        if self.storage is not None:
            return
        dtype, self._storage_offsets, total = storage_layout(self.fsdp_params)
        self.storage = UnshardedStorage(self.xp, dtype, total)
        self._cut_all_gather_outputs()

    cpdef _cut_all_gather_outputs(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._cut_all_gather_outputs``."""
        cdef object flat = self.storage.flat
        cdef long long generation = self.storage.generation
        cdef FSDPParam p
        cdef Py_ssize_t i, offset
        for i, p in enumerate(self.fsdp_params):
            offset = self._storage_offsets[i]
            p.set_all_gather_output(None if flat is None else flat[offset:offset + p.unsharded_numel], generation)

    cpdef alloc_storage(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.alloc_storage`."""
        if self.storage.alloc():
            self._cut_all_gather_outputs()

    cpdef unshard(self, async_op=False):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.unshard`."""
        if self._all_gather_result is not None or self.sharded_state == _UNSHARDED:
            return
        self.lazy_init()
        cdef object over = (self.post_forward_group if self.sharded_state == _SHARDED_POST_FORWARD
                            else self.mesh_info.shard_group)
        if over.size == 1:  # nothing to gather: wait_for_unshard copies the shard
            self._all_gather_result = AllGatherResult(None, None, None, None, (), 1)
            return
        cdef FSDPParam first = self.fsdp_params[0]
        self._all_gather_result = foreach_all_gather(
            self.fsdp_params, over, async_op, self.comm_ctx.all_gather_pool, self.xp, first.unsharded_dtype,
            self.module_fqn, self.sharded_flat if self.sharded_state == _SHARDED else None)

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
        if self.training_state == _FORWARD and keep is not self.mesh_info.shard_group:
            if keep is not None:
                self._to_sharded_post_forward()
            return  # reshard_after_forward=False: kept unsharded until backward ends
        self._to_sharded()

    def pre_forward(self, module, args):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.pre_forward`."""
        _note(self, "pre_forward", None)
        self.training_state = _FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        args = self._register_post_backward_hook(args)
        self._compute_start = compute_begins()
        return args

    def post_forward(self, module, input, output):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.post_forward`."""
        _note(self, "post_forward", None)
        compute_ends(self._compute_start, "forward", self)
        self._compute_start = 0.0
        self.reshard()
        self._record_post_forward()
        self.training_state = _IDLE
        return output

    cpdef _record_post_forward(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._record_post_forward``."""
        cdef list order = self.comm_ctx.post_forward_order
        self._post_forward_indices.append(len(order))
        order.append(self)

    def pre_backward(self, default_prefetch):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.pre_backward`."""
        if self.training_state != _PRE_BACKWARD:
            _note(self, "pre_backward", default_prefetch)
            self.training_state = _PRE_BACKWARD
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
            self._compute_start = compute_begins()

    def post_backward(self):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.post_backward`."""
        _note(self, "post_backward", self._grad_mask())
        compute_ends(self._compute_start, "backward", self)
        self._compute_start = 0.0
        self.training_state = _POST_BACKWARD
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
            taken[0], taken[1], info.shard_group, self.orig_dtype, self.reduce_dtype, self.xp,
            self.gradient_divide_factor, info.replicate_group, self.all_reduce_grads, self.module_fqn)
        ctx.reduce_scatter_state = self._pending_reduce
        _comm.progress()

    cpdef tuple _grad_mask(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._grad_mask``."""
        if self.join_mask is not None:
            return self.join_mask
        cdef FSDPParam p
        return tuple([p.unsharded_accumulated_grad is not None or p.unsharded_grad_data() is not None
                      for p in self.fsdp_params])

    cpdef tuple _take_grads(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._take_grads``."""
        cdef list params = [], grads = []
        cdef FSDPParam p
        cdef Py_ssize_t i
        cdef object mask = self.join_mask
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
        cdef FSDPParamGroup previous
        if target >= 0:
            previous = self.comm_ctx.post_forward_order[target]
            previous.prefetch_unshard("backward")
        else:  # nothing follows in this backward: the pool's idle buffers are freed
            self.comm_ctx.all_gather_pool.clear()

    cpdef prefetch_unshard(self, pass_type):
        """See :meth:`distlab.reference.fsdp_param_group.FSDPParamGroup.prefetch_unshard`."""
        _note(self, "prefetch", pass_type)
        cdef int previous = self.training_state
        self.training_state = _PRE_BACKWARD if pass_type == "backward" else _FORWARD
        try:
            self.unshard(True)
        finally:
            self.training_state = previous

    cpdef _to_sharded(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_sharded``."""
        cdef FSDPParam p
        if self.sharded_state == _SHARDED:
            return
        for p in self.fsdp_params:
            p.to_sharded()
        self.storage.free()
        self.sharded_state = _SHARDED

    cpdef _to_sharded_post_forward(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_sharded_post_forward``."""
        cdef FSDPParam p
        if self.sharded_state == _SHARDED_POST_FORWARD:
            return
        for p in self.fsdp_params:
            p.to_sharded_post_forward()
        self.storage.free()
        self.sharded_state = _SHARDED_POST_FORWARD

    cpdef _to_unsharded(self):
        """See ``distlab.reference.fsdp_param_group.FSDPParamGroup._to_unsharded``."""
        cdef FSDPParam p
        if self.sharded_state == _UNSHARDED:
            return
        for p in self.fsdp_params:
            p.to_unsharded()
        self.sharded_state = _UNSHARDED

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
    """distlab._common.fsdp_param_group.record_call, inlined: append to the replay record while recording."""
    cdef object ctx = group.comm_ctx
    if ctx.recording:
        ctx.program.append((group, event, argument))


cdef object _hook_inputs(object value, FSDPParamGroup group, list hooked):
    """The reference's ``hooked``: each input that requires a gradient, routed through a PostBackwardNode."""
    if isinstance(value, Tensor):
        if not value.requires_grad:
            return value
        hooked[0] += 1
        return record(value.data, PostBackwardNode, (value,), group)
    if isinstance(value, (list, tuple)):
        return type(value)([_hook_inputs(item, group, hooked) for item in value])
    if isinstance(value, dict):
        return {key: _hook_inputs(item, group, hooked) for key, item in value.items()}
    return value
