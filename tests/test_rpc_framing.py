"""RPC message framing without MPI: header layout, out-of-band buffers, functions by value, RRef placeholders."""
import pickle
import struct

import numpy as np
import pytest

from distlab.rpc import framing


def test_header_round_trip_with_meta_and_forks():
    body, buffers, forks = framing.dumps({"a": np.arange(1000, dtype=np.float64), "b": np.ones(3)})
    assert len(buffers) == 1 and buffers[0].nbytes == 8000   # the big array is out-of-band, the tiny one not
    assert len(body) < 1000                                 # ... and not copied into the pickle bytes
    header = framing.pack_header(5, framing.FLAG_INLINE, 42, buffers, ("ctx", 7), [(0, 1, 2, 3, 4, 5)], body)
    kind, flags, mid, sizes, meta, got_forks, got_body = framing.unpack_header(bytearray(header))
    assert (kind, flags, mid, sizes, meta) == (5, framing.FLAG_INLINE, 42, (8000,), ("ctx", 7))
    assert list(got_forks) == [(0, 1, 2, 3, 4, 5)]
    received = [bytearray(b) for b in buffers]
    out = framing.loads(got_body, received)
    assert np.array_equal(out["a"], np.arange(1000.0)) and np.array_equal(out["b"], np.ones(3))


@pytest.mark.parametrize("data", [b"", b"short", framing.HEADER.pack(1, 0, 1, 3, 0),
                                  framing.HEADER.pack(1, 0, 1, 0, 99) + b"x", framing.HEADER.pack(1, 0, 1, -1, 0)])
def test_malformed_headers_are_rejected(data):
    with pytest.raises(ValueError, match="malformed RPC message"):
        framing.unpack_header(data)


def test_lambdas_travel_by_value_and_importable_functions_by_name():
    assert framing.by_value(np.add) is np.add
    square = framing.by_value(lambda x: x * x)
    assert pickle.loads(pickle.dumps(square))(7) == 49
    body, _, _ = framing.dumps((framing.by_value(lambda: 3),))
    assert framing.loads(body)[0]() == 3


def test_rref_placeholders_need_the_framing():
    with pytest.raises(pickle.PicklingError, match="only be pickled by distlab.rpc"):
        framing.rref_reduce((0, 0, 0, 0, 1, 0))
    with pytest.raises(pickle.UnpicklingError, match="outside distlab.rpc"):
        framing._fork_placeholder(0)


def test_header_struct_is_fixed():
    assert framing.HEADER.size == struct.calcsize("<iiqii") == 24
