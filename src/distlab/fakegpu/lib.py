"""``cupy.lib`` for the stand-in: ``stride_tricks.as_strided``, a strided view of the same device memory."""
from __future__ import annotations

import types as _types

import numpy as _np

from ._ndarray import ndarray as _ndarray
from ._ndarray import wrap as _wrap


def _as_strided(x, shape=None, strides=None):
    """A view of the device array ``x`` with ``shape`` and byte ``strides`` (``cupy.lib.stride_tricks.as_strided``)."""
    if not isinstance(x, _ndarray):
        raise TypeError(f"as_strided takes a device array, got {type(x).__name__}")
    return _wrap(_np.lib.stride_tricks.as_strided(x._a, shape, strides))


stride_tricks = _types.SimpleNamespace(as_strided=_as_strided)
