"""Counting the stand-in's host transfers and stream waits, by the distlab module that asked for them.

Every explicit way out of the "device" (``.get()``, ``.item()``, ``float()``, pickling...) and every copy in
(``.set()``, ``xp.asarray(host)``, assigning a host array) is counted under the module that called it: the
nearest caller outside the stand-in (``"distlab.comm.device"``, ``"distlab.nn.functional"``, a test's
``"__main__"``). So a test can say that a component staged through the host where it is expected to
(the comm layer without a CUDA-aware MPI) and nowhere else.
"""
from __future__ import annotations

import sys
from collections import Counter

__all__ = ["count", "transfers", "reset", "total"]

_COUNTS: Counter = Counter()
#: modules whose frames are skipped: the stand-in itself, and distlab's conversion helper (``to_numpy``), so a
#: transfer is counted for the module that asked for it
_SKIPPED = (__name__.rsplit(".", 1)[0], "distlab.autograd._array")


def count(kind: str) -> None:
    """Record one ``kind`` ("to_host", "from_host", "item", "synchronize") for the calling module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_SKIPPED):
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    _COUNTS[(kind, caller)] += 1


def transfers() -> dict:
    """``{(kind, module): count}`` since the last :func:`reset`."""
    return dict(_COUNTS)


def total(kind: str | None = None, prefix: str = "") -> int:
    """How many ``kind`` (all kinds when None) were asked for by modules whose name starts with ``prefix``."""
    return sum(n for (k, module), n in _COUNTS.items()
               if (kind is None or k == kind) and module.startswith(prefix))


def reset() -> None:
    """Forget the counts."""
    _COUNTS.clear()
