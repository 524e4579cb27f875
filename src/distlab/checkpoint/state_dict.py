"""``get_state_dict`` / ``set_state_dict``: a model's and its optimizers' state keyed by parameter name
(torch/distributed/checkpoint/state_dict.py).

A torch optimizer's own ``state_dict()`` numbers the parameters (0, 1, 2 ...), which means nothing to a run with
another world size or another partition: ZeroRedundancyOptimizer keeps on each rank the state of the parameters
that rank owns, and owners change with the world size. Here, as in torch's ``get_state_dict``, the optimizer
state is keyed by each parameter's fully qualified name in the model::

    model: {"fc.weight": array, ...}                      # the module's state_dict (DDP's "module." removed)
    optim: {"state": {"fc.weight": {"step": 3, "exp_avg": array, ...}, ...},
            "param_groups": [{"lr": 0.01, ..., "params": ["fc.weight", "fc.bias"]}, ...]}

- A replicated optimizer (beside DDP, or the Horovod-style ``DistributedOptimizer``) holds every parameter's
  state on every rank: the checkpoint writes each array once.
- A ZeroRedundancyOptimizer holds on each rank the state of the parameters it owns: each is written by its owner,
  and read back by whichever rank owns it at load time, at any world size.
- A sharded parameter (its entry in the model's state dict is a :class:`~distlab.ShardedArray`) has its optimizer
  state wrapped in ShardedArrays of the same global shape and offsets, so it is resharded like the parameter.

A parameter this rank manages but whose state does not exist yet (a fresh optimizer, before its first step) gets an
empty dict, which :func:`~distlab.checkpoint.load` fills with whatever the checkpoint holds for it; so the state
dict of a freshly built model and optimizer is the template to load into.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._types import ShardedArray
from ..autograd._array import array_module
from ._flatten import ShardedSlot, is_array

__all__ = ["get_state_dict", "set_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "StateDictOptions"]


@dataclass
class StateDictOptions:
    """Options of :func:`get_state_dict` (torch's ``StateDictOptions``; the defaults are the same).

    ``full_state_dict=True`` gives whole arrays (a sharded parameter's blocks gathered on every rank) instead of
    ShardedArrays; ``cpu_offload=True`` gives host copies of device arrays. ``strict`` (for ``set_state_dict``)
    refuses missing or unexpected keys.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True


def _module_of(model):
    """The wrapped module of a DistributedDataParallel (its state dict has no "module." prefix), else the model."""
    from ..ddp import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _as_list(optimizers) -> list:
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def _parts(optimizer):
    """``(groups, local, managed)``: the param groups every rank shares, the optimizer holding the state, and the
    parameters whose state this rank holds."""
    from ..optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "optimizer", None)  # the Horovod-style DistributedOptimizer wraps one
    if inner is not None and hasattr(inner, "param_groups") and hasattr(inner, "state"):
        optimizer = inner
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        managed = [p for group in optimizer.optim.param_groups for p in group["params"]]
        return optimizer.param_groups, optimizer.optim, managed
    managed = [p for group in optimizer.param_groups for p in group["params"]]
    return optimizer.param_groups, optimizer, managed


def _names(module) -> dict:
    return {id(p): name for name, p in module.named_parameters()}


def get_model_state_dict(model, *, options: StateDictOptions | None = None) -> dict:
    """The model's state dict by parameter and buffer name (live arrays; ShardedArrays for sharded ones)."""
    options = options or StateDictOptions()
    state = dict(_module_of(model).state_dict())
    if options.full_state_dict or options.cpu_offload:
        state = {k: _converted(v, options) for k, v in state.items()}
    return state


def _converted(value, options):
    from ..autograd._array import to_numpy

    if isinstance(value, ShardedArray) and options.full_state_dict:
        raise NotImplementedError("full_state_dict=True with sharded parameters: gather them with the sharded "
                                  "module's own full-state-dict call, or save sharded and load at any world size")
    if options.cpu_offload and is_array(value):
        return to_numpy(value).copy()
    return value


def get_optimizer_state_dict(model, optimizers, *, options: StateDictOptions | None = None) -> dict:
    """``{"state": {param name: {...}}, "param_groups": [...]}`` for one optimizer or several (merged)."""
    options = options or StateDictOptions()
    module = _module_of(model)
    names = _names(module)
    model_state = module.state_dict()
    state, groups = {}, []
    for optimizer in _as_list(optimizers):
        shared_groups, local, managed = _parts(optimizer)
        for group in shared_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [_name(names, p) for p in group["params"]]
            groups.append(packed)
        for p in managed:
            name = _name(names, p)
            block = model_state.get(name)
            block = block if isinstance(block, ShardedArray) else None
            saved = local.state.get(p)
            if not saved:
                state[name] = ShardedSlot(block.global_shape, block.offsets, block.sizes) if block else {}
                continue
            state[name] = {key: _wrapped(value, block, options) for key, value in saved.items()}
    return {"state": state, "param_groups": groups}


def _name(names: dict, p) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise ValueError(f"an optimizer holds a parameter (shape {tuple(p.shape)}) that is not one of the model's "
                         "parameters: pass the model the optimizer trains") from None


def _wrapped(value, block, options):
    if block is not None and is_array(value) and tuple(value.shape) == block.sizes:
        return ShardedArray(value, block.global_shape, block.offsets)
    return _converted(value, options)


def get_state_dict(model, optimizers=(), *, options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """``(model state dict, optimizer state dict)``, both keyed by parameter name (see the module docstring).

    Examples
    --------
    >>> model_sd, optim_sd = get_state_dict(ddp_model, optimizer)                 # doctest: +SKIP
    >>> checkpoint.save({"model": model_sd, "optim": optim_sd}, "ckpt/step-100")  # doctest: +SKIP
    """
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def set_model_state_dict(model, model_state_dict: dict, *, options: StateDictOptions | None = None):
    """Load ``model_state_dict`` into the model (arrays already filled in place by a load are left as they are)."""
    options = options or StateDictOptions()
    module = _module_of(model)
    live = module.state_dict()
    pending = {k: v for k, v in model_state_dict.items() if not (k in live and _same(v, live[k]))}
    missing = [k for k in live if k not in model_state_dict]
    unexpected = [k for k in model_state_dict if k not in live]
    if options.strict and (missing or unexpected):
        raise ValueError(f"set_state_dict: the model state dict does not fit the model: missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    if pending:
        module.load_state_dict({k: (v.local if isinstance(v, ShardedArray) and not isinstance(live.get(k), ShardedArray)
                                    else v) for k, v in pending.items()}, strict=False)


def _same(value, live) -> bool:
    """``value`` is the live array (or block) itself: a load filled it in place, nothing to copy."""
    if isinstance(value, ShardedArray) and isinstance(live, ShardedArray):
        return value.local is live.local
    return value is live


def set_optimizer_state_dict(model, optimizers, optim_state_dict: dict, *,
                             options: StateDictOptions | None = None) -> None:
    """Give each optimizer the state of the parameters it manages, and every group its hyper-parameters."""
    module = _module_of(model)
    names = _names(module)
    saved_groups = list(optim_state_dict.get("param_groups", []))
    saved_state = optim_state_dict.get("state", {})
    for optimizer in _as_list(optimizers):
        shared_groups, local, managed = _parts(optimizer)
        mine, saved_groups = saved_groups[:len(shared_groups)], saved_groups[len(shared_groups):]
        if len(mine) != len(shared_groups):
            raise ValueError(f"set_state_dict: the optimizer state dict has {len(mine)} parameter groups left for an "
                             f"optimizer with {len(shared_groups)}")
        for index, (own, saved) in enumerate(zip(shared_groups, mine)):
            expected = [_name(names, p) for p in own["params"]]
            if list(saved["params"]) != expected:
                raise ValueError(f"set_state_dict: parameter group {index} holds {list(saved['params'])} in the "
                                 f"state dict but {expected} in the optimizer")
            own.update({k: v for k, v in saved.items() if k != "params"})
        for own, local_group in zip(shared_groups, local.param_groups):
            if own is not local_group:  # ZeroRedundancyOptimizer: its local optimizer's groups follow its own
                local_group.update({k: v for k, v in own.items() if k != "params"})
        for p in managed:
            saved = saved_state.get(_name(names, p))
            if saved:
                local.state[p] = _state_for(p, saved, local.state.get(p))


def _state_for(p, saved: dict, live: dict | None) -> dict:
    """``saved`` as the state of ``p``: arrays on ``p``'s device, filled into the live arrays where they fit."""
    xp = array_module(p.data)
    state = {}
    for key, value in saved.items():
        value = value.local if isinstance(value, ShardedArray) else value
        current = (live or {}).get(key)
        if is_array(value):
            if current is value:
                state[key] = current
            elif is_array(current) and current.shape == value.shape and current.dtype == value.dtype:
                current[...] = value if array_module(value) is xp else xp.asarray(value)
                state[key] = current
            else:
                state[key] = value if array_module(value) is xp else xp.asarray(value)
        else:
            state[key] = value
    return state


def set_state_dict(model, optimizers=(), *, model_state_dict: dict, optim_state_dict: dict,
                   options: StateDictOptions | None = None) -> None:
    """Load what :func:`get_state_dict` gave (after :func:`~distlab.checkpoint.load` filled it) into the model and
    its optimizers."""
    set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
