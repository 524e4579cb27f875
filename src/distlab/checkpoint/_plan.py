"""The save plan: which rank writes which piece, where in its file (torch's ``DefaultSavePlanner``).

Every rank describes what it holds (:func:`local_plan`: per key its kind, dtype, global shape and this rank's
block), the descriptions are gathered, and every rank computes the same global plan from them
(:func:`global_plan`), as torch's ``create_global_plan`` does on the coordinator:

- a piece held by one rank (a block of a sharded array, a ZeRO owner's optimizer state) is written by that rank;
- a piece several ranks hold (a replicated array such as DDP's parameters, an object, the same block of a sharded
  array) is written once, by the holder with the fewest bytes planned so far (torch's ``_dedup_save_plans``),
  largest pieces first so that the shares come out even;
- each rank's pieces go into its file back to back, in key order, so every rank knows every piece's offset.

The plan is also where a state dict that cannot be a checkpoint is refused on every rank: a key that is an array
on one rank and something else on another, dtypes or global shapes that differ, blocks that overlap or leave a
hole.
"""
from __future__ import annotations

import math
import pickle

import numpy as np

from ..errors import CheckpointException
from ._flatten import Entry
from ._storage import checksum

__all__ = ["Piece", "local_plan", "global_plan", "dtype_name", "dtype_of"]


def dtype_name(dtype) -> str:
    """A dtype as the metadata spells it: its name when that names it again (``bfloat16`` with ml_dtypes)."""
    dtype = np.dtype(dtype)
    try:
        if np.dtype(dtype.name) == dtype:
            return dtype.name
    except TypeError:
        pass
    return dtype.str


def dtype_of(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 types with numpy

        return np.dtype(name)


class Piece:
    """One thing a rank can write: an array's block (``offsets``, ``sizes``), a whole array, or a pickled object."""

    __slots__ = ("fqn", "path", "kind", "dtype", "shape", "offsets", "sizes", "nbytes", "payload")

    def __init__(self, fqn, path, kind, dtype=None, shape=None, offsets=None, sizes=None, nbytes=0, payload=None):
        self.fqn, self.path, self.kind, self.dtype, self.shape = fqn, path, kind, dtype, shape
        self.offsets, self.sizes, self.nbytes, self.payload = offsets, sizes, nbytes, payload

    def describe(self) -> tuple:
        """What the other ranks need to plan (no data)."""
        return (self.fqn, self.path, self.kind, self.dtype, self.shape, self.offsets, self.sizes, self.nbytes)

    @property
    def chunk(self) -> tuple:
        """What makes two ranks' pieces the same piece."""
        return (self.fqn, self.offsets, self.sizes)


def local_plan(entries: dict) -> list[Piece]:
    """This rank's pieces, from its flat entries (objects are pickled here: the plan needs their size)."""
    pieces = []
    for fqn, entry in entries.items():
        pieces.append(_piece(fqn, entry))
    return pieces


def _piece(fqn: str, entry: Entry) -> Piece:
    if entry.kind == "object":
        payload = pickle.dumps(entry.value, protocol=pickle.HIGHEST_PROTOCOL)
        # the hash stands in the offsets' place: ranks holding equal values hold the same piece
        return Piece(fqn, entry.path, "object", offsets=checksum(payload), nbytes=len(payload), payload=payload)
    if entry.kind == "sharded":
        block = entry.value
        local = block.local
        return Piece(fqn, entry.path, "sharded", dtype_name(local.dtype), block.global_shape, block.offsets,
                     block.sizes, int(local.nbytes), local)
    value = entry.value
    shape = tuple(int(d) for d in value.shape)
    return Piece(fqn, entry.path, "array", dtype_name(value.dtype), shape, (0,) * len(shape), shape,
                 int(value.nbytes), value)


def global_plan(described: list[list[tuple]]) -> tuple[dict, list[list[tuple]], dict]:
    """From every rank's described pieces: ``(items, writes, holders)``.

    ``items`` maps each key to its metadata skeleton (kind, dtype, shape, and its chunks without file places);
    ``writes[rank]`` lists the ``(fqn, offsets, sizes)`` that rank writes, in file order; ``holders`` maps each
    piece to the ranks that hold it (for an object: the ranks that hold that value, when the ranks' values of a
    key differ, each different value is saved once, with the ranks that held it). Raises
    :class:`CheckpointException` (the same on every rank, since every rank computes it) for a state dict that
    cannot be saved.
    """
    world = len(described)
    holders: dict = {}  # chunk -> [ranks]
    info: dict = {}  # fqn -> (kind, dtype, shape)
    paths: dict = {}  # fqn -> its keys
    sizes: dict = {}  # chunk -> nbytes
    for rank, pieces in enumerate(described):
        for fqn, path, kind, dtype, shape, offsets, block, nbytes in pieces:
            paths.setdefault(fqn, list(path))
            mine = ("array" if kind in ("array", "sharded") else "object", dtype, shape)
            seen = info.setdefault(fqn, mine)
            if seen != mine:
                raise CheckpointException(_disagreement(fqn, seen, mine, rank, described))
            if kind != "object" and math.prod(block) == 0:
                continue  # an empty block (a rank past the end of a dimension-0 split) is not written
            chunk = (fqn, offsets, block)
            holders.setdefault(chunk, []).append(rank)
            sizes[chunk] = nbytes
    _check_blocks(info, holders)
    load = [0] * world
    writer = {}
    for chunk, ranks in holders.items():
        if len(ranks) == 1:
            writer[chunk] = ranks[0]
            load[ranks[0]] += sizes[chunk]
    for chunk in sorted((c for c, r in holders.items() if len(r) > 1), key=lambda c: (-sizes[c], c[0], c[1])):
        rank = min(holders[chunk], key=lambda r: (load[r], r))
        writer[chunk] = rank
        load[rank] += sizes[chunk]
    writes = [[] for _ in range(world)]
    for chunk in sorted(writer, key=lambda c: (c[0], c[1] or ())):
        writes[writer[chunk]].append(chunk)
    items = {fqn: {"kind": kind, "dtype": dtype, "shape": list(shape) if shape is not None else None,
                   "path": paths[fqn], "chunks": []} for fqn, (kind, dtype, shape) in sorted(info.items())}
    return items, writes, holders


def _disagreement(fqn, seen, mine, rank, described) -> str:
    first = next(r for r, pieces in enumerate(described) if any(p[0] == fqn for p in pieces))

    def spell(what):
        kind, dtype, shape = what
        return "an object" if kind == "object" else f"an array {dtype}{list(shape)}"

    return (f"the ranks disagree on {fqn!r}: rank {first} holds {spell(seen)}, rank {rank} {spell(mine)} (a "
            "replicated value must be the same on every rank; a sharded one needs the same global shape and dtype)")


def _check_blocks(info: dict, holders: dict) -> None:
    """The blocks of each array tile its global shape: no two overlap unless equal, together they cover it."""
    blocks: dict = {}
    for fqn, offsets, block in holders:
        blocks.setdefault(fqn, []).append((offsets, block))
    for fqn, (kind, _dtype, shape) in info.items():
        if kind == "object":
            continue
        mine = blocks.get(fqn, [])
        for i, (o1, s1) in enumerate(mine):
            for o2, s2 in mine[i + 1:]:
                if all(a < b + t and b < a + s for a, s, b, t in zip(o1, s1, o2, s2)):
                    raise CheckpointException(f"the blocks of {fqn!r} overlap: {list(s1)} at {list(o1)} and "
                                              f"{list(s2)} at {list(o2)} (two ranks hold different blocks that "
                                              "share elements)")
        covered = sum(math.prod(s) for _, s in mine)
        if covered != math.prod(shape):
            raise CheckpointException(f"the blocks of {fqn!r} cover {covered} of its {math.prod(shape)} elements "
                                      f"(global shape {list(shape)}): some rank's block is missing")
