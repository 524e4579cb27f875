"""distlab: the machinery inside distributed deep-learning runtimes, re-implemented over MPI.

``distlab.IMPL`` names the active twin (``"core"`` or ``"reference"``, chosen by ``DISTLAB_IMPL``).
"""
from __future__ import annotations

from . import _backend
from ._types import ReduceOp
from .autograd import Tensor, enable_grad, no_grad, tensor
from .nn.init import manual_seed
from . import autograd, nn, optim  # noqa: E402  (the local autograd engine, layers and optimizers)
from .errors import (
    CollectiveMismatchError,
    DistlabError,
    DistTimeoutError,
    ProcessGroupBrokenError,
    RankFailedError,
)

__version__ = "0.1.0"

#: The active twin: "core" (the default, compiled Cython) or "reference" (pure Python).
IMPL: str = _backend.active_impl()

if IMPL == "core":
    # Fail now, with the build hint, rather than at first use (no silent fallback).
    from . import core as _core  # noqa: F401


def run(fn, np=2, args=(), kwargs=None, timeout=None, env=None):
    """Run ``fn(*args, **kwargs)`` on ``np`` MPI ranks and return the per-rank results (see :func:`distlab.launch.run`)."""
    from .launch import run as _run

    return _run(fn, np=np, args=args, kwargs=kwargs, timeout=timeout, env=env)


__all__ = [
    "IMPL",
    "ReduceOp",
    "DistlabError",
    "DistTimeoutError",
    "CollectiveMismatchError",
    "ProcessGroupBrokenError",
    "RankFailedError",
    "run",
    "__version__",
    "Tensor",
    "tensor",
    "no_grad",
    "enable_grad",
    "manual_seed",
    "autograd",
    "nn",
    "optim",
]
