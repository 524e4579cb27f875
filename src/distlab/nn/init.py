"""Parameter initialisation and the default random generator (mirrors torch.nn.init and ``torch.manual_seed``).

Unlike torch, the default generator starts from seed 0, so an unseeded program is reproducible and every MPI rank
builds the same initial model (DDP still broadcasts rank 0's parameters, as torch's does).
"""
from __future__ import annotations

import math

import numpy as np

from ..autograd._array import is_cupy

__all__ = ["manual_seed", "default_generator", "resolve_rng", "uniform_", "normal_", "zeros_", "ones_",
           "kaiming_uniform_", "calculate_fan_in"]

_generator = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the default generator used by layers created without ``seed=``; returns it."""
    global _generator
    _generator = np.random.default_rng(seed)
    return _generator


def default_generator() -> np.random.Generator:
    """The generator layers use when they are given no ``seed``."""
    return _generator


def resolve_rng(seed=None) -> np.random.Generator:
    """Turn ``seed`` (None, an int, or a Generator) into a Generator (None means the default generator)."""
    if seed is None:
        return _generator
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def _fill(tensor, values) -> None:
    """Write host ``values`` into ``tensor.data`` in place (works for numpy and cupy data)."""
    data = tensor.data
    if is_cupy(data):
        data.set(values.astype(data.dtype))
    else:
        data[...] = values


def calculate_fan_in(shape) -> int:
    """Fan-in as torch computes it: ``shape[1] * prod(shape[2:])`` (1-D tensors: ``shape[0]``)."""
    if len(shape) < 2:
        return int(shape[0])
    return int(shape[1] * int(np.prod(shape[2:], dtype=np.int64)))


def uniform_(tensor, low: float = 0.0, high: float = 1.0, rng=None):
    _fill(tensor, resolve_rng(rng).uniform(low, high, tensor.shape))
    return tensor


def normal_(tensor, mean: float = 0.0, std: float = 1.0, rng=None):
    _fill(tensor, resolve_rng(rng).normal(mean, std, tensor.shape))
    return tensor


def zeros_(tensor):
    tensor.data[...] = 0
    return tensor


def ones_(tensor):
    tensor.data[...] = 1
    return tensor


def kaiming_uniform_(tensor, a: float = 0.0, rng=None):
    """He-uniform: bound = gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a^2)) (leaky-ReLU gain)."""
    gain = math.sqrt(2.0 / (1 + a * a))
    bound = gain * math.sqrt(3.0 / calculate_fan_in(tensor.shape))
    return uniform_(tensor, -bound, bound, rng)
