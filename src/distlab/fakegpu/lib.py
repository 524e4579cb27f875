"""``cupy.lib`` for the stand-in: ``stride_tricks.as_strided``, a strided view of the same device memory."""
from __future__ import annotations

import types

import numpy as np

from ._ndarray import ndarray, wrap


def _as_strided(x, shape=None, strides=None):
    """A view of the device array ``x`` with ``shape`` and byte ``strides`` (``cupy.lib.stride_tricks.as_strided``)."""
    if not isinstance(x, ndarray):
        raise TypeError(f"as_strided takes a device array, got {type(x).__name__}")
    return wrap(np.lib.stride_tricks.as_strided(x._a, shape, strides))


stride_tricks = types.SimpleNamespace(as_strided=_as_strided)
