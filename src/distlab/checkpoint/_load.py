"""``load``: fill a state dict from a checkpoint saved at any world size (torch's ``state_dict_loader.load``).

Every rank reads the metadata and, for each key of its state dict, works out which saved pieces overlap the block
it holds (its whole array for a replicated value, its block for a :class:`~distlab.ShardedArray`): one read per
overlap, as torch's ``create_default_local_load_plan``. That is all resharding is: a checkpoint saved by 4 ranks
whose blocks split dimension 0 four ways loads on 2 or 3 ranks, whose blocks overlap the saved ones differently.

Nothing is copied before everything checks out, on every rank: each rank checks the keys it asks for (present,
same dtype and global shape: torch's "Missing key in checkpoint state_dict"), the size of each data file it reads,
and the hash of each piece it reads; the ranks then agree, and a single failure anywhere raises
:class:`~distlab.errors.CheckpointException` on every rank, naming the file and the key. Keys the checkpoint holds
and the state dict does not are left alone.
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np

from .._types import ShardedArray
from ..autograd._array import array_module
from ..errors import CheckpointException
from ..timeline import get_timeline, now_us
from . import _storage
from ._flatten import ShardedSlot, flatten
from ._plan import dtype_name, dtype_of
from ._agree import agree, reason, world
from ._save import wait_pending

__all__ = ["load"]


class _Read:
    """One array to fill: ``target`` is the block at ``offsets`` of the saved array ``fqn``."""

    __slots__ = ("fqn", "target", "offsets", "item")

    def __init__(self, fqn, target, offsets, item):
        self.fqn, self.target, self.offsets, self.item = fqn, target, tuple(offsets), item

    def overlaps(self):
        """``(chunk, target slices, chunk slices)`` for each saved chunk this block overlaps."""
        sizes = tuple(int(d) for d in self.target.shape)
        for chunk in self.item["chunks"]:
            lo = [max(a, b) for a, b in zip(self.offsets, chunk["offsets"])]
            hi = [min(a + s, b + t) for a, s, b, t in zip(self.offsets, sizes, chunk["offsets"], chunk["sizes"])]
            if all(low < high for low, high in zip(lo, hi)) or not sizes:
                yield (chunk, tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, self.offsets)),
                       tuple(slice(low - b, high - b) for low, high, b in zip(lo, hi, chunk["offsets"])))


class _Loader:
    def __init__(self, state_dict: dict, directory: Path, rank: int):
        self.directory = directory
        self.rank = rank
        # the state dict first: a stateful's state_dict() may be collective (RNGState), so every rank calls it
        self.entries, self.statefuls = flatten(state_dict, template=True)
        self.metadata = _storage.read_metadata(directory)
        self.items = self.metadata["items"]
        self.reads: list[_Read] = []
        self.objects: list = []  # (entry or (slot dict, keys), item)
        for fqn, entry in self.entries.items():
            if entry.kind == "slot":
                self._plan_slot(entry)
            else:
                self._plan(fqn, entry)
        self.files: dict = {}

    def _item(self, fqn: str) -> dict:
        item = self.items.get(fqn)
        if item is None:
            raise CheckpointException(f"Missing key in checkpoint state_dict: {fqn} (checkpoint "
                                      f"{self.directory / _storage.METADATA})")
        return item

    def _plan(self, fqn: str, entry) -> None:
        if entry.kind == "object" and fqn not in self.items and self._under(list(entry.path)):
            # a value (None, say) where the checkpoint holds a dict: the dict, as a slot would get it
            entry.replace({})
            self._fill(list(entry.path), entry.value, None)
            return
        item = self._item(fqn)
        if entry.kind == "object":
            if item["kind"] != "object":
                raise self._mismatch(fqn, "an object", f"an array {item['dtype']}{item['shape']}")
            self.objects.append((entry, item, fqn))
            return
        if item["kind"] == "object":
            raise self._mismatch(fqn, "an array", "an object")
        block = entry.value if entry.kind == "sharded" else None
        target = block.local if block is not None else entry.value
        shape = block.global_shape if block is not None else tuple(int(d) for d in target.shape)
        if list(shape) != list(item["shape"]) or dtype_name(target.dtype) != item["dtype"]:
            raise self._mismatch(fqn, f"{dtype_name(target.dtype)}{list(shape)}", f"{item['dtype']}{item['shape']}")
        self.reads.append(_Read(fqn, target, block.offsets if block is not None else (0,) * len(shape), item))

    def _mismatch(self, fqn, mine, saved) -> CheckpointException:
        return CheckpointException(f"{fqn!r} does not match the checkpoint: the state dict holds {mine}, the "
                                   f"checkpoint {saved} ({self.directory / _storage.METADATA})")

    def _under(self, prefix: list) -> list:
        """The saved items whose keys start with ``prefix`` (and go deeper)."""
        return [(fqn, item) for fqn, item in self.items.items() if item["path"][:len(prefix)] == prefix
                and len(item["path"]) > len(prefix)]

    def _plan_slot(self, entry) -> None:
        """An empty dict asks for every saved value under its key: make them here, to be filled like the rest
        (nothing saved under it, a parameter without optimizer state: it stays empty)."""
        self._fill(list(entry.path), entry.value, entry.value if isinstance(entry.value, ShardedSlot) else None)

    def _fill(self, prefix: list, target: dict, sharded) -> None:
        for fqn, item in self._under(prefix):
            keys = item["path"][len(prefix):]
            node = target
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            if item["kind"] == "object":
                self.objects.append(((node, keys[-1]), item, fqn))
                continue
            dtype, shape = dtype_of(item["dtype"]), tuple(item["shape"])
            if sharded is not None and shape == sharded.global_shape:
                block = ShardedArray(np.empty(sharded.sizes, dtype), shape, sharded.offsets)
                node[keys[-1]] = block
                self.reads.append(_Read(fqn, block.local, block.offsets, item))
            else:
                node[keys[-1]] = value = np.empty(shape, dtype)
                self.reads.append(_Read(fqn, value, (0,) * len(shape), item))

    def _file(self, name: str) -> _storage.MappedFile:
        mapped = self.files.get(name)
        if mapped is None:
            info = self.metadata["files"].get(name)
            if info is None:
                raise CheckpointException(f"{self.directory / _storage.METADATA} names a piece in {name}, which it "
                                          "does not list among its files: the metadata is corrupt")
            mapped = self.files[name] = _storage.MappedFile(self.directory, name, info)
        return mapped

    def _object_chunk(self, item: dict, fqn: str) -> dict:
        """The saved value of object ``fqn`` for this rank: the one value, or when the ranks saved different
        values, the one this rank's number saved."""
        chunks = item["chunks"]
        mine = [c for c in chunks if self.rank in c.get("ranks", ())]
        if mine:
            return mine[0]
        if len(chunks) == 1:
            return chunks[0]
        raise CheckpointException(f"{fqn!r} holds a different value per rank (saved by ranks "
                                  f"{sorted(r for c in chunks for r in c['ranks'])}), none for rank {self.rank} "
                                  f"({self.directory / _storage.METADATA})")

    def _piece(self, chunk: dict, fqn: str) -> memoryview:
        return self._file(chunk["file"]).piece(chunk["offset"], chunk["length"], chunk["checksum"], fqn)

    def verify(self) -> None:
        """Check the size of every file and the hash of every piece this rank is about to read."""
        for read in self.reads:
            for chunk, _, _ in read.overlaps():
                self._piece(chunk, read.fqn)
        for _, item, fqn in self.objects:
            self._piece(self._object_chunk(item, fqn), fqn)

    def copy(self) -> None:
        for read in self.reads:
            xp = array_module(read.target)
            dtype = read.target.dtype
            for chunk, into, out_of in read.overlaps():
                saved = np.frombuffer(self._piece(chunk, read.fqn), dtype=dtype,
                                      count=math.prod(chunk["sizes"])).reshape(chunk["sizes"])
                part = saved[out_of]
                read.target[into] = part if xp is np else xp.asarray(part)
                del saved, part
        for where, item, fqn in self.objects:
            value = pickle.loads(self._piece(self._object_chunk(item, fqn), fqn))
            if isinstance(where, tuple):
                node, key = where
                node[key] = value
            else:
                where.replace(value)
        for stateful, inner in reversed(self.statefuls):  # the innermost first
            stateful.load_state_dict(inner)

    def close(self) -> None:
        for mapped in self.files.values():
            mapped.close()


def load(state_dict: dict, checkpoint_id, *, group=None) -> None:
    """Fill ``state_dict`` in place from the checkpoint in ``checkpoint_id``; collective over ``group``.

    Arrays are filled in place (a model's live parameters), whatever world size saved them; a
    :class:`~distlab.ShardedArray` receives its block; other values are replaced in their dict; stateful objects
    get ``load_state_dict`` with their filled state dict. An empty dict takes everything saved under its key.

    Raises
    ------
    CheckpointException
        On every rank, before any array was touched, when the checkpoint is missing, partial (no metadata),
        corrupt (a wrong hash, a short file) or does not match the state dict (a missing key, another dtype or
        global shape); the message names the file and the key.
    """
    wait_pending()
    group = world(group)
    directory = Path(checkpoint_id)
    what = f"load from {directory}"
    started = now_us()
    loader = None
    error = None
    try:
        loader = _Loader(state_dict, directory, group.rank)
        loader.verify()
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = reason(exc)
    try:
        agree(group, error, what, "verify")
        try:
            loader.copy()
        except Exception as exc:  # noqa: BLE001 - a stateful's load_state_dict refused what it got
            error = reason(exc)
        agree(group, error, what, "fill")
    finally:
        if loader is not None:
            loader.close()
    get_timeline().complete("checkpoint load", started, now_us(), lane="checkpoint",
                            args={"checkpoint": str(directory)})
