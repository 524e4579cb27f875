"""The rest of a run's state, as stateful objects a checkpoint saves beside the model: :class:`RNGState` and
:class:`TrainState`.

A run resumed from a checkpoint continues as if it had never stopped only if everything its next steps depend on
comes back: the parameters and optimizer state (:func:`~distlab.checkpoint.get_state_dict`), where the sampler is
in the epoch (:meth:`distlab.data.DistributedSampler.state_dict`), every random generator it draws from
(:class:`RNGState`), its counters (step, epoch), and DDP's bucket layout
(:meth:`distlab.DistributedDataParallel.bucket_state_dict`), which decides how the gradients are summed.
:class:`TrainState` bundles them.
"""
from __future__ import annotations

import random

import numpy as np

from .state_dict import get_state_dict, set_state_dict

__all__ = ["RNGState", "TrainState"]


def _generator_state(rng):
    if isinstance(rng, np.random.Generator):
        return rng.bit_generator.state
    if isinstance(rng, np.random.RandomState):
        return rng.get_state()
    return None


def _set_generator_state(rng, state) -> None:
    if isinstance(rng, np.random.Generator):
        rng.bit_generator.state = state
    elif isinstance(rng, np.random.RandomState):
        rng.set_state(state)


class RNGState:
    """Every random generator distlab or numpy draws from on this rank, as a stateful object.

    That is: numpy's global generator (``np.random.seed``, ``np.random.rand``), Python's ``random``, distlab's
    default generator (:func:`distlab.manual_seed`, which initialises parameters), and the generator of every
    module of ``model`` that keeps one (``Dropout``'s ``rng``). Device generators (cupy's) are not included.

    The ranks' states are gathered (``state_dict`` is collective over ``group``) and saved together; on load each
    rank takes back its own. On a run with more ranks than the saved one, the extra ranks keep their generators
    as they are.
    """

    def __init__(self, model=None, group=None):
        self.model = model
        self.group = group

    def _group(self):
        if self.group is None:
            from .. import comm

            self.group = comm.world()
        return self.group

    def _modules(self) -> dict:
        if self.model is None:
            return {}
        return {name: module.rng for name, module in self.model.named_modules()
                if _generator_state(getattr(module, "rng", None)) is not None}

    def local_state(self) -> dict:
        """This rank's generators' states."""
        from ..nn.init import default_generator

        return {"numpy": np.random.get_state(), "python": random.getstate(),
                "distlab": default_generator().bit_generator.state,
                "modules": {name: _generator_state(rng) for name, rng in self._modules().items()}}

    def set_local_state(self, state: dict) -> None:
        from ..nn.init import default_generator

        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        default_generator().bit_generator.state = state["distlab"]
        modules = self._modules()
        for name, saved in state["modules"].items():
            if name in modules:
                _set_generator_state(modules[name], saved)

    def state_dict(self) -> dict:
        everyone = self._group().allgather_object(self.local_state(), name="checkpoint RNG states")
        return {"world_size": len(everyone), "ranks": everyone}

    def load_state_dict(self, state: dict) -> None:
        rank = self._group().rank
        if rank < len(state["ranks"]):
            self.set_local_state(state["ranks"][rank])


class TrainState:
    """A training run's whole state as one stateful object: model, optimizers, DDP buckets, sampler, generators and
    counters (Horovod's ``TorchState(model, optimizer, **kwargs)``).

    Keyword arguments are counters (``step=0, epoch=0``), kept as attributes: ``state.step += 1``. Save it as a
    value of the state dict, ``checkpoint.save({"train": state}, path)``; after ``checkpoint.load`` the model,
    optimizers, sampler and generators are where they were and the counters hold their saved values.

    Parameters
    ----------
    model : distlab.nn.Module or DistributedDataParallel
    optimizers : optimizer or list of them
    sampler : DistributedSampler or ElasticSampler, optional
    rng : bool
        Save and restore the generators (:class:`RNGState` over ``model``).
    group : ProcessGroup, optional
        For the generators' gather (default: the world).
    """

    def __init__(self, model, optimizers=(), *, sampler=None, rng: bool = True, group=None, **counters):
        self.model = model
        self.optimizers = optimizers
        self.sampler = sampler
        self.rng = RNGState(model, group) if rng else None
        self._counters = list(counters)
        for name, value in counters.items():
            setattr(self, name, value)

    def _ddp(self):
        return self.model if callable(getattr(self.model, "bucket_state_dict", None)) else None

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        state = {"model": model_state, "optim": optim_state,
                 "counters": {name: getattr(self, name) for name in self._counters}}
        if self._ddp() is not None:
            state["ddp"] = self._ddp().bucket_state_dict()
        if self.sampler is not None:
            state["sampler"] = self.sampler
        if self.rng is not None:
            state["rng"] = self.rng
        return state

    def load_state_dict(self, state: dict) -> None:
        # the sampler and the generators (stateful values of this dict) were loaded already, innermost first
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if self._ddp() is not None and "ddp" in state:
            self._ddp().load_bucket_state_dict(state["ddp"])
        for name, value in state["counters"].items():
            setattr(self, name, value)
