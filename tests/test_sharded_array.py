"""distlab.ShardedArray: one rank's block of a larger array, as sharded state dicts hold it."""
import numpy as np
import pytest

import distlab


def test_a_block_knows_its_place_in_the_whole_array():
    whole = np.arange(24.0).reshape(6, 4)
    block = distlab.ShardedArray(whole[2:4], global_shape=(6, 4), offsets=(2, 0))
    assert block.sizes == (2, 4)
    assert block.global_shape == (6, 4) and block.offsets == (2, 0)
    rebuilt = np.zeros_like(whole)
    rebuilt[block.slices()] = block.local
    np.testing.assert_array_equal(rebuilt[2:4], whole[2:4])
    assert not rebuilt[:2].any() and not rebuilt[4:].any()


def test_an_empty_block_past_the_end_is_allowed():
    # torch's chunk rule: d0=6 over W=4 gives 2, 2, 2, 0 rows; the last rank holds an empty block
    block = distlab.ShardedArray(np.zeros((0, 3)), global_shape=(6, 3), offsets=(6, 0))
    assert block.sizes == (0, 3)
    assert block.slices() == (slice(6, 6), slice(0, 3))


@pytest.mark.parametrize("local, shape, offsets, words", [
    (np.zeros((2, 4)), (6, 4), (5, 0), "dimension 0: 5 + 2 > 6"),
    (np.zeros((2, 4)), (6, 4), (0,), "their lengths differ"),
    (np.zeros((2, 4)), (6, 4), (-1, 0), "does not fit"),
])
def test_a_block_that_does_not_fit_is_refused_in_words(local, shape, offsets, words):
    with pytest.raises(ValueError, match="ShardedArray") as info:
        distlab.ShardedArray(local, global_shape=shape, offsets=offsets)
    assert words in str(info.value)
