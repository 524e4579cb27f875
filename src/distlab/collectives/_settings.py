"""The settings of distlab.collectives, read from the environment (Horovod's defaults)."""
from __future__ import annotations

import os

__all__ = ["settings"]


def _env_number(name: str, default, kind=float, minimum=0.0, unit=""):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {'whole ' if kind is int else ''}number{unit}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}{unit}")
    return value


def settings() -> dict:
    """The settings :func:`init` would use now, read from the environment (validated)."""
    return {
        "cache_capacity": _env_number("DISTLAB_CACHE_CAPACITY", 1024, int, 0),
        "fusion_threshold": _env_number("DISTLAB_FUSION_THRESHOLD", 128 * 1024 * 1024, int, 0, " bytes"),
        "cycle_time_ms": _env_number("DISTLAB_CYCLE_TIME", 1.0, float, 0.0, " ms"),
        "stall_check_time": _env_number("DISTLAB_STALL_CHECK_TIME", 60.0, float, 0.0, " s"),
        "stall_shutdown_time": _env_number("DISTLAB_STALL_SHUTDOWN_TIME", 0.0, float, 0.0, " s"),
    }
