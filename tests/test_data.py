"""DistributedSampler: index for index the same as torch.utils.data.distributed.DistributedSampler.

The expected lists were produced by torch 2.13 (``DistributedSampler(list(range(n)), num_replicas=R, rank=r,
shuffle=..., seed=..., drop_last=...)`` after ``set_epoch(epoch)``); they are torch's algorithm written out.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from distlab.data import DistributedSampler, randperm

# (n, num_replicas, shuffle, seed, epoch, drop_last, indices of rank 0 .. R-1)
TORCH_CASES = [
    (10, 3, False, 0, 0, False, [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]),
    (10, 3, False, 0, 0, True, [[0, 3, 6], [1, 4, 7], [2, 5, 8]]),
    (10, 3, True, 0, 0, False, [[4, 5, 0, 2], [1, 3, 8, 4], [7, 9, 6, 1]]),
    (10, 3, True, 42, 3, False, [[7, 3, 0, 1], [6, 4, 8, 7], [5, 9, 2, 6]]),
    (10, 3, True, 0, 0, True, [[4, 5, 0], [1, 3, 8], [7, 9, 6]]),
    (10, 3, True, 42, 3, True, [[7, 3, 0], [6, 4, 8], [5, 9, 2]]),
    (7, 4, False, 0, 0, False, [[0, 4], [1, 5], [2, 6], [3, 0]]),
    (7, 4, False, 0, 0, True, [[0], [1], [2], [3]]),
    (7, 4, True, 0, 0, False, [[4, 2], [0, 6], [5, 1], [3, 4]]),
    (7, 4, True, 42, 3, False, [[5, 4], [3, 6], [1, 0], [2, 5]]),
    (7, 4, True, 0, 0, True, [[4], [0], [5], [3]]),
    (7, 4, True, 42, 3, True, [[5], [3], [1], [2]]),
    (5, 8, False, 0, 0, False, [[0], [1], [2], [3], [4], [0], [1], [2]]),
    (5, 8, False, 0, 0, True, [[], [], [], [], [], [], [], []]),
    (5, 8, True, 0, 0, False, [[4], [0], [1], [3], [2], [4], [0], [1]]),
    (5, 8, True, 42, 3, False, [[2], [3], [1], [0], [4], [2], [3], [1]]),
    (5, 8, True, 0, 0, True, [[], [], [], [], [], [], [], []]),
    (5, 8, True, 42, 3, True, [[], [], [], [], [], [], [], []]),
    (12, 4, False, 0, 0, False, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    (12, 4, False, 0, 0, True, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    (12, 4, True, 0, 0, False, [[8, 7, 3], [0, 4, 1], [5, 2, 11], [9, 10, 6]]),
    (12, 4, True, 42, 3, False, [[11, 4, 2], [6, 5, 1], [3, 7, 8], [0, 10, 9]]),
    (12, 4, True, 0, 0, True, [[8, 7, 3], [0, 4, 1], [5, 2, 11], [9, 10, 6]]),
    (12, 4, True, 42, 3, True, [[11, 4, 2], [6, 5, 1], [3, 7, 8], [0, 10, 9]]),
    (1, 2, False, 0, 0, False, [[0], [0]]),
    (1, 2, False, 0, 0, True, [[], []]),
    (1, 2, True, 0, 0, False, [[0], [0]]),
    (1, 2, True, 42, 3, False, [[0], [0]]),
    (1, 2, True, 0, 0, True, [[], []]),
    (1, 2, True, 42, 3, True, [[], []]),
]


@pytest.mark.parametrize("n, replicas, shuffle, seed, epoch, drop_last, expected", TORCH_CASES)
def test_indices_equal_torchs(n, replicas, shuffle, seed, epoch, drop_last, expected):
    for rank in range(replicas):
        sampler = DistributedSampler(n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        assert list(sampler) == expected[rank]
        assert len(sampler) == len(expected[rank]) == sampler.num_samples


@pytest.mark.parametrize("n, seed, head, checksum", [
    (1000, 123, [382, 974, 946, 31, 512, 42, 918, 564], 243830905),
    (50000, 2**33 + 9, [6670, 29496, 21200, 27231, 466, 613, 12455, 13254], 31324030956002),  # seed's low 32 bits
])
def test_randperm_equals_torchs(n, seed, head, checksum):
    order = randperm(n, seed)
    assert order[:8].tolist() == head
    assert int(np.dot(np.arange(n, dtype=np.int64), order)) == checksum


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 200), replicas=st.integers(1, 9), shuffle=st.booleans(), drop_last=st.booleans(),
       epoch=st.integers(0, 5))
def test_shares_are_equal_sized_and_cover_the_data(n, replicas, shuffle, drop_last, epoch):
    shares = []
    for rank in range(replicas):
        sampler = DistributedSampler(n, replicas, rank, shuffle=shuffle, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shares.append(sampler.indices())
    assert len({len(s) for s in shares}) == 1
    seen = np.concatenate(shares) if shares else np.empty(0)
    if drop_last:
        assert len(set(seen.tolist())) == len(seen) == n - n % replicas
    else:
        assert set(seen.tolist()) == set(range(n))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 200), replicas=st.integers(1, 9), shuffle=st.booleans())
def test_uneven_shares_take_every_index_once(n, replicas, shuffle):
    shares = [DistributedSampler(n, replicas, rank, shuffle=shuffle, uneven=True).indices() for rank in range(replicas)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(n))
    assert [len(s) for s in shares] == [len(range(rank, n, replicas)) for rank in range(replicas)]


def test_epochs_reshuffle_the_same_way_on_every_rank():
    a, b = DistributedSampler(100, 2, 0), DistributedSampler(100, 2, 1)
    first = np.concatenate([a.indices(), b.indices()])
    a.set_epoch(1), b.set_epoch(1)
    second = np.concatenate([a.indices(), b.indices()])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(100))
    assert first.tolist() != second.tolist()


def test_batches_split_the_share():
    sampler = DistributedSampler(10, 2, 1, shuffle=False)
    assert [b.tolist() for b in sampler.batches(2)] == [[1, 3], [5, 7], [9]]
    assert [b.tolist() for b in sampler.batches(2, drop_last=True)] == [[1, 3], [5, 7]]


def test_a_sized_data_set_and_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = DistributedSampler(list(range(9)), shuffle=False)
    assert (sampler.rank, sampler.num_replicas, list(sampler)) == (1, 3, [1, 4, 7])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_samples=-1, num_replicas=2, rank=0), "num_samples must be >= 0"),
    (dict(num_samples=4, num_replicas=0, rank=0), "num_replicas must be >= 1"),
    (dict(num_samples=4, num_replicas=2, rank=2), r"Invalid rank 2, rank should be in the interval \[0, 1\]"),
    (dict(num_samples=4, num_replicas=2, rank=0, drop_last=True, uneven=True), "exclude each other"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedSampler(**kwargs)
