"""Shared by both RRef twins (distlab.reference.rref and distlab.core._rref): sentinels with a stable repr."""
from __future__ import annotations

__all__ = ["UNSET"]


class _Unset:
    """The "no value yet" default of ``OwnerRRef(value=UNSET)`` (None is a valid value)."""

    __slots__ = ()

    def __repr__(self):
        return "UNSET"

    def __reduce__(self):
        return "UNSET"


UNSET = _Unset()
