"""The collective fingerprint twins (what DISTLAB_DEBUG=DETAIL compares): behaviour and twin equivalence."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import _backend
from distlab._wire import COLLECTIVE_OPS, FINGERPRINT_MAX_DIMS, FINGERPRINT_WORDS, REDUCE_OP_CODES


def test_layout_and_description(fingerprint):
    words = fingerprint.make_fingerprint(7, "allreduce", (4, 3), np.float32, -1, "sum")
    assert words.dtype == np.int64 and words.shape == (FINGERPRINT_WORDS,)
    assert fingerprint.describe_fingerprint(words) == "#7 allreduce(sum) float32[4, 3]"
    barrier = fingerprint.make_fingerprint(2, "barrier")
    assert fingerprint.describe_fingerprint(barrier) == "#2 barrier"
    bcast = fingerprint.make_fingerprint(3, "broadcast", (), "int64", 1)
    assert fingerprint.describe_fingerprint(bcast) == "#3 broadcast int64[] root=1"


def test_matching_table_has_no_mismatch(fingerprint):
    row = fingerprint.make_fingerprint(1, "allgather", (8,), np.int32)
    assert fingerprint.find_mismatch(np.stack([row] * 4)) is None


def test_mismatch_names_every_group(fingerprint):
    rows = [fingerprint.make_fingerprint(5, "allreduce", (4,), np.float32, -1, "sum") for _ in range(3)]
    rows.append(fingerprint.make_fingerprint(5, "allreduce", (4,), np.float64, -1, "sum"))
    message = fingerprint.find_mismatch(np.stack(rows))
    assert message == ("collective mismatch across 4 ranks: ranks 0, 1, 2 called #5 allreduce(sum) float32[4]; "
                       "rank 3 called #5 allreduce(sum) float64[4]")
    assert fingerprint.fingerprint_groups(np.stack(rows)) == {
        "#5 allreduce(sum) float32[4]": [0, 1, 2], "#5 allreduce(sum) float64[4]": [3]}


def test_out_of_step_ranks_get_a_hint(fingerprint):
    rows = np.stack([fingerprint.make_fingerprint(4, "barrier"), fingerprint.make_fingerprint(3, "barrier")])
    assert "out of step" in fingerprint.find_mismatch(rows)


def test_long_shapes_fold_their_tail(fingerprint):
    a = fingerprint.make_fingerprint(1, "allreduce", (1,) * 8 + (2, 3), np.float32)
    b = fingerprint.make_fingerprint(1, "allreduce", (1,) * 8 + (3, 2), np.float32)
    c = fingerprint.make_fingerprint(1, "allreduce", (1,) * 8 + (2, 4), np.float32)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_defaults_mean_no_root_and_no_reduce_op(fingerprint):
    """A call that leaves root and reduce_op out matches one that spells out root=-1 and reduce_op="" (a rank
    whose caller passes them matches a rank whose caller does not)."""
    for args in ((2, "barrier"), (4, "allreduce", (3,), np.float32), (5, "allgather", (2, 2), "int64")):
        spelled = args + (None,) * (4 - len(args)) + (-1, "")
        assert np.array_equal(fingerprint.make_fingerprint(*args), fingerprint.make_fingerprint(*spelled))


def test_shape_at_the_slot_limit_is_kept_as_is(fingerprint):
    dims = tuple(range(2, 2 + FINGERPRINT_MAX_DIMS))
    words = fingerprint.make_fingerprint(1, "allreduce", dims, np.float32)
    assert fingerprint.describe_fingerprint(words) == f"#1 allreduce float32[{', '.join(map(str, dims))}]"


def test_unknown_op_is_refused_with_the_same_message(fingerprint):
    with pytest.raises(ValueError, match="'allreduce_typo' is not a collective op; expected one of allreduce, "):
        fingerprint.make_fingerprint(1, "allreduce_typo")


shapes = st.one_of(st.none(), st.lists(st.integers(0, 1 << 20), max_size=12).map(tuple))
calls = st.tuples(st.integers(0, 1 << 40), st.sampled_from(COLLECTIVE_OPS[1:]), shapes,
                  st.sampled_from([None, "float32", "float16", "int64", "uint8", "bool", "complex128"]),
                  st.integers(-1, 64), st.sampled_from(sorted(REDUCE_OP_CODES)))


@settings(max_examples=150, deadline=None)
@given(st.lists(calls, min_size=1, max_size=5))
def test_twins_agree_word_for_word(rows):
    twins = _backend.load_twins("fingerprint")
    tables = {}
    for impl, module in twins.items():
        fps = [module.make_fingerprint(*row) for row in rows]
        table = np.stack(fps)
        tables[impl] = table
        tables[impl + "/text"] = ([module.describe_fingerprint(f) for f in fps], module.find_mismatch(table),
                                  module.fingerprint_groups(table))
    assert np.array_equal(tables["reference"], tables["core"])
    assert tables["reference/text"] == tables["core/text"]
