"""The work still running on the stand-in's streams: NCCL collectives, which complete only once every member
issued them (everything else the stand-in runs completes at once)."""
from __future__ import annotations

import time

__all__ = ["enqueue", "running", "queued_on", "wait_for"]

_queued: dict[int, list] = {}  # stream pointer -> collectives still running on it (anything with ``Test()``)


def enqueue(stream_ptr: int, work) -> None:
    """Queue ``work`` (polled with ``work.Test()``, True once complete) on the stream ``stream_ptr``."""
    _queued.setdefault(int(stream_ptr), []).append(work)


def running(works: list) -> list:
    """The works of ``works`` still running (testing them moves them forward)."""
    return [work for work in works if not work.Test()]


def queued_on(ptr: int) -> list:
    works = running(_queued.pop(ptr, []))
    if works:
        _queued[ptr] = works
    return works


def wait_for(works: list, what: str) -> None:
    """Block until ``works`` complete, at most ``DISTLAB_TIMEOUT`` seconds."""
    if not works:
        return
    from distlab.futures import default_timeout

    timeout = default_timeout()
    deadline = time.monotonic() + timeout
    while works:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(works)} NCCL collectives queued on it did not complete within "
                               f"{timeout:g} s (DISTLAB_TIMEOUT): a member never issued them")
        time.sleep(1e-4)
        works = running(works)
