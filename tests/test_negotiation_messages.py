"""Negotiation messages: round trips, identical bytes from both twins, clear errors on malformed input."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import _backend
from distlab._wire import (
    LIST_HEADER,
    NEGOTIATION_WIRE_VERSION as WIRE_VERSION,
    REQUEST_MAGIC,
    RESPONSE_MAGIC,
    RequestType,
    ResponseType,
)
from distlab.errors import MessageFormatError

names = st.text(min_size=0, max_size=12)
i32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(allow_nan=False, width=64)

request_fields = st.fixed_dictionaries({
    "tensor_name": names,
    "request_type": st.integers(0, 7),
    "tensor_type": st.integers(0, 13),
    "tensor_shape": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5).map(tuple),
    "request_rank": i32,
    "root_rank": i32,
    "device": i32,
    "reduce_op": st.integers(0, 5),
    "prescale_factor": floats,
    "postscale_factor": floats,
})
response_fields = st.fixed_dictionaries({
    "response_type": st.integers(0, 8),
    "tensor_names": st.lists(names, max_size=4),
    "tensor_type": st.integers(0, 13),
    "error_message": st.text(max_size=30),
    "devices": st.lists(i32, max_size=4),
    "tensor_sizes": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    "prescale_factor": floats,
    "postscale_factor": floats,
    "reduce_op": st.integers(0, 5),
    "last_joined_rank": i32,
})


def _twins():
    return _backend.load_twins("negotiation") if _backend.core_available() else None


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(request_fields, max_size=4), shutdown=st.booleans())
def test_request_list_round_trip_and_identical_bytes(reqs, shutdown):
    twins = _twins()
    if twins is None:
        pytest.skip("core not built")
    encoded = {}
    for impl, mod in twins.items():
        rl = mod.RequestList([mod.Request(**f) for f in reqs], shutdown=shutdown)
        data = rl.to_bytes()
        back = mod.RequestList.from_bytes(data)
        assert back == rl
        assert back.shutdown == shutdown
        encoded[impl] = data
    assert encoded["reference"] == encoded["core"]
    # each twin parses the other's bytes into the same values
    ref = twins["reference"].RequestList.from_bytes(encoded["core"])
    core = twins["core"].RequestList.from_bytes(encoded["reference"])
    assert [(r.tensor_name, r.tensor_shape, r.prescale_factor) for r in ref.requests] == \
        [(r.tensor_name, r.tensor_shape, r.prescale_factor) for r in core.requests]


@settings(max_examples=60, deadline=None)
@given(resps=st.lists(response_fields, max_size=4), shutdown=st.booleans())
def test_response_list_round_trip_and_identical_bytes(resps, shutdown):
    twins = _twins()
    if twins is None:
        pytest.skip("core not built")
    encoded = {}
    for impl, mod in twins.items():
        rl = mod.ResponseList([mod.Response(**f) for f in resps], shutdown=shutdown)
        data = rl.to_bytes()
        assert mod.ResponseList.from_bytes(data) == rl
        encoded[impl] = data
    assert encoded["reference"] == encoded["core"]


def test_layout_is_the_documented_one(negotiation):
    request = negotiation.Request("ab", RequestType.BROADCAST, 7, (3, 4), request_rank=2, root_rank=1,
                                  device=-1, reduce_op=0, prescale_factor=1.0, postscale_factor=0.5)
    data = negotiation.RequestList([request], shutdown=True).to_bytes()
    assert data[:LIST_HEADER.size] == LIST_HEADER.pack(REQUEST_MAGIC, WIRE_VERSION, 1, 1)
    body = data[LIST_HEADER.size:]
    assert body == struct.pack("<iBBBBiiddH", 2, 2, 7, 0, 2, 1, -1, 1.0, 0.5, 2) + b"ab" + struct.pack("<qq", 3, 4)
    response = negotiation.Response(ResponseType.ERROR, ["x"], 7, "bad", [0, -1], [5], reduce_op=1)
    data = negotiation.ResponseList([response]).to_bytes()
    assert data[:4] == RESPONSE_MAGIC
    assert data[LIST_HEADER.size:] == (struct.pack("<BBBBiddI", 8, 7, 1, 0, -1, 1.0, 1.0, 1) + b"\x01\x00x"
                                       + struct.pack("<Iii", 2, 0, -1) + struct.pack("<Iq", 1, 5)
                                       + struct.pack("<I", 3) + b"bad")


def _sample(negotiation):
    requests = negotiation.RequestList([negotiation.Request("grad.w", RequestType.ALLREDUCE, 7, (2, 3),
                                                            reduce_op=1)])
    responses = negotiation.ResponseList([negotiation.Response(ResponseType.ALLREDUCE, ["a", "b"], 7,
                                                               devices=[-1, -1], tensor_sizes=[6, 2])])
    return requests, responses


def test_every_truncation_is_a_clear_error(negotiation):
    for message in _sample(negotiation):
        data = message.to_bytes()
        cls = type(message)
        for cut in range(len(data)):
            with pytest.raises(MessageFormatError, match="truncated"):
                cls.from_bytes(data[:cut])


def test_wrong_version_magic_trailing_and_utf8(negotiation):
    requests, responses = _sample(negotiation)
    for message in (requests, responses):
        data = bytearray(message.to_bytes())
        cls = type(message)
        bad = bytearray(data)
        bad[4] = WIRE_VERSION + 1
        with pytest.raises(MessageFormatError, match=f"wire version {WIRE_VERSION + 1}.*same distlab version"):
            cls.from_bytes(bytes(bad))
        bad = bytearray(data)
        bad[0:4] = b"XXXX"
        with pytest.raises(MessageFormatError, match="magic"):
            cls.from_bytes(bytes(bad))
        with pytest.raises(MessageFormatError, match="trailing"):
            cls.from_bytes(bytes(data) + b"\0")
    # a response list parsed as a request list is refused by its magic
    with pytest.raises(MessageFormatError, match="not a distlab request list"):
        type(requests).from_bytes(responses.to_bytes())
    raw = bytearray(requests.to_bytes())
    start = LIST_HEADER.size + 34
    raw[start] = 0xFF  # invalid UTF-8 in the name
    with pytest.raises(MessageFormatError, match="UTF-8"):
        type(requests).from_bytes(bytes(raw))


def test_message_format_error_is_a_distlab_error():
    from distlab.errors import DistlabError

    assert issubclass(MessageFormatError, DistlabError)
    assert issubclass(MessageFormatError, ValueError)


def test_repr_and_copy(negotiation):
    r = negotiation.Response(ResponseType.ALLREDUCE, ["a"], 7, tensor_sizes=[3])
    c = r.copy()
    c.tensor_names.append("b")
    assert r.tensor_names == ["a"]
    assert "allreduce" in repr(r)
    assert "grad" in repr(negotiation.Request("grad"))
