"""``cupy.random`` for the stand-in: numpy's generators, their draws put on the "device".

Draws are numpy's, so a seeded stand-in run draws the same numbers as the same seeded numpy run.
"""
from __future__ import annotations

import numpy as np

from . import _transfers
from ._ndarray import wrap

__all__ = ["Generator", "RandomState", "default_rng", "seed", "rand", "randn", "random", "normal", "uniform",
           "randint", "permutation"]


class _Draws:
    """Forwards draws to a numpy generator and returns them on the device."""

    def __init__(self, host):
        self._host = host

    def __getattr__(self, name):
        method = getattr(self._host, name)

        def draw(*args, **kwargs):
            _transfers.count_launch("random")  # cupy draws with a kernel
            return wrap(method(*args, **kwargs))
        return draw


class Generator(_Draws):
    """``cupy.random.Generator`` over ``numpy.random.Generator``."""


class RandomState(_Draws):
    """``cupy.random.RandomState`` over ``numpy.random.RandomState``."""

    def __init__(self, seed=None):
        super().__init__(np.random.RandomState(seed))


def default_rng(seed=None) -> Generator:
    return Generator(np.random.default_rng(seed))


_global = RandomState()


def seed(value=None) -> None:
    _global._host.seed(value)


def rand(*shape):
    return _global.rand(*shape)


def randn(*shape):
    return _global.randn(*shape)


def random(size=None):
    return _global.random_sample(size)


def normal(loc=0.0, scale=1.0, size=None):
    return _global.normal(loc, scale, size)


def uniform(low=0.0, high=1.0, size=None):
    return _global.uniform(low, high, size)


def randint(low, high=None, size=None, dtype=int):
    return _global.randint(low, high, size, dtype)


def permutation(x):
    return _global.permutation(x)
