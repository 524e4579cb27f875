"""Stub of the compiled distlab.core._join (the core twin of distlab.reference.join).

Generated from the reference twin by tests/_stubs.py (do not edit; run ``python tests/_stubs.py``); the
documentation is the reference twin's.
"""
from collections.abc import Sequence
from typing import Any
from distlab.comm import Work
from distlab._common.join import JoinHook as JoinHook
from distlab._common.join import Joinable as Joinable

__all__ = ['JoinHook', 'Joinable', 'Join']


class Join:
    def __init__(self, joinables: Sequence[Joinable], enable: bool=..., throw_on_early_termination: bool=..., **kwargs: Any) -> None: ...
    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None: ...
