"""Types shared by the facade and both twins."""
from __future__ import annotations

import dataclasses
import enum

__all__ = ["ReduceOp", "ShardedArray"]


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


@dataclasses.dataclass(frozen=True)
class ShardedArray:
    """One rank's block of a larger array, and where the block sits in it.

    What a sharded state dict holds in place of a whole array: the sharded modules' ``state_dict()`` gives each
    rank its blocks this way, without communication, and ``distlab.checkpoint`` writes and reshards them. It plays
    the part of a ``DTensor`` with a ``Shard`` placement in a torch state dict, and of the chunk metadata
    (offsets, sizes) that ``torch.distributed.checkpoint`` keeps per saved block.

    Parameters
    ----------
    local : array
        This rank's block (numpy or a device array), without padding; it may be empty (a rank past the end of a
        dimension 0 split by torch's chunk rule holds no rows).
    global_shape : tuple of int
        The shape of the whole array.
    offsets : tuple of int
        Where ``local[0, 0, ...]`` sits in the whole array, one offset per dimension.
    """

    local: object
    global_shape: tuple
    offsets: tuple

    def __post_init__(self):
        shape = tuple(int(d) for d in self.global_shape)
        offsets = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)
        sizes = tuple(int(d) for d in getattr(self.local, "shape", ()))
        if not (len(shape) == len(offsets) == len(sizes)):
            raise ValueError(f"ShardedArray: a block of shape {sizes} with offsets {offsets} does not fit an array "
                             f"of shape {shape} (their lengths differ)")
        for dim, (size, offset, whole) in enumerate(zip(sizes, offsets, shape)):
            if offset < 0 or size < 0 or offset + size > whole:
                raise ValueError(f"ShardedArray: a block of shape {sizes} at offsets {offsets} does not fit an "
                                 f"array of shape {shape} (dimension {dim}: {offset} + {size} > {whole})")

    @property
    def sizes(self) -> tuple:
        """The block's shape (``local.shape``)."""
        return tuple(int(d) for d in self.local.shape)

    def slices(self) -> tuple:
        """The block's place in the whole array, as a tuple of slices (``whole[block.slices()] = block.local``)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))
