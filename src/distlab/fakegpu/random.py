"""``cupy.random`` for the stand-in: numpy's generators, their draws put on the "device".

Draws are numpy's, so a seeded stand-in run draws the same numbers as the same seeded numpy run. Only the draws
cupy's classes have are there (cupy's ``Generator`` has no ``normal``, ``choice`` or ``permutation``, for
instance): code that draws on the stand-in draws on cupy too.
"""
from __future__ import annotations

import inspect as _inspect

import numpy as np

from . import _transfers
from ._ndarray import wrap as _wrap

__all__ = ["Generator", "RandomState", "default_rng", "seed", "rand", "randn", "random", "normal", "uniform",
           "randint", "permutation"]

#: the draws of cupy 14's ``cupy.random.Generator`` (numpy's has more), but standard_exponential, whose default
#: ``method`` is numpy's "zig" and cupy's "inv"
_GENERATOR_DRAWS = ("beta", "binomial", "chisquare", "dirichlet", "exponential", "f", "gamma", "geometric",
                    "hypergeometric", "integers", "logseries", "poisson", "power", "random", "standard_gamma",
                    "standard_normal", "uniform")
#: the draws of cupy 14's ``cupy.random.RandomState`` that numpy's has too, with the same parameters
#: (multivariate_normal's ``check_valid`` and permutation's parameter differ: left out)
_RANDOM_STATE_DRAWS = ("beta", "binomial", "chisquare", "choice", "dirichlet", "exponential", "f", "gamma",
                       "geometric", "gumbel", "hypergeometric", "laplace", "logistic", "lognormal", "logseries",
                       "negative_binomial", "noncentral_chisquare", "noncentral_f", "normal",
                       "pareto", "poisson", "power", "rand", "randint", "randn", "random_sample",
                       "rayleigh", "standard_cauchy", "standard_exponential", "standard_gamma", "standard_normal",
                       "standard_t", "tomaxint", "triangular", "uniform", "vonmises", "wald", "weibull", "zipf")


def _draw(host_type, name: str):
    """The draw ``name`` of numpy's ``host_type``, its result put on the device (one counted launch)."""
    def draw(self, *args, **kwargs):
        _transfers.count_launch("random")  # cupy draws with a kernel
        return _wrap(getattr(self._host, name)(*args, **kwargs))
    draw.__name__ = name
    try:
        draw.__signature__ = _inspect.signature(getattr(host_type, name))
    except (TypeError, ValueError):
        pass
    return draw


class Generator:
    """``cupy.random.Generator(bit_generator)`` over ``numpy.random.Generator`` (a numpy bit generator)."""

    def __init__(self, bit_generator):
        self._host = np.random.Generator(bit_generator)


class RandomState:
    """``cupy.random.RandomState(seed=None)`` over ``numpy.random.RandomState``."""

    def __init__(self, seed=None):
        self._host = np.random.RandomState(seed)

    def seed(self, seed=None) -> None:
        self._host.seed(seed)


for _name in _GENERATOR_DRAWS:
    setattr(Generator, _name, _draw(np.random.Generator, _name))
for _name in _RANDOM_STATE_DRAWS:
    if hasattr(np.random.RandomState, _name):
        setattr(RandomState, _name, _draw(np.random.RandomState, _name))


def default_rng(seed=None) -> Generator:
    """A generator drawing as ``numpy.random.default_rng(seed)`` does (cupy's draws with XORWOW)."""
    return Generator(np.random.PCG64(seed))


_global = RandomState()


def seed(seed=None) -> None:
    _global.seed(seed)


def rand(*size, **kwarg):
    return _global.rand(*size, **kwarg)


def randn(*size, **kwarg):
    return _global.randn(*size, **kwarg)


def random(size=None):
    return _global.random_sample(size)


def normal(loc=0.0, scale=1.0, size=None):
    return _global.normal(loc, scale, size)


def uniform(low=0.0, high=1.0, size=None):
    return _global.uniform(low, high, size)


def randint(low, high=None, size=None, dtype="l"):
    return _global.randint(low, high, size, dtype)


def permutation(a):
    _transfers.count_launch("random")
    return _wrap(_global._host.permutation(a))
