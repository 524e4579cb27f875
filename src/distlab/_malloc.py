"""Freed memory kept for the next step: glibc's malloc thresholds, set when a program asks.

A training step allocates and frees the same arrays every step: the activations saved for backward, the
gradients, the update's temporaries. By default glibc's malloc serves a block of 128 KiB or more with ``mmap`` and
unmaps it when freed, and hands the top of its heap back to the kernel once more than 128 KiB lies free there. The
next step then faults every page in again. glibc raises both thresholds by itself, but only when the process frees
a block it had mapped (to that block's size, at most 32 MiB, and twice that for the heap's top). So a step's speed
depends on what the process happened to free before: the benchmarks' model (100 x Linear(256, 256), batch 32)
took about 6,400 page faults a step in a fresh process, some 30% of its time, and none in a process that had
freed a 26 MB buffer.

:func:`keep_freed_memory` puts glibc in that second state from the start, with more room kept: blocks under 32 MiB
(the largest threshold glibc accepts) come from the heap, and up to 256 MiB lying free at the heap's top is kept
rather than returned (glibc's own adjustment stops at 64 MiB, less than a bigger model's step frees). A process
keeps what its steps need anyway; what it freed once and never needs again beyond that goes back to the kernel.
The price: a large array allocated where the process had freed memory before gets that memory's 4 KiB pages, not
the transparent huge pages numpy asks for when it gets fresh memory (MPI reduced such a 26 MB array 10-20% slower
on one host), so big arrays that live long are best allocated early.

It is a process-wide setting, so it is the program's to choose, never an effect of importing distlab: call
``distlab.keep_freed_memory()`` (the benchmarks do), or set ``DISTLAB_MALLOC=keep`` (read when distlab is
imported: ``make demo`` does). ``DISTLAB_MALLOC=system`` (or unset) leaves glibc's defaults, and
``DISTLAB_MALLOC=system`` turns the call into a no-op too, so a job can be measured both ways without editing
it. Nothing is changed either when the C library is not glibc, or when the user has set glibc's own knobs
(``MALLOC_*_`` variables or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``): those win. An allocator preloaded in
glibc's place (jemalloc, tcmalloc) is not glibc's malloc, so these settings do not touch it. PyTorch leaves malloc
alone on the CPU and suggests preloading jemalloc or tcmalloc (``torch.backends.xeon.run_cpu`` does); this needs
nothing installed.
"""
from __future__ import annotations

import os

from ._env import choice

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "is_glibc", "keep_freed_memory", "requested", "STATE"]

#: Blocks smaller than this come from the heap (glibc's largest accepted M_MMAP_THRESHOLD on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top beyond this goes back to the kernel (glibc's default is 128 KiB).
TRIM_THRESHOLD = 256 << 20

# <malloc.h>: mallopt's parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: glibc's environment knobs for the same settings: a user who set one has chosen, and distlab leaves malloc alone.
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def requested() -> str:
    """Return ``DISTLAB_MALLOC``, validated: ``keep``, ``system``, or ``"unset"`` when it is not set (or empty)."""
    if not os.environ.get("DISTLAB_MALLOC", "").strip():
        return "unset"
    return choice("DISTLAB_MALLOC", "keep", ("keep", "system"))


def is_glibc() -> bool:
    """Whether the C library is glibc (whose thresholds these are)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (not POSIX), no such name or None (not glibc)
        return False


def keep_freed_memory() -> str:
    """Have glibc's malloc keep freed memory for the next step, unless told or found not to; return what was done.

    Returns ``"keep"`` (thresholds set), ``"system"`` (``DISTLAB_MALLOC=system``), ``"user"`` (the user set
    glibc's own knobs) or ``"not glibc"``. Process-wide and idempotent: call it once, at the start of a program.
    """
    global STATE
    STATE = _keep_freed_memory()
    return STATE


def _keep_freed_memory() -> str:
    if requested() == "system":
        return "system"
    if any(knob in os.environ for knob in _USER_KNOBS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "user"
    if not is_glibc():
        return "not glibc"
    import ctypes

    libc = ctypes.CDLL(None)
    # The mmap threshold first: setting either one stops glibc's own adjustment of both, as wanted.
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "system"  # refused (an older glibc with a lower ceiling): glibc's defaults stand
    return "keep"


#: What was done: ``"default"`` (nothing: glibc's defaults, the variable unset and no call), or what
#: :func:`keep_freed_memory` returned (when called, or when ``DISTLAB_MALLOC=keep`` asked at import).
STATE = "default"
if requested() == "keep":  # the program asked, through the environment
    keep_freed_memory()
elif requested() == "system":
    STATE = "system"
