"""Bucket assignment (compute_bucket_assignment_by_size, shared by both reducer twins)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab.ddp import compute_bucket_assignment_by_size


def arrays(*specs):
    return [np.zeros(n, dtype=dtype) for n, dtype in specs]


def test_single_limit_closes_at_or_past_it():
    tensors = arrays((4, np.float32), (4, np.float32), (8, np.float32), (1, np.float32))
    buckets, limits = compute_bucket_assignment_by_size(tensors, [32])
    assert buckets == [[0, 1], [2], [3]] and limits == [32, 32, 32]


def test_limit_list_advances_then_repeats():
    tensors = arrays(*[(4, np.float32)] * 7)  # 16 bytes each
    buckets, limits = compute_bucket_assignment_by_size(tensors, [16, 48])
    assert buckets == [[0], [1, 2, 3], [4, 5, 6]] and limits == [16, 48, 48]


def test_dtypes_get_separate_buckets_each_with_its_own_limits():
    tensors = arrays((4, np.float32), (2, np.float64), (4, np.float32), (2, np.float64), (4, np.float32))
    buckets, limits = compute_bucket_assignment_by_size(tensors, [16, 100])
    assert buckets == [[0], [1], [2, 4], [3]]
    assert limits == [16, 16, 100, 100]


def test_sparse_parameters_are_alone():
    tensors = arrays((4, np.float32), (4, np.float32), (4, np.float32))
    buckets, limits = compute_bucket_assignment_by_size(tensors, [1000], [False, True, False])
    assert buckets == [[0, 2], [1]] and limits == [1000, 0]


def test_tensor_indices_keep_arrival_order():
    tensors = arrays((4, np.float32), (4, np.float32), (4, np.float32), (4, np.float32))
    buckets, _ = compute_bucket_assignment_by_size(tensors, [32], None, [3, 2, 1, 0])
    assert buckets == [[3, 2], [1, 0]]
    buckets, _ = compute_bucket_assignment_by_size(tensors, [16, 1000], [False, False, True, False], [3, 2, 1, 0])
    assert buckets == [[3], [2], [1, 0]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one byte limit"):
        compute_bucket_assignment_by_size(arrays((1, np.float32)), [])
    with pytest.raises(ValueError, match="at least one tensor"):
        compute_bucket_assignment_by_size([], [10])
    with pytest.raises(ValueError, match="tensor_indices has 1 entries for 2 tensors"):
        compute_bucket_assignment_by_size(arrays((1, np.float32), (1, np.float32)), [10], None, [0])


specs = st.lists(st.tuples(st.integers(1, 300), st.sampled_from([np.float32, np.float64, np.float16]),
                           st.booleans()), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(specs, st.lists(st.integers(1, 2000), min_size=1, max_size=3), st.booleans())
def test_every_parameter_once_dtypes_never_mixed_sparse_alone(spec, limits, arrival_order):
    tensors = [np.zeros(n, dtype=d) for n, d, _ in spec]
    sparse = [s for _, _, s in spec]
    order = list(range(len(tensors)))[::-1] if arrival_order else None
    ordered = [tensors[i] for i in order] if order else tensors
    buckets, bucket_limits = compute_bucket_assignment_by_size(ordered, limits, sparse, order)
    assert sorted(i for b in buckets for i in b) == list(range(len(tensors)))
    assert len(bucket_limits) == len(buckets)
    for b, limit in zip(buckets, bucket_limits):
        assert len({np.dtype(tensors[i].dtype) for i in b}) == 1
        assert not any(sparse[i] for i in b) or len(b) == 1
        dense_bytes = [tensors[i].nbytes for i in b]
        if not any(sparse[i] for i in b):
            assert sum(dense_bytes[:-1]) < limit  # a bucket closes as soon as it reaches its limit
