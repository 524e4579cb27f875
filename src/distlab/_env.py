"""Settings read from ``DISTLAB_*`` environment variables that take one of a few words (imports nothing of distlab)."""
from __future__ import annotations

import os

__all__ = ["choice"]


def choice(name: str, default: str, choices: tuple[str, ...], upper: bool = False, environ=None) -> str:
    """Return the environment variable ``name`` (``default`` when unset or empty), trimmed and case-folded.

    ``environ``: the environment to read (a job's, say); default this process's. Raises ValueError naming the
    variable, its value and the accepted words when it is none of ``choices``.
    """
    value = (os.environ if environ is None else environ).get(name, "").strip()
    value = (value.upper() if upper else value.lower()) or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value
