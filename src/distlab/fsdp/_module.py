"""``FSDPModule``: what a module becomes under ``fully_shard`` (torch's ``FSDPModule``, ``_fully_shard.py``), and
its Join support, which torch's FSDP does not have.

The class of a sharded module is ``FSDP<Orig>``, a subclass of this class and of its own. Its methods control the
group: ``unshard``/``reshard`` by hand, gradient synchronisation (accumulation without communication), when to
reshard, explicit prefetching, the gradient divide factor; ``state_dict``/``load_state_dict`` give and take the
shards (:class:`distlab.ShardedArray`) or whole arrays.
"""
from __future__ import annotations

import numpy as np

from .._common.fsdp import TrainingState
from .._common.fsdp_param import check_load, load, sharded_array
from .._common.fsdp_param_group import record_call
from .._common.join import JoinHook, Joinable
from ..autograd.tensor import Tensor
from ..nn.module import IncompatibleKeys, Module
from ._state import JOIN_FLAGS_NAME, check_replayable, fsdp_state

__all__ = ["FSDPModule", "UnshardHandle"]


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` completes the all-gather (``UnshardHandle``)."""

    def __init__(self, group):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """The methods of a module sharded by :func:`~distlab.fsdp.fully_shard` (torch's ``FSDPModule``).

    A :class:`~distlab.join.Joinable` (registered as a virtual subclass: ``fully_shard`` changes the class of a
    built module, which an abstract base class in its bases would forbid)."""

    def __init__(self, *args, **kwargs):  # never run: fully_shard changes the class of a built module
        raise TypeError("FSDPModule is not built directly: apply distlab.fsdp.fully_shard to a module")

    def _get_fsdp_state(self):
        return fsdp_state(self)

    def __deepcopy__(self, memo):
        raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")

    # -- unshard and reshard by hand ------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False):
        """All-gather this module's parameters now (not its submodules'); with ``async_op`` return an
        :class:`UnshardHandle` to wait on (its pre-forward waits otherwise)."""
        state = self._get_fsdp_state()
        state.lazy_init()
        group = state.param_group
        if group is not None:
            group.lazy_init()
            record_call(group, "unshard", async_op)
            group.unshard(async_op)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the shards (not recursive)."""
        group = self._get_fsdp_state().param_group
        if group is not None:
            record_call(group, "reshard")
            group.reshard()

    # -- options (every one recursive by default, as torch's) -----------------------------------------------------
    def _groups(self, recurse: bool = True):
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state().param_group
                if group is not None:
                    yield module, group

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in backward (True) or accumulate them unsharded without communication (False; torch's
        ``no_sync``). Hybrid sharding: both the reduce-scatter and the all-reduce."""
        for _, group in self._groups(recurse):
            group.reduce_grads = bool(requires_gradient_sync)
            group.all_reduce_grads = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: all-reduce across replicas in backward (True), or only reduce-scatter (False)."""
        for _, group in self._groups(recurse):
            group.all_reduce_grads = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Reshard after forward (True) or keep the unsharded parameters to the end of backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for module, group in self._groups(recurse):
            module._get_fsdp_state().auto_reshard_after_forward = False
            group.post_forward_group = group.mesh_info.shard_group if reshard_after_forward else None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Reshard after backward (True, default) or keep the unsharded parameters for the next forward."""
        for _, group in self._groups(recurse):
            group.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step: only then are the reductions waited for and the
        gradients delivered (microbatching)."""
        self._get_fsdp_state().state_ctx.is_last_backward = bool(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """All-gather these modules' parameters right after this module's, in forward."""
        self._get_fsdp_state().states_to_forward_prefetch = [_fsdp_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """All-gather these modules' parameters right after this module's, in backward (instead of the previous
        module in forward order)."""
        self._get_fsdp_state().states_to_backward_prefetch = [_fsdp_state_of(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the number of ranks."""
        for _, group in self._groups(True):
            group.gradient_divide_factor = float(factor)
            group.user_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:  # pragma: no cover - torch's, for parity
        raise NotImplementedError("set_unshard_in_backward is not supported")

    # -- state dicts ----------------------------------------------------------------------------------------------
    def state_dict(self, prefix: str = "") -> dict:
        """Every rank's shards as :class:`distlab.ShardedArray` (this rank's unpadded rows, the whole shape, the
        offsets) under the unsharded module's keys, buffers and ignored parameters as arrays; no communication."""
        state = Module.state_dict(self, prefix)
        for key, param in _named_param_slots(self, prefix):
            fsdp_param = param.__dict__.get("_fsdp_param")
            if fsdp_param is not None:
                state[key] = sharded_array(fsdp_param)
        return state

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> IncompatibleKeys:
        """Load shards (``ShardedArray``, this rank's block) or whole arrays (a full state dict, e.g. saved from
        DDP: each rank keeps its rows); the module is resharded first."""
        for _, group in self._groups(True):
            group.reshard()  # outside forward: back to the shards
        own = Module.state_dict(self)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        managed = {key: param.__dict__.get("_fsdp_param") for key, param in _named_param_slots(self, "")}
        for key, value in state_dict.items():  # every entry checked before any is loaded: a refusal changes nothing
            if managed.get(key) is not None:
                check_load(managed[key], value, key)
        plain = {}
        for key, value in state_dict.items():
            fsdp_param = managed.get(key)
            if fsdp_param is None:
                plain[key] = value.local if hasattr(value, "global_shape") else value
            else:
                load(fsdp_param, value, key)
        if plain:
            Module.load_state_dict(self, plain, strict=False)
        return IncompatibleKeys(missing, unexpected)

    # -- Join ------------------------------------------------------------------------------------------------------
    def join(self, optimizer=None, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """``with model.join(optimizer=opt): ...``: train on uneven inputs (a distlab addition).

        A rank that runs out of inputs shadows each iteration of the others: every group's all-gathers, and its
        reduce-scatters with zero gradients, so the others' collectives always find a partner. Since the joined
        rank still owns its shards, ``optimizer`` (the one stepping this model) steps them with the reduced
        gradients after each synchronised iteration, as on the ranks still training. Gradients are divided by
        the world size (``divide_by_initial_world_size=True``, joined ranks contributing zeros) or by the
        number of ranks still training, as DDP's Join.
        """
        from .. import _backend

        join = _backend.load("join", self._get_fsdp_state().impl).Join
        return join([self], enable, throw_on_early_termination, optimizer=optimizer,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook a joined rank runs each iteration of the others (``optimizer=``,
        ``divide_by_initial_world_size=`` come from ``Join(...)``'s keyword arguments)."""
        return _FSDPJoinHook(self, kwargs.get("optimizer"), kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self._get_fsdp_state().mesh_info.full_group


Joinable.register(FSDPModule)


class _FSDPJoinHook(JoinHook):
    """Shadows one FSDP iteration on a rank that ran out of inputs: replays the group calls of its own last
    iteration (recorded in the comm context), with zero gradients, then steps its shards."""

    def __init__(self, module, optimizer, divide_by_initial_world_size: bool):
        self.module, self.optimizer = module, optimizer
        state = module._get_fsdp_state()
        state.join_options = {"divide_by_initial_world_size": bool(divide_by_initial_world_size)}
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        state = self.module._get_fsdp_state()
        ctx, group = state.comm_ctx, state.mesh_info.full_group
        flags = np.zeros(2 + group.size, dtype=np.int64)
        flags[2 + group.rank] = ctx is None or not ctx.program  # nothing to replay: every rank raises
        group.allreduce(flags, name=JOIN_FLAGS_NAME)
        check_replayable(flags)
        training, syncing = int(flags[0]), bool(flags[1])
        groups = state.groups()
        saved = [(g.reduce_grads, g.gradient_divide_factor) for g in groups]
        for group in groups:
            group.reduce_grads = syncing
            if not self.divide_by_initial_world_size:
                group.gradient_divide_factor = float(training)
        if self.optimizer is not None and syncing:
            self.optimizer.zero_grad()
        try:
            replay(ctx)
        finally:
            for group, (reduce_grads, factor) in zip(groups, saved):
                group.reduce_grads, group.gradient_divide_factor = reduce_grads, factor
        if self.optimizer is not None and syncing:
            self.optimizer.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Nothing to synchronise: each rank's shards were stepped every iteration."""


def replay(ctx) -> None:
    """Run the recorded group calls again, the post-backwards with zero gradients (the same collectives)."""
    program = list(ctx.program)
    ctx.recording = False
    try:
        for group, event, argument in program:
            if event == "pre_forward":
                group.pre_forward(None, ())
            elif event == "post_forward":
                group.post_forward(None, (), None)
            elif event == "pre_backward":
                group.pre_backward(argument)
            elif event == "prefetch":
                group.prefetch_unshard(argument)
            elif event == "post_backward":
                group.join_mask = argument
                try:
                    group.post_backward()
                finally:
                    group.join_mask = None
            elif event == "finalize":
                group.finalize_backward()
            elif event == "unshard":
                group.unshard(argument)
            elif event == "reshard":
                group.reshard()
        for group, _, _ in program:
            group.training_state = TrainingState.IDLE
        ctx.post_forward_order.clear()
    finally:
        ctx.recording = True


def _fsdp_state_of(module):
    if not isinstance(module, FSDPModule):
        raise ValueError(f"Expects FSDPModule but got {type(module).__name__}: apply fully_shard to it first")
    return module._get_fsdp_state()


def _named_param_slots(module, prefix: str):
    """``(key, parameter)`` of every parameter slot, shared ones under each of their names (as state_dict keys)."""
    for key, param in module.named_parameters(prefix, remove_duplicate=False):
        if isinstance(param, Tensor):
            yield key, param
