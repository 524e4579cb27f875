"""``Optimizer``: parameter groups, per-parameter state, zero_grad and state_dict (mirrors torch/optim/optimizer.py)."""
from __future__ import annotations

import copy

from ..autograd._array import array_module
from ..autograd.tensor import Tensor, zero_grads
from ._functional import batched, dense_grad, fusable

__all__ = ["Optimizer", "required"]


class _Required:
    def __repr__(self):
        return "<required parameter>"


#: Sentinel for hyper-parameters without a default (torch's ``required``).
required = _Required()


class Optimizer:
    """Base class: subclasses set ``defaults`` through ``__init__`` and implement ``step``.

    Parameters
    ----------
    params : iterable of Tensor, or of dicts
        The parameters, or parameter groups ``{"params": [...], "lr": ...}`` overriding ``defaults``.
    defaults : dict
        Default hyper-parameters of every group.
    """

    def __init__(self, params, defaults: dict):
        self.defaults = defaults
        self.state = {}  # Tensor -> dict (per-parameter state: momentum buffers, Adam moments, step)
        self.param_groups = []
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for group in params:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        """Add a group; missing hyper-parameters take the defaults. A parameter may belong to one group only."""
        group = dict(group)
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {name}")
            group.setdefault(name, default)
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in existing for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient to None (default) or to zeros in place."""
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    def step(self, closure=None):
        """Update every parameter that has a gradient (``_update_in(p, group)``); returns ``closure()`` if given."""
        loss = closure() if closure is not None else None
        with batched():  # fused updates of device parameters: a few multi-tensor launches for all of them
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update_in(p, group)
        return loss

    def step_param(self, param, grad) -> None:
        """Update one parameter with ``grad`` now, as :meth:`step` would (torch's functional optimizers'
        ``step_param``): what :func:`distlab.ddp_comm_hooks.hook_then_optimizer` runs for each parameter of a
        bucket as soon as the bucket is reduced. ``param`` must belong to one of this optimizer's groups."""
        group = self._group_of(param)
        kept = param.grad
        param.grad = grad if isinstance(grad, Tensor) else Tensor._wrap(grad)
        try:
            self._update_in(param, group)
        finally:
            param.grad = kept

    def _group_of(self, param) -> dict:
        # step_param runs once per parameter per step: a map by id, built on first use and rebuilt on a miss
        # (a parameter added since, by add_param_group or to a group's list) or when its group was replaced
        groups = self.__dict__.get("_group_by_param")
        group = groups.get(id(param)) if groups is not None else None
        if group is None or not any(g is group for g in self.param_groups):
            groups = self._group_by_param = {id(p): g for g in self.param_groups for p in g["params"]}
            group = groups.get(id(param))
        if group is not None:
            return group
        raise ValueError(f"step_param: the parameter (shape {tuple(param.shape)}) is not in any of this "
                         f"{type(self).__name__}'s parameter groups")

    def _update_in(self, p, group) -> None:
        """``step``'s update of one parameter of ``group`` (an optimizer whose ``_update`` takes other arguments
        overrides this)."""
        self._update(p, group)

    def _update(self, p, group) -> None:
        raise NotImplementedError

    def _state(self, p, group) -> dict:
        """``p``'s state, made by ``_init_state`` on first use (torch makes it lazily too, for most optimizers)."""
        state = self.state.get(p)
        if state is None:
            state = self.state[p] = self._init_state(p, group, array_module(p.data))
        return state

    def _init_state(self, p, group, xp) -> dict:
        raise NotImplementedError

    def _begin_dense(self, p, group, weight_decay=None) -> tuple:
        """The start of a dense update: ``(state, grad)``, ``p``'s state with its step counted, and the gradient as
        :func:`~distlab.optim._functional.dense_grad` gives it (``weight_decay`` None: the group's), or None when
        the update runs fused. A sparse gradient raises before any state is made."""
        grad = None
        if not fusable(group.get("fused"), p):
            decay = group["weight_decay"] if weight_decay is None else weight_decay
            grad = dense_grad(self, p, group["maximize"], decay)
        state = self._state(p, group)
        state["step"] += 1
        return state, grad

    def _params_with_grad(self, group):
        return [p for p in group["params"] if p.grad is not None]

    # -- state_dict: parameters are replaced by their position across groups, as torch does ------------------------
    def state_dict(self) -> dict:
        """Return ``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}`` (arrays not copied)."""
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        params = [p for g in self.param_groups for p in g["params"]]
        state = {index[id(p)]: self.state[p] for p in params if p in self.state}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state produced by :meth:`state_dict` of an optimizer over parameters of the same shapes."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(own["params"]) for g, own in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        params = [p for g in self.param_groups for p in g["params"]]
        self.state = {}
        for idx, st in state_dict["state"].items():
            p = params[int(idx)]
            self.state[p] = {k: (v.copy() if hasattr(v, "copy") and not isinstance(v, (int, float)) else v)
                             for k, v in st.items()}
        for own, saved in zip(self.param_groups, groups):
            own.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})

    def __repr__(self) -> str:
        lines = [type(self).__name__ + " ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params"]
        return "\n".join(lines + [")"])
