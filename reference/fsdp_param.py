"""One fully sharded parameter: its shard, its unsharded views, and the moves between them.

Twinned with ``core/_fsdp_param.pxi``. Mirrors torch/distributed/fsdp/_fully_shard/_fsdp_param.py
``FSDPParam``. Four arrays stand for one parameter of shape ``(d0, ...)`` on a shard group of ``W`` ranks:

- the *padded shard* ``sharded_param_data``: this rank's ``c = ceil(d0 / W)`` rows (torch's chunk rule),
  zero-padded, flat; a rank past the end holds only padding;
- the *sharded parameter* ``sharded_param``: a view of the shard's unpadded rows, the ``Parameter`` the modules
  hold between steps and the optimizer updates;
- the *all-gather output* ``all_gather_output``: the ``c * W`` padded rows after the group's all-gather, a view of
  the group's :class:`~distlab._common.fsdp_storage.UnshardedStorage` (freed after forward and backward);
- the *unsharded parameter*: a view of its first ``d0`` rows, the ``Parameter`` the modules hold while the group
  computes, and the one autograd accumulates the unsharded gradient into.

Construction and state dicts are shared functions (:func:`distlab._common.fsdp_param.prepare_param` gives the
set-up whose fields the class keeps, :data:`~distlab._common.fsdp_param.PARAM_STATE`); this module is what runs per
parameter and per step. Guarantees kept: F1, the modules see the whole parameter exactly while their
group is unsharded, and the shard otherwise; F2, the padding rows stay zero, so they add nothing to a reduction.
"""
from __future__ import annotations

from distlab._common.fsdp import ShardedState
from distlab._common.fsdp_param import ParamModuleInfo, prepare_param
from distlab.autograd import Tensor, run_post_accumulate_grad_hooks

__all__ = ["FSDPParam", "ParamModuleInfo"]


class FSDPParam:
    """A parameter sharded on dimension 0 over a group of ranks (``_fsdp_param.py FSDPParam``).

    Parameters
    ----------
    param : distlab.nn.Parameter
        The original parameter; replaced on its modules by the sharded one.
    module_info : ParamModuleInfo
        The ``(module, name)`` places the parameter is registered at.
    shard_size, shard_rank : int
        The shard group's size and this rank's place in it.
    post_forward_size : int
        ``k`` of ``reshard_after_forward=k`` (keep a 1/k piece after forward), or 0.
    mp_policy : distlab.fsdp.MixedPrecisionPolicy
        Mixed precision of the group.
    fqn : str
        The parameter's name, for messages.
    """

    def __init__(self, param, module_info, shard_size, shard_rank, post_forward_size, mp_policy, fqn=""):
        setup = prepare_param(param, module_info, shard_size, shard_rank, post_forward_size, mp_policy, fqn)
        vars(self).update(setup._asdict())  # every field of the set-up, under its own name (PARAM_STATE)
        self.all_gather_output = None
        self.unsharded_accumulated_grad = None
        self.shard_group = None
        self._unsharded_param = None
        self._storage_generation = -1
        self._unsharded_generation = -2
        self._sharded_post_forward_param_data = None
        self.sharded_param._fsdp_param = self
        self._setattr_on_modules(self.sharded_param)

    # -- the all-gather input ------------------------------------------------------------------------------------
    def all_gather_input(self):
        """What this rank contributes to the group's all-gather (``all_gather_inputs``): the padded shard, or after
        a forward with ``reshard_after_forward=k``, its 1/k piece of the unsharded data. Cast to the group's
        ``param_dtype`` on the way into the flat buffer (``foreach_all_gather``), not here."""
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            return self._sharded_post_forward_param_data
        return self.sharded_param_data

    def all_gather_input_numel(self) -> int:
        """Elements of :meth:`all_gather_input`: the padded shard's, or the 1/k piece's."""
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            return self.post_forward_numel
        return self.padded_sharded_numel

    # -- the unsharded parameter ---------------------------------------------------------------------------------
    def set_all_gather_output(self, view, generation) -> None:
        """Point the all-gather output at ``view`` (this parameter's slice of the group storage)."""
        self.all_gather_output = view
        self._storage_generation = generation

    def init_unsharded_param(self) -> None:
        """Make the unsharded ``Parameter`` once, a view of the all-gather output's first ``d0`` rows; later calls
        only re-point it when the storage is a new array (device storage) (``init_unsharded_param``)."""
        if self._unsharded_param is not None and self._unsharded_generation == self._storage_generation:
            return
        view = self.all_gather_output[:self.rows * self.row_numel].reshape(self.orig_size)
        self._unsharded_generation = self._storage_generation
        if self._unsharded_param is None:
            self._unsharded_param = self.param_class(view, requires_grad=self.sharded_param.requires_grad)
            self._unsharded_param._fsdp_param = self
        else:
            self._unsharded_param.data = view

    @property
    def unsharded_param(self):
        """The unsharded ``Parameter`` (None before the first all-gather)."""
        return self._unsharded_param

    def unsharded_grad_data(self):
        """The gradient autograd accumulated into the unsharded parameter, or None."""
        grad = self._unsharded_param.grad if self._unsharded_param is not None else None
        return None if grad is None else grad.data

    # -- state changes -------------------------------------------------------------------------------------------
    def to_sharded(self) -> None:
        """Register the sharded parameter on the modules (``to_sharded``); the group frees the storage."""
        self._setattr_on_modules(self.sharded_param)
        self._sharded_post_forward_param_data = None
        self.sharded_state = ShardedState.SHARDED

    def to_sharded_post_forward(self) -> None:
        """Keep this rank's 1/k piece of the all-gather output, then register the shard (``to_sharded_post_forward``).

        The piece is copied out (``clone``) so the storage can be freed; backward all-gathers the k pieces of the
        rank's post-forward group, consecutive ranks, whose concatenation is the whole all-gather output.
        """
        start = self.post_forward_rank * self.post_forward_numel
        self._sharded_post_forward_param_data = self.all_gather_output[start:start + self.post_forward_numel].copy()
        self._setattr_on_modules(self.sharded_param)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def to_unsharded(self) -> None:
        """Register the unsharded parameter on the modules (``to_unsharded``); ``requires_grad`` follows the shard's
        (``set_requires_grad_if_needed``)."""
        unsharded = self._unsharded_param
        if unsharded.requires_grad != self.sharded_param.requires_grad:
            unsharded.requires_grad = self.sharded_param.requires_grad
        self._setattr_on_modules(unsharded)
        self._sharded_post_forward_param_data = None
        self.sharded_state = ShardedState.UNSHARDED

    def _setattr_on_modules(self, param) -> None:
        """Swap the parameter on every module that holds it (``unsafe_setattr_param``): the registry entry and the
        attribute, in its place."""
        for module, name in self.module_info.places:
            module.register_parameter(name, param)

    # -- gradient accumulation without synchronisation -----------------------------------------------------------
    def to_accumulated_grad_if_needed(self) -> None:
        """Move an unsharded gradient of ``param_dtype`` into ``reduce_dtype`` for accumulation over microbatches
        without a reduction (``to_accumulated_grad_if_needed``): a float16 sum of many microbatches loses bits."""
        unsharded = self._unsharded_param
        if self.reduce_dtype is None or unsharded is None or unsharded.grad is None \
                or unsharded.grad.data.dtype == self.reduce_dtype:
            return
        grad = unsharded.grad.data
        unsharded.grad = None
        self.unsharded_accumulated_grad = grad.astype(self.reduce_dtype)

    def accumulate_unsharded_grad_if_needed(self) -> None:
        """Add this microbatch's gradient into the accumulated one (``accumulate_unsharded_grad_if_needed``)."""
        unsharded = self._unsharded_param
        if self.unsharded_accumulated_grad is not None and unsharded is not None and unsharded.grad is not None:
            self.unsharded_accumulated_grad += unsharded.grad.data
            unsharded.grad = None

    def take_unsharded_grad(self):
        """The gradient to reduce, taken from the parameter (its ``.grad`` becomes None), or None."""
        if self.unsharded_accumulated_grad is not None:
            grad, self.unsharded_accumulated_grad = self.unsharded_accumulated_grad, None
            return grad
        unsharded = self._unsharded_param
        if unsharded is None or unsharded.grad is None:
            return None
        grad = unsharded.grad.data
        unsharded.grad = None
        return grad

    # -- the sharded gradient ------------------------------------------------------------------------------------
    def accumulate_sharded_grad(self, flat) -> None:
        """Give the sharded parameter ``flat`` (its reduced rows, unpadded) as its gradient, or add it to the one
        it has (``foreach_reduce``'s view-out), then run its post-accumulate-grad hooks."""
        param = self.sharded_param
        grad = flat.reshape(self.sharded_size)
        if param.grad is None:
            param.grad = Tensor(grad)
        else:
            param.grad.data += grad
        run_post_accumulate_grad_hooks(param)
