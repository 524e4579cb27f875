"""Counting the stand-in's host transfers, stream waits and kernel launches, by the distlab module that asked.

Every explicit way out of the "device" (``.get()``, ``.item()``, ``float()``, pickling...) and every copy in
(``.set()``, ``xp.asarray(host)``, assigning a host array) is counted under the module that called it: the
nearest caller outside the stand-in (``"distlab.comm.device"``, ``"distlab.nn.functional"``, a test's
``"__main__"``). So a test can say that a component staged through the host where it is expected to
(the comm layer without a CUDA-aware MPI) and nowhere else.

Kernel launches are counted the same way, in a tally of their own (:func:`launches`): every operation that would
start work on a real GPU (an element-wise ufunc, a reduction, a matmul, an allocation, a copy, a fill, a fused
:class:`~distlab.fakegpu.ElementwiseKernel`) counts one, by kind. Views (reshape, transpose, basic indexing,
broadcasting) count none, as they launch nothing on cupy either. At a small model's size a GPU step is bound by
these launches (cupy starts a tiny kernel in about 8 us), so their number is what the stand-in can show of it.
"""
from __future__ import annotations

import sys
from collections import Counter

__all__ = ["count", "transfers", "reset", "total", "count_launch", "launches", "launch_total", "round_trips"]

_COUNTS: Counter = Counter()
_LAUNCHES: Counter = Counter()
#: modules whose frames are skipped: the stand-in itself, and distlab's array helpers (``to_numpy``,
#: ``unbroadcast``, the fused kernels' front), so a transfer or a launch is counted for the module that asked for it
_SKIPPED = (__name__.rsplit(".", 1)[0], "distlab.autograd._array", "distlab.autograd._kernels")
#: the transfer kinds that wait for the device: a read to the host, or a synchronize
ROUND_TRIP_KINDS = ("to_host", "item", "synchronize")


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_SKIPPED):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


def count(kind: str) -> None:
    """Record one ``kind`` ("to_host", "from_host", "item", "synchronize") for the calling module."""
    _COUNTS[(kind, _caller())] += 1


def count_launch(kind: str) -> None:
    """Record one kernel launch of ``kind`` ("elementwise", "reduction", "matmul", "alloc", "copy", "fill",
    "random") for the calling module."""
    _LAUNCHES[(kind, _caller())] += 1


def _sum(counts: Counter, kinds, prefix: str) -> int:
    return sum(n for (k, module), n in counts.items()
               if (kinds is None or k in kinds) and module.startswith(prefix))


def transfers() -> dict:
    """``{(kind, module): count}`` of host transfers and stream waits since the last :func:`reset`."""
    return dict(_COUNTS)


def total(kind: str | None = None, prefix: str = "") -> int:
    """How many ``kind`` (all kinds when None) were asked for by modules whose name starts with ``prefix``."""
    return _sum(_COUNTS, None if kind is None else (kind,), prefix)


def round_trips(prefix: str = "") -> int:
    """Host round trips asked for by modules under ``prefix``: reads to the host (``.get()``, ``float()``,
    ``.item()``, ``bool()``...) and synchronizes, each of which stalls the GPU's queue of work."""
    return _sum(_COUNTS, ROUND_TRIP_KINDS, prefix)


def launches() -> dict:
    """``{(kind, module): count}`` of kernel launches since the last :func:`reset`."""
    return dict(_LAUNCHES)


def launch_total(kind: str | None = None, prefix: str = "") -> int:
    """How many launches of ``kind`` (all kinds when None) modules under ``prefix`` made."""
    return _sum(_LAUNCHES, None if kind is None else (kind,), prefix)


def reset() -> None:
    """Forget the counts: transfers and launches."""
    _COUNTS.clear()
    _LAUNCHES.clear()
