"""The per-module FSDP state: the forward and backward hooks that drive a module's parameter group.

Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``FSDPState``. Each ``fully_shard`` call gives its
module(s) one state, holding the call's parameter group (a twin's ``FSDPParamGroup``, or none when the call
found no parameter). The hooks:

- a forward pre-hook (``_pre_forward``): on the root, the once-per-iteration work first (lazy init at the first
  forward, Join's notification); then the mixed-precision cast of the inputs and the group's ``pre_forward``
  (all-gather, inputs hooked for post-backward), and the explicit forward prefetches;
- a forward hook (``_post_forward``): the group's ``post_forward`` (reshard), a gradient hook on the outputs
  (``_pre_backward``: all-gather for backward, prefetch the previous group) and the output cast;
- the root's final callback, queued from the first pre-backward (``_root_post_backward_final_callback``): the
  post-backward of groups whose inputs needed no gradient, then every group's ``finalize_backward``.

Like DDP's forward (``distlab.ddp``), this orchestration is plumbing around the twinned component, written once.
"""
from __future__ import annotations

import numpy as np

from .. import _backend
from .._common.fsdp import TrainingState
from ..autograd import Tensor, is_grad_enabled, queue_callback
from ..autograd.node import Node
from ..autograd.ops import record

__all__ = ["FSDPState", "FSDPStateContext", "JOIN_FLAGS_NAME", "check_replayable", "fsdp_state"]

#: The name of the allreduce a root issues each iteration under Join: ranks still training, ranks syncing.
JOIN_FLAGS_NAME = "fsdp: join flags"


class FSDPStateContext:
    """What every state of one root shares (``FSDPStateContext``)."""

    def __init__(self):
        self.all_states: list = []
        self.iter_forward_root = None
        self.post_backward_final_callback_queued = False
        self.is_last_backward = True


def fsdp_state(module):
    """The :class:`FSDPState` of a module ``fully_shard`` was applied to, or None."""
    return module.__dict__.get("_fsdp_state")


class FSDPState:
    """One ``fully_shard`` call's hooks and bookkeeping (``FSDPState``); set on each of its modules
    (:func:`fsdp_state` finds it)."""

    def __init__(self, modules, group, mp_policy, auto_reshard_after_forward, mesh_info, impl, verify):
        self._modules = tuple(modules)
        self.param_group = group
        self._mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.mesh_info = mesh_info
        self.impl = impl
        self._verify = verify  # verify(root_state): every rank built the same model (before the first all-gather)
        self._is_root = None
        self.state_ctx = FSDPStateContext()
        self.comm_ctx = group.comm_ctx if group is not None else None
        self._training_state = TrainingState.IDLE
        self.states_to_forward_prefetch: list = []
        self.states_to_backward_prefetch: list = []
        self._join_flags = None
        self._divide_override = False
        self.join_options: dict = {}  # set by the join hook: divide_by_initial_world_size, optimizer
        self._join_module = _backend.load("join", impl)
        self._modules_to_run_forward: set = set()
        for module in self._modules:
            object.__setattr__(module, "_fsdp_state", self)
        if len(self._modules) == 1:
            module = self._modules[0]
            self._pre_forward_hook_handle = module.register_forward_pre_hook(self._pre_forward, prepend=True)
            self._post_forward_hook_handle = module.register_forward_hook(self._post_forward)
        else:
            self._register_group_forward_hooks()

    def _register_group_forward_hooks(self) -> None:
        """One group of several modules: its pre-forward runs before the first of them, its post-forward after the
        last (``_register_group_forward_hooks``)."""
        pending = self._modules_to_run_forward

        def pre_hook(module, args):
            if not pending:
                pending.update(id(m) for m in self._modules)
                return self._pre_forward(module, args)
            return None

        def post_hook_of(module):
            def post_hook(mod, args, output):
                pending.discard(id(module))
                return self._post_forward(mod, args, output) if not pending else None
            return post_hook

        for module in self._modules:
            module.register_forward_pre_hook(pre_hook, prepend=True)
            module.register_forward_hook(post_hook_of(module))

    # -- lazy initialisation (once, at the root's first forward) ---------------------------------------------------
    def _root_pre_forward(self, module, args):
        if self._is_root is False or self.state_ctx.iter_forward_root is not None:
            return args
        self.state_ctx.iter_forward_root = self
        self._notify_join(module)  # first: a rank that joined answers it before anything else of the iteration
        self.lazy_init()
        if self.comm_ctx is not None:
            self.comm_ctx.program = []  # this iteration's record, for a rank that joins later
            self.comm_ctx.recording = True
            self.comm_ctx.forward_order = []
        return args

    def lazy_init(self) -> None:
        """Find the root (the first state to run forward) and every state under it (``_lazy_init``)."""
        if self._is_root is not None:
            return
        self._is_root = True
        if len(self._modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {list(self._modules)}")
        root_module = self._modules[0]
        states = []
        for name, module in root_module.named_modules():
            state = fsdp_state(module)
            if state is None or state in states:
                continue
            if module is not root_module:
                if state._is_root is not None:
                    raise RuntimeError(f"FSDP state has already been lazily initialized for {name}\nFSDP requires "
                                       "running forward through the root module first")
                state._is_root = False
            states.append(state)
        self.state_ctx.all_states = states
        if self.auto_reshard_after_forward and self.param_group is not None:
            self.param_group.post_forward_group = None  # the root's parameters are needed first in backward
        self._init_fqns(root_module)
        self._init_shared_state()
        self._verify(self)
        for state in states:
            if state.param_group is not None:
                state.param_group.lazy_init()

    def _init_fqns(self, root_module) -> None:
        """Name each group and parameter from the root (``_init_fqns``)."""
        owner = {}
        for state in self.state_ctx.all_states:
            group = state.param_group
            if group is None:
                continue
            for fsdp_param in group.fsdp_params:
                owner[id(fsdp_param.sharded_param)] = fsdp_param
        for name, param in root_module.named_parameters():
            if id(param) in owner:
                owner[id(param)].fqn = name
        for name, module in root_module.named_modules():
            state = fsdp_state(module)
            if state is not None and state.param_group is not None and module is state._modules[0]:
                state.param_group.module_fqn = name

    def _init_shared_state(self) -> None:
        """One state context and one comm context for every state of the root (``_init_shared_state``)."""
        comm_ctx = next((s.comm_ctx for s in self.state_ctx.all_states if s.comm_ctx is not None), None)
        for state in self.state_ctx.all_states:
            state.state_ctx = self.state_ctx
            state.comm_ctx = comm_ctx
            if state.param_group is not None:
                state.param_group.comm_ctx = comm_ctx

    def groups(self) -> list:
        """The parameter groups of every state of this root (after lazy init), in state order."""
        return [s.param_group for s in self.state_ctx.all_states if s.param_group is not None]

    # -- forward --------------------------------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return args
        self._training_state = TrainingState.FORWARD
        args = self._root_pre_forward(module, args)
        policy = self._mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args = _apply_to_tensors(lambda t: _cast_fp_tensor(policy.param_dtype, t), args)
        group = self.param_group
        if group is not None:
            args = group.pre_forward(module, args)
            self.comm_ctx.forward_order.append(group)
        targets = [s.param_group for s in self.states_to_forward_prefetch if s.param_group is not None]
        if not targets and group is not None:
            following = self.comm_ctx.forward_successor.get(id(group))
            targets = [] if following is None else [following]
        for target in targets:
            target.prefetch_unshard("forward")
        return args

    def _post_forward(self, module, args, output):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return output
        if self.param_group is not None:
            output = self.param_group.post_forward(module, args, output)
        output = self._register_pre_backward_hook(output)
        self._training_state = TrainingState.IDLE
        if self.state_ctx.iter_forward_root is self:
            self.state_ctx.iter_forward_root = None
        if self._mp_policy.output_dtype is not None:
            output = _apply_to_tensors(lambda t: _cast_fp_tensor(self._mp_policy.output_dtype, t), output)
        return output

    def _register_pre_backward_hook(self, output):
        if not is_grad_enabled():
            return output
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward)
        return output

    # -- backward -------------------------------------------------------------------------------------------------
    def _pre_backward(self, grad):
        self._training_state = TrainingState.PRE_BACKWARD
        self._register_root_post_backward_final_callback()
        group = self.param_group
        if group is not None:
            group.pre_backward(not self.states_to_backward_prefetch)
        for state in self.states_to_backward_prefetch:
            if state.param_group is not None:
                state.param_group.prefetch_unshard("backward")
        return None

    def _register_root_post_backward_final_callback(self) -> None:
        if self.state_ctx.post_backward_final_callback_queued:
            return
        self.state_ctx.post_backward_final_callback_queued = True
        queue_callback(self._root_post_backward_final_callback)

    def _root_post_backward_final_callback(self) -> None:
        """Post-backward for the groups autograd did not reach (inputs without gradients), then finalize each
        (``_root_post_backward_final_callback``)."""
        ctx = self.state_ctx
        try:
            for state in ctx.all_states:
                group = state.param_group
                if group is not None:
                    if group.training_state != TrainingState.POST_BACKWARD:
                        group.post_backward()
                    group.training_state = TrainingState.IDLE
                state._training_state = TrainingState.IDLE
                if ctx.is_last_backward and group is not None:
                    group.finalize_backward()
            if ctx.is_last_backward and self.comm_ctx is not None:
                self.comm_ctx.post_forward_order.clear()
                self._learn_forward_order()
        finally:
            ctx.post_backward_final_callback_queued = False

    def _learn_forward_order(self) -> None:
        """Remember which group ran forward after which this iteration: the next forward prefetches each group's
        successor as it starts (the implicit forward prefetch: torch's GPU streams overlap the next group's
        all-gather with this group's compute by running ahead; over MPI the all-gather must be issued early)."""
        ctx = self.comm_ctx
        successor: dict = {}
        for current, following in zip(ctx.forward_order, ctx.forward_order[1:]):
            successor.setdefault(id(current), following)
        ctx.forward_successor = successor
        ctx.forward_order = []

    # -- Join (a distlab addition: torch's FSDP has no Join support) ---------------------------------------------
    def _notify_join(self, module) -> None:
        """Under an enabled Join, tell joined ranks that this rank trains an iteration and whether it synchronises
        gradients, learn whether a joined rank cannot shadow it, and (``divide_by_initial_world_size=False``)
        divide by the ranks still training."""
        work = self._join_module.Join.notify_join_context(module)
        if work is None and not self._divide_override:
            return  # no Join (the common case): nothing to do, no walk over the modules
        states = [fsdp_state(m) for m in module.modules()]
        groups = [s.param_group for s in states if s is not None and s.param_group is not None]
        if work is None:
            if self._divide_override:  # a Join ended: the divide factor the user set applies again
                for group in groups:
                    group.gradient_divide_factor = group.user_divide_factor
                self._divide_override = False
            return
        group = self.mesh_info.full_group
        flags = np.zeros(2 + group.size, dtype=np.int64)
        flags[:2] = 1, any(g.reduce_grads for g in groups)
        group.allreduce(flags, name=JOIN_FLAGS_NAME)
        check_replayable(flags)
        if not self.join_options.get("divide_by_initial_world_size", True):
            for target in groups:
                if not self._divide_override:
                    target.user_divide_factor = target.gradient_divide_factor
                target.gradient_divide_factor = float(flags[0])
            self._divide_override = True


def check_replayable(flags) -> None:
    """Join's flags say which joined ranks have no iteration to replay (a rank with no input at all): every rank
    raises the same error naming them, instead of waiting for collectives those ranks cannot issue."""
    missing = [int(r) for r in np.flatnonzero(flags[2:])]
    if missing:
        raise RuntimeError(f"ranks {missing} joined before training one iteration: an FSDP rank that runs out of "
                           "inputs shadows the others by replaying its own last iteration, so every rank needs at "
                           "least one input (this iteration is abandoned on every rank)")

def _tensors_in(value) -> list:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _apply_to_tensors(fn, value):
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_apply_to_tensors(fn, item) for item in value)
    if isinstance(value, dict):
        return {key: _apply_to_tensors(fn, item) for key, item in value.items()}
    return value


class CastBackward(Node):
    """The gradient of a dtype cast: cast back (``_cast_fp_tensor``'s ``to``)."""

    __slots__ = ()

    def apply(self, grad):
        return (grad.astype(self.saved),)

    def release(self):
        pass  # only a dtype is saved


def _cast_fp_tensor(dtype, tensor):
    """``tensor`` in ``dtype`` when it is a floating-point tensor of another dtype (``_cast_fp_tensor``)."""
    data = tensor.data
    if data.dtype == dtype or data.dtype.kind not in "fV":
        return tensor
    return record(data.astype(dtype), CastBackward, (tensor,), data.dtype)

