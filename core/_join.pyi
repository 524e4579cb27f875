"""Stub of the compiled distlab.core._join (the core twin of distlab.reference.join).

Generated from the reference twin by tests/_stubs.py (do not edit; run ``python tests/_stubs.py``); the
documentation is the reference twin's.
"""

__all__ = ['JoinHook', 'Joinable', 'Join']

from distlab._common.join import JoinHook as JoinHook
from distlab._common.join import Joinable as Joinable

class Join:
    def __init__(self, joinables, enable=..., throw_on_early_termination=..., **kwargs): ...
    @staticmethod
    def notify_join_context(joinable): ...
