"""Stub of the compiled distlab.core._fingerprint (the core twin of distlab.reference.fingerprint).

Generated from the reference twin by tests/_stubs.py (do not edit; run ``python tests/_stubs.py``); the
documentation is the reference twin's.
"""
from collections.abc import Sequence
import numpy as np
import numpy.typing as npt
from distlab._common.fingerprint import describe_fingerprint as describe_fingerprint
from distlab._common.fingerprint import fingerprint_groups as fingerprint_groups

__all__ = ['make_fingerprint', 'describe_fingerprint', 'fingerprint_groups', 'find_mismatch']

def make_fingerprint(seq: int, op: str, shape: Sequence[int] | None=..., dtype: npt.DTypeLike=..., root: int=..., reduce_op: str=...) -> np.ndarray: ...
def find_mismatch(table: np.ndarray) -> str | None: ...
