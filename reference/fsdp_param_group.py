"""A parameter group: the parameters of one ``fully_shard`` call, gathered and reduced together, once each per step.

Twinned with ``core/_fsdp_param_group.pyx``. Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
``FSDPParamGroup``. One training step of a group, as FSDP2 runs it:

1. *pre-forward*: ``unshard`` copies the shards in and issues the group's one all-gather; ``wait_for_unshard``
   copies out and registers the unsharded parameters on the modules, which compute on views of them; the inputs
   get a backward hook (``_register_post_backward_hook``).
2. *post-forward*: ``reshard`` (unless ``reshard_after_forward`` is False: ZeRO-2, and the root by default) frees
   the unsharded storage and registers the shards again; the group notes its place in the forward order.
3. *pre-backward* (a hook on the module's outputs): unshard again, wait, and prefetch the group that ran forward
   before this one (its all-gather overlaps this group's backward).
4. *post-backward* (the hook on the inputs, or the root's final callback): take the unsharded gradients,
   reshard, wait for the reduce-scatter in flight, pack the gradients and issue this group's reduce-scatter
   (:func:`~distlab.reference.fsdp_collectives.foreach_reduce`).
5. *finalize*: deliver the reduced, sharded gradients (``finish_reduce``).

Construction, the storage's layout and the replay record are shared functions
(:func:`distlab._common.fsdp_param_group.prepare_group` gives the set-up whose fields the class keeps,
:data:`~distlab._common.fsdp_param_group.GROUP_STATE`). Guarantees kept: F3, every rank issues its
group's collectives in the same order (the all-gathers in forward order, the backward's in reverse, each group's
reduce-scatter once per synchronised backward), so the collective counts per step are torch's: N+1 all-gathers in
forward for N blocks and a root, N+1 reduce-scatters in backward; F4, at most one reduce-scatter and, unless
prefetch lists ask for more, one prefetched all-gather are in flight.
"""
from __future__ import annotations

from distlab import comm as _comm
from distlab._common.fsdp import TWIN_NAMES, ShardedState, TrainingState
from distlab._common.fsdp_param_group import (  # noqa: F401 - FSDPCommContext and MeshInfo re-exported
    FSDPCommContext,
    MeshInfo,
    compute_begins,
    compute_ends,
    prepare_group,
    record_call,
    storage_layout,
)
from distlab._common.fsdp_storage import UnshardedStorage
from distlab.autograd import Tensor, is_grad_enabled
from distlab.autograd.node import Node
from distlab.autograd.ops import record
from distlab.reference.fsdp_collectives import (  # noqa: F401 - re-exported: this module is the twin's face
    AllGatherResult,
    ReduceScatterState,
    all_gather_copy_in,
    finish_reduce,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
    foreach_reduce_scatter_copy_in,
    free_reduce_input,
    wait_reduce_scatter,
)
from distlab.reference.fsdp_param import FSDPParam, ParamModuleInfo  # noqa: F401

__all__ = list(TWIN_NAMES)  # the names of both twins, listed once in distlab._common.fsdp


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and their per-step life (``FSDPParamGroup``).

    Parameters
    ----------
    fsdp_params : list of FSDPParam
        The group's parameters, sharded.
    modules : tuple of Module
        The module(s) ``fully_shard`` was applied to.
    mesh_info : MeshInfo
        The shard group, and for hybrid sharding the replicate group.
    post_forward_group : ProcessGroup or None
        Where the parameters stay sharded after forward: None (kept unsharded, ZeRO-2), the shard group
        (resharded, ZeRO-3) or a subgroup of k ranks (``reshard_after_forward=k``).
    mp_policy : MixedPrecisionPolicy
    module_fqn : str
        The module's name, for collective names and messages.
    """

    def __init__(self, fsdp_params, modules, mesh_info, post_forward_group, mp_policy, module_fqn=""):
        setup = prepare_group(fsdp_params, modules, mesh_info, post_forward_group, mp_policy, module_fqn)
        vars(self).update(setup._asdict())  # every field of the set-up, under its own name (GROUP_STATE)
        self._all_gather_result = None  # the all-gather issued and not yet copied out
        self._post_forward_indices = []  # this group's places in the forward order, for backward prefetch
        self._pending_reduce = None  # this group's reduce-scatter, until its gradients are delivered
        self._post_backward_pending = 0  # hooked inputs whose gradient has not arrived
        self._storage_offsets = None
        self._compute_start = 0.0

    # -- the unsharded storage ---------------------------------------------------------------------------------
    def lazy_init(self):
        """Make the group's unsharded storage, each parameter's all-gather output a slice of it (``lazy_init``)."""
        if self.storage is not None:
            return
        dtype, self._storage_offsets, total = storage_layout(self.fsdp_params)
        self.storage = UnshardedStorage(self.xp, dtype, total)
        self._cut_all_gather_outputs()

    def _cut_all_gather_outputs(self):
        """Point each parameter's all-gather output at its slice of the storage (again after a device storage
        was re-made)."""
        flat, generation = self.storage.flat, self.storage.generation
        for fsdp_param, offset in zip(self.fsdp_params, self._storage_offsets):
            view = None if flat is None else flat[offset:offset + fsdp_param.unsharded_numel]
            fsdp_param.set_all_gather_output(view, generation)

    def alloc_storage(self):
        """Hold the unsharded storage (``alloc_all_gather_outputs``)."""
        if self.storage.alloc():
            self._cut_all_gather_outputs()

    # -- unshard and reshard ---------------------------------------------------------------------------------------
    def unshard(self, async_op=False):
        """Issue the group's all-gather, unless it is unsharded or one is already issued (``unshard``)."""
        if self._all_gather_result is not None or self.sharded_state == ShardedState.UNSHARDED:
            return
        self.lazy_init()
        group = self.mesh_info.shard_group  # after a forward with reshard_after_forward=k, the k-rank subgroup
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            group = self.post_forward_group
        if group.size == 1:
            self._all_gather_result = AllGatherResult(None, None, None, None, [], 1)
            return
        dtype = self.fsdp_params[0].unsharded_dtype
        shards = self.sharded_flat if self.sharded_state == ShardedState.SHARDED else None  # sent as they are
        self._all_gather_result = foreach_all_gather(self.fsdp_params, group, async_op, self.comm_ctx.all_gather_pool,
                                                     self.xp, dtype, self.module_fqn, shards)

    def wait_for_unshard(self):
        """Copy out the all-gather and register the unsharded parameters (``wait_for_unshard``)."""
        result = self._all_gather_result
        if result is None:
            return
        self.alloc_storage()
        if result.world_size == 1:  # one rank: the shard is the whole parameter
            for fsdp_param in self.fsdp_params:
                data = fsdp_param.all_gather_input()
                fsdp_param.all_gather_output[:data.size] = data
        else:
            foreach_all_gather_copy_out(result, self.fsdp_params, self.comm_ctx.all_gather_pool)
        self._all_gather_result = None
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_unsharded_param()
        self._to_unsharded()

    def reshard(self):
        """Free the unsharded parameters (``reshard``): after forward only if ``reshard_after_forward``, and to the
        post-forward piece when it is an int."""
        if self.training_state == TrainingState.FORWARD:
            if self.post_forward_group is None:  # ZeRO-2: kept until backward ends
                return
            if self.post_forward_group is not self.mesh_info.shard_group:  # reshard_after_forward=k
                self._to_sharded_post_forward()
                return
        self._to_sharded()

    # -- the hooks -------------------------------------------------------------------------------------------------
    def pre_forward(self, module, args):
        """Unshard before the module's forward; hook its inputs for post-backward (``pre_forward``)."""
        record_call(self, "pre_forward")
        self.training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        args = self._register_post_backward_hook(args)
        self._compute_start = compute_begins()
        return args

    def post_forward(self, module, input, output):  # noqa: A002 - torch's signature
        """Reshard after the module's forward and note the forward order (``post_forward``)."""
        record_call(self, "post_forward")
        compute_ends(self._compute_start, "forward", self)
        self._compute_start = 0.0
        self.reshard()
        self._record_post_forward()
        self.training_state = TrainingState.IDLE
        return output

    def _record_post_forward(self):
        ctx = self.comm_ctx
        self._post_forward_indices.append(len(ctx.post_forward_order))
        ctx.post_forward_order.append(self)

    def pre_backward(self, default_prefetch):
        """Unshard before the module's backward and prefetch the previous group (``pre_backward``); once per
        backward, whichever output's gradient comes first."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        record_call(self, "pre_backward", default_prefetch)
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard(self.unshard_async_op)
        pending = self._all_gather_result
        if pending is not None and pending.all_gather_work is not None:
            pending.all_gather_work.wait()  # MPI completes the reduce-scatter issued before it on the way
        if self.comm_ctx.reduce_scatter_state is not None:  # F4: its packed gradients freed before the copy-out
            free_reduce_input(self.comm_ctx.reduce_scatter_state)
        self.wait_for_unshard()
        if default_prefetch:
            self._backward_prefetch()
        _comm.progress()  # in-flight collectives move only while someone calls into MPI
        self._compute_start = compute_begins()

    def post_backward(self):
        """Reshard and issue the group's reduce-scatter (``post_backward``); safe to call when the group was not
        used in backward (it does nothing then)."""
        record_call(self, "post_backward", self._grad_mask())
        compute_ends(self._compute_start, "backward", self)
        self._compute_start = 0.0
        self.training_state = TrainingState.POST_BACKWARD
        for fsdp_param in self.fsdp_params:
            fsdp_param.accumulate_unsharded_grad_if_needed()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_accumulated_grad_if_needed()
            return
        params_with_grad, grads = self._take_grads()
        if self.reshard_after_backward:
            self.reshard()
        if not params_with_grad:
            return
        ctx = self.comm_ctx
        if ctx.reduce_scatter_state is not None:  # F4: one reduce-scatter in flight
            wait_reduce_scatter(ctx.reduce_scatter_state)
            ctx.reduce_scatter_state = None
        self._wait_for_post_backward()
        info = self.mesh_info
        self._pending_reduce = ctx.reduce_scatter_state = foreach_reduce(
            params_with_grad, grads, info.shard_group, self.orig_dtype, self.reduce_dtype, self.xp,
            self.gradient_divide_factor, info.replicate_group, self.all_reduce_grads, self.module_fqn)
        _comm.progress()

    def _grad_mask(self):
        """Which parameters hold an unsharded gradient now (what a joined rank contributes zeros for)."""
        if self.join_mask is not None:
            return self.join_mask
        return tuple(p.unsharded_accumulated_grad is not None or p.unsharded_grad_data() is not None
                     for p in self.fsdp_params)

    def _take_grads(self):
        """The parameters with a gradient and their gradients, taken off the unsharded parameters; on a joined rank
        zeros for the parameters the ranks still training reduce."""
        params, grads = [], []
        if self.join_mask is not None:
            for fsdp_param, has_grad in zip(self.fsdp_params, self.join_mask):
                if has_grad:
                    params.append(fsdp_param)
                    grads.append(self.xp.zeros(fsdp_param.orig_size, dtype=fsdp_param.unsharded_dtype))
            return params, grads
        for fsdp_param in self.fsdp_params:
            grad = fsdp_param.take_unsharded_grad()
            if grad is not None:
                params.append(fsdp_param)
                grads.append(grad)
        return params, grads

    def finalize_backward(self):
        """Deliver the sharded gradients and drop what backward left (``finalize_backward``)."""
        record_call(self, "finalize")
        self._wait_for_post_backward()
        result = self._all_gather_result
        if result is not None:  # a prefetch this backward never used: complete it, give its buffers back
            if result.all_gather_work is not None:
                result.all_gather_work.wait()
            if result.world_size > 1:
                self.comm_ctx.all_gather_pool.give_back(result.all_gather_input)
                self.comm_ctx.all_gather_pool.give_back(result.flat_output)
            self._all_gather_result = None
        self._post_forward_indices.clear()

    def _wait_for_post_backward(self):
        """Complete this group's reduction and deliver its gradients (``_wait_for_post_backward``)."""
        state = self._pending_reduce
        if state is None:
            return
        if self.comm_ctx.reduce_scatter_state is state:
            self.comm_ctx.reduce_scatter_state = None
        finish_reduce(state)
        self._pending_reduce = None

    def _backward_prefetch(self):
        """Prefetch the group that ran forward just before this one (``_backward_prefetch``). The first group of
        the forward has none: no all-gather follows it in this backward, so the idle flat buffers go back to the
        allocator (the largest moment of a step is this group's backward)."""
        target_index = self._post_forward_indices.pop() - 1 if self._post_forward_indices else -1
        if target_index < 0:
            self.comm_ctx.all_gather_pool.clear()
            return
        self.comm_ctx.post_forward_order[target_index].prefetch_unshard("backward")

    def prefetch_unshard(self, pass_type):
        """Issue this group's all-gather now, asynchronously, for the ``"forward"`` or ``"backward"`` of another
        group (``_prefetch_unshard``)."""
        record_call(self, "prefetch", pass_type)
        previous = self.training_state
        self.training_state = TrainingState.PRE_BACKWARD if pass_type == "backward" else TrainingState.FORWARD
        try:
            self.unshard(True)
        finally:
            self.training_state = previous

    # -- state changes ---------------------------------------------------------------------------------------------
    def _to_sharded(self):
        if self.sharded_state != ShardedState.SHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded()
            self.storage.free()
            self.sharded_state = ShardedState.SHARDED

    def _to_sharded_post_forward(self):
        if self.sharded_state != ShardedState.SHARDED_POST_FORWARD:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded_post_forward()
            self.storage.free()
            self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _to_unsharded(self):
        if self.sharded_state != ShardedState.UNSHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            self.sharded_state = ShardedState.UNSHARDED

    def _register_post_backward_hook(self, args):
        """Route the inputs that require a gradient through :class:`PostBackwardNode`, so that post-backward runs
        once the gradients of all of them are computed (``RegisterPostBackwardFunction``)."""
        if not is_grad_enabled():
            return args
        count = [0]

        def hooked(value):
            if isinstance(value, Tensor):
                if not value.requires_grad:
                    return value
                count[0] += 1
                return record(value.data, PostBackwardNode, (value,), self)
            if isinstance(value, (list, tuple)):
                return type(value)(hooked(item) for item in value)
            if isinstance(value, dict):
                return {key: hooked(item) for key, item in value.items()}
            return value

        args = hooked(args)
        self._post_backward_pending = count[0]
        return args

    def _post_backward_hook(self):
        """One hooked input's gradient arrived; post-backward after the last."""
        self._post_backward_pending -= 1
        if self._post_backward_pending == 0:
            self.post_backward()


class PostBackwardNode(Node):
    """The identity on one input of a sharded module's forward; its backward tells the group the input's gradient
    is computed, hence the module's parameters' too (torch's ``RegisterPostBackwardFunction``)."""

    __slots__ = ()

    def __init__(self, next_nodes, group):
        super().__init__(next_nodes, group)

    def apply(self, grad):
        self.saved._post_backward_hook()
        return (grad,)

    def release(self):
        pass  # the group is not a saved activation: running the graph again still finds it
