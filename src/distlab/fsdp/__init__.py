"""``distlab.fsdp``: fully sharded data parallel, as PyTorch FSDP2's ``fully_shard`` (ZeRO-2 and ZeRO-3), with
hybrid sharding and Join.

Each rank keeps ``1/W`` of every parameter (its shard, on dimension 0), of its gradient and of the optimizer
state; a group's parameters are all-gathered just before its forward and its backward, and its gradients
reduce-scattered right after its backward, so each rank ends with the averaged gradient of its own shard::

    from distlab.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)               # one parameter group per block: one all-gather, one reduce-scatter
    fully_shard(model)                   # the root last: the parameters no block took
    opt = optim.Adam(model.parameters()) # the shards
    loss_fn(model(x), y).backward()      # every rank ends with its shard of the averaged gradient
    opt.step()

The per-parameter and per-step work (copy-in, copy-out, padding, views, the reduce-scatter's packing and division)
is the twinned component ``fsdp`` (``distlab.reference.fsdp_param_group``, ``distlab.core._fsdp_param_group``,
chosen by ``DISTLAB_IMPL`` or ``fully_shard(impl=...)``); this package is its facade: ``fully_shard``, the
module's hooks (``FSDPState``), ``FSDPModule``'s methods, state dicts and Join.
"""
from .._common.fsdp import MixedPrecisionPolicy
from ._api import fully_shard
from ._mesh import DeviceMesh, init_device_mesh
from ._module import FSDPModule, UnshardHandle
from ._state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "DeviceMesh", "init_device_mesh",
           "StateDictOptions", "get_model_state_dict", "set_model_state_dict"]
