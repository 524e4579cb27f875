"""Types shared by the facade and both twins."""
from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


class ReduceOp(str, enum.Enum):
    """Reduction operators of the collectives (as ``torch.distributed.ReduceOp``).

    Every API that takes an ``op`` also accepts the lower-case string (``"sum"``, ``"avg"``, ...).
    """

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"

    @classmethod
    def parse(cls, op) -> "ReduceOp":
        """Return the ``ReduceOp`` for ``op`` (a ``ReduceOp`` or its name, any case)."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            key = op.strip().lower()
            aliases = {"average": "avg", "mean": "avg", "prod": "product", "add": "sum"}
            key = aliases.get(key, key)
            for member in cls:
                if member.value == key:
                    return member
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown reduce op {op!r}; expected a distlab.ReduceOp or one of {valid}")

    def __str__(self) -> str:
        return self.value
