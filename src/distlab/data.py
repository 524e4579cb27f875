"""Sharding a data set across ranks: :class:`DistributedSampler`, index for index the same as PyTorch's.

``torch.utils.data.distributed.DistributedSampler`` gives every rank a disjoint share of the data set, all of the
same length (so that every rank runs the same number of steps and no collective is left waiting). Its
algorithm, which this module reproduces exactly:

1. the index list: ``0 .. n-1``, or with ``shuffle`` a random permutation seeded with ``seed + epoch``
   (``torch.randperm`` with a generator seeded that way: a Fisher-Yates shuffle drawing 32-bit numbers from
   MT19937, which numpy's legacy ``RandomState`` seeding reproduces bit for bit);
2. equal lengths: without ``drop_last`` the list is padded by repeating its head until its length is a multiple
   of the number of replicas; with ``drop_last`` its tail is cut instead;
3. rank ``r`` takes every ``num_replicas``-th index starting at ``r``.

``uneven=True`` (not in torch) skips step 2: each rank keeps its natural share (counts differ by one at most), no
index is repeated and none dropped. Ranks then run different numbers of steps, which is what
:class:`distlab.join.Join` is for.

A sampler remembers where it is in an epoch (``state_dict()``: the epoch and the indices handed out), so a run
resumed from a checkpoint starts with the next batch. :class:`ElasticSampler` (Horovod's) goes further: it splits
what is left of the epoch among however many ranks there are now, so a run restarted on fewer ranks applies every
sample of the epoch exactly once.
"""
from __future__ import annotations

import math
import os
from typing import Iterator

import numpy as np

__all__ = ["DistributedSampler", "ElasticSampler", "randperm"]


def randperm(n: int, seed: int) -> np.ndarray:
    """A random permutation of ``0 .. n-1``, equal to ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``.

    torch's CPU ``randperm`` swaps position ``i`` with ``i + (x % (n - i))`` for ``i`` in ``0 .. n-2``, ``x`` being
    the next 32-bit output of its MT19937 generator; torch seeds MT19937 with the seed's low 32 bits, as numpy's
    legacy ``RandomState(seed)`` does.
    """
    if n < 0:
        raise ValueError(f"randperm needs n >= 0, got {n}")
    draws = np.random.RandomState(seed & 0xFFFFFFFF)._bit_generator.random_raw(max(n - 1, 0)).tolist()
    order = list(range(n))
    for i, draw in enumerate(draws):
        j = i + draw % (n - i)
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)


def _world() -> tuple[int, int]:
    """(rank, size) from the launcher's environment, or from the world process group."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from . import comm

    group = comm.world()
    return group.rank, group.size


class DistributedSampler:
    """The indices of one rank's share of a data set, as ``torch.utils.data.distributed.DistributedSampler``.

    Parameters
    ----------
    num_samples : int or sized
        The data set's length (or a data set: its ``len()`` is taken).
    num_replicas : int, optional
        Number of ranks sharing the data (default: ``WORLD_SIZE`` set by the launcher, else the world group's size).
    rank : int, optional
        This rank (default: ``RANK``, else the world group's rank).
    shuffle : bool
        Shuffle the indices each epoch (seeded with ``seed + epoch``, the same permutation on every rank).
    seed : int
        Base seed; every rank must pass the same.
    drop_last : bool
        Cut the tail so every rank gets ``floor(n / num_replicas)`` indices instead of padding with repeats.
    uneven : bool
        Neither pad nor cut: rank ``r`` gets ``ceil((n - r) / num_replicas)`` indices (distlab only).

    Attributes
    ----------
    num_samples : int
        Indices this rank yields per epoch (torch's meaning of the attribute: per rank, not the data set's length).
    total_size : int
        Indices all ranks yield together per epoch.

    Call :meth:`set_epoch` at the start of every epoch, before iterating, or every epoch sees the same order.
    """

    def __init__(self, num_samples, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, uneven: bool = False):
        size = num_samples if isinstance(num_samples, (int, np.integer)) else len(num_samples)
        if size < 0:
            raise ValueError(f"num_samples must be >= 0, got {size}")
        if num_replicas is None or rank is None:
            world_rank, world_size = _world()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        if drop_last and uneven:
            raise ValueError("drop_last and uneven exclude each other: uneven keeps every index exactly once")
        self.dataset_size = int(size)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last, self.uneven = bool(shuffle), int(seed), bool(drop_last), bool(uneven)
        self.epoch = 0
        self.consumed = 0  # indices of this epoch handed out so far (by __iter__ or batches)
        if uneven:
            self.num_samples = len(range(self.rank, self.dataset_size, self.num_replicas))
            self.total_size = self.dataset_size
        else:
            if drop_last and self.dataset_size % self.num_replicas:
                # torch: ceil((n - R) / R), which equals floor(n / R) here
                self.num_samples = math.ceil((self.dataset_size - self.num_replicas) / self.num_replicas)
            else:
                self.num_samples = math.ceil(self.dataset_size / self.num_replicas)
            self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``seed + epoch`` from now on (every rank must set the same epoch).

        Setting another epoch starts it from its beginning; setting the current one again keeps the position (a
        run resumed mid-epoch sets the epoch it loaded and goes on from the next batch).
        """
        if int(epoch) != self.epoch:
            self.consumed = 0
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        """Where this sampler is: the epoch and the indices of it handed out so far by the pass in progress (a pass
        that ran to its end starts again from the beginning, as torch's sampler does each time it is iterated; a
        torchdata ``StatefulDistributedSampler`` counts the same way), with what fixes the order."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_size": self.dataset_size, "num_replicas": self.num_replicas, "drop_last": self.drop_last,
                "uneven": self.uneven}

    def load_state_dict(self, state: dict) -> None:
        """Go back to where :meth:`state_dict` was taken: the next iteration starts after the indices handed out.

        Raises ValueError for a state of another order (seed, shuffling, data set size) or world size: a
        DistributedSampler's shares depend on the number of ranks; :class:`ElasticSampler` re-splits them.
        """
        for key in ("seed", "shuffle", "dataset_size", "num_replicas", "drop_last", "uneven"):
            if state[key] != getattr(self, key):
                hint = (" (a run resumed on another number of ranks needs distlab.data.ElasticSampler, which splits "
                        "what is left of the epoch among the ranks there are)" if key == "num_replicas" else "")
                raise ValueError(f"DistributedSampler.load_state_dict: the state has {key}={state[key]!r}, this "
                                 f"sampler {key}={getattr(self, key)!r}{hint}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, as an int64 array (what iterating yields from its start)."""
        if self.shuffle:
            order = randperm(self.dataset_size, self.seed + self.epoch)
        else:
            order = np.arange(self.dataset_size, dtype=np.int64)
        if not self.uneven:
            if self.drop_last:
                order = order[: self.total_size]
            elif self.total_size > len(order) and len(order):
                order = np.resize(order, self.total_size)  # repeats the list from its head, as torch's padding
        return order[self.rank:self.total_size:self.num_replicas]

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[np.ndarray]:
        """This epoch's indices in batches of ``batch_size`` (the last one shorter unless ``drop_last``), from the
        position reached so far (see :meth:`state_dict`)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = self.indices()
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for start in range(self.consumed, stop, batch_size):
            batch = order[start:start + batch_size]
            self.consumed = start + len(batch)
            yield batch
        self.consumed = 0  # a pass that ran to its end: the next one starts the epoch again, as torch's

    def __iter__(self) -> Iterator[int]:
        order = self.indices().tolist()
        for position in range(self.consumed, len(order)):
            self.consumed = position + 1
            yield order[position]
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(num_samples={self.dataset_size}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"uneven={self.uneven})")


class ElasticSampler:
    """Horovod's ``ElasticSampler``: the epoch's indices split among the ranks there are now, minus those processed.

    Each epoch's order is :func:`randperm` of ``seed + epoch`` (or ``0 .. n-1``). After ``processed`` of them were
    processed (by all ranks together), rank ``r`` of ``R`` takes every ``R``-th of the rest, starting at ``r``,
    without padding: a step of ``batch_size`` per rank processes the next ``batch_size * R`` indices of the order
    exactly, so the count :meth:`record_batch` keeps names the processed indices whatever the world size, and a run
    that restarts on fewer ranks from a commit neither loses nor repeats a committed sample. (Horovod pads the
    shares by repeating the head of the order, so samples of the last batch are applied twice, and its count
    drifts from the truth after a resize; horovod#3143, #3399.)

    :meth:`batches` gives every rank the same number of batches (the last ones short, or empty, on the ranks whose
    share ran out first), so that data-parallel ranks step together.

    Parameters
    ----------
    dataset : int or sized
        The data set's length (or the data set).
    shuffle, seed
        As :class:`DistributedSampler`'s.
    num_replicas, rank : int, optional
        Default: from the launcher's environment (``WORLD_SIZE``, ``RANK``), read again by :meth:`reset`.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None):
        size = dataset if isinstance(dataset, (int, np.integer)) else len(dataset)
        if size < 0:
            raise ValueError(f"the data set's length must be >= 0, got {size}")
        self.dataset_size, self.shuffle, self.seed = int(size), bool(shuffle), int(seed)
        self._fixed = (num_replicas, rank)
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch among the ranks there are now (after a restart or a resize)."""
        num_replicas, rank = self._fixed
        if num_replicas is None or rank is None:
            world_rank, world_size = _world()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank} of {num_replicas} replicas")
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        order = randperm(self.dataset_size, self.seed + self.epoch) if self.shuffle else \
            np.arange(self.dataset_size, dtype=np.int64)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = len(range(self.rank, len(self.remaining_indices), self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (Horovod: call it at the end of an epoch, for the next one)."""
        self.epoch = int(epoch)
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one step of ``batch_size`` per rank as processed (call it after the step, before a commit)."""
        self.processed_num = min(self.processed_num + int(batch_size) * self.num_replicas, self.dataset_size)

    def indices(self) -> np.ndarray:
        """This rank's share of what is left of the epoch."""
        return self.remaining_indices[self.rank::self.num_replicas]

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """This rank's share in batches of ``batch_size``; every rank gets as many batches as the longest share
        needs (its last ones short or empty), so that the ranks step together."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        mine = self.indices()
        steps = -(-len(range(0, len(self.remaining_indices), self.num_replicas)) // batch_size)
        for step in range(steps):
            yield mine[step * batch_size:(step + 1) * batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` at whatever world size this rank is in now."""
        for key in ("seed", "shuffle", "dataset_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"ElasticSampler.load_state_dict: the state has {key}={state[key]!r}, this sampler "
                                 f"{key}={getattr(self, key)!r}")
        self.epoch, self.processed_num = int(state["epoch"]), int(state["processed_num"])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"ElasticSampler(dataset={self.dataset_size}, shuffle={self.shuffle}, seed={self.seed}, "
                f"epoch={self.epoch}, processed_num={self.processed_num}, rank={self.rank}/{self.num_replicas})")
