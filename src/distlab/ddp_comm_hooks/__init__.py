"""DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``), shared by both twins.

A hook is ``hook(state, bucket: GradBucket) -> Future`` whose value is the reduced flat buffer. Register one with
``ddp.register_comm_hook(state, hook)``. With a hook registered the reducer no longer divides gradients by the
world size: the hook does (so a hook can choose to sum, average or compress). As in torch, the default hooks
are in :mod:`~distlab.ddp_comm_hooks.default_hooks` (their state is the process group, or None for the DDP
module's) and PowerSGD in :mod:`~distlab.ddp_comm_hooks.powersgd` (its state a :class:`PowerSGDState`; the module is not
named ``powerSGD_hook`` as torch's, because here that name is the hook itself).
"""
from __future__ import annotations

from .default_hooks import (
    OptimizerHookState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    hook_then_optimizer,
    noop_hook,
    sparse_allreduce,
)
from .powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "sparse_allreduce", "noop_hook",
           "OptimizerHookState", "hook_then_optimizer", "PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]
