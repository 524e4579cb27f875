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
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)

request_fields = st.fixed_dictionaries({
    "tensor_name": names,
    "request_type": st.integers(0, 7),
    "tensor_type": st.integers(0, 14),
    # shapes whose byte count fits int64 (larger ones are refused: test_negotiation_hardening), a 0 dim included
    "tensor_shape": st.one_of(st.lists(st.integers(0, 2**12), max_size=5), st.lists(st.integers(0, 2**58),
                              max_size=1), st.lists(st.integers(0, 2**63 - 1), max_size=4).map(lambda s: s + [0]),
                              ).map(tuple),
    "request_rank": st.integers(0, 2**31 - 1),
    "root_rank": st.integers(0, 2**31 - 1),
    "device": st.integers(-1, 2**31 - 1),
    "reduce_op": st.integers(0, 5),
    "prescale_factor": floats,
    "postscale_factor": floats,
}).flatmap(lambda f: st.one_of(st.just({**f, "group_id": -1, "group_size": 0}),
                               st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 2**31 - 1)).map(
                                   lambda g: {**f, "group_id": g[0], "group_size": g[1]})))
response_fields = st.fixed_dictionaries({
    "response_type": st.integers(0, 8),
    "tensor_names": st.lists(names, max_size=4),
    "tensor_type": st.integers(0, 14),
    "error_message": st.text(max_size=30),
    "devices": st.lists(st.integers(-1, 2**31 - 1), max_size=4),
    "tensor_sizes": st.lists(st.integers(0, 2**59 - 1), max_size=4),      # times 16 bytes still fits int64
    "prescale_factor": floats,
    "postscale_factor": floats,
    "reduce_op": st.integers(0, 5),
    "last_joined_rank": st.integers(-1, 2**31 - 1),
    "group_id": st.integers(-1, 2**31 - 1),
})
list_fields = st.fixed_dictionaries({"shutdown": st.booleans(), "shutdown_reason": st.text(max_size=20),
                                     "process_set_id": st.integers(0, 2**31 - 1)})


def _twins():
    return _backend.load_twins("negotiation") if _backend.core_available() else None


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(request_fields, max_size=4), fields=list_fields)
def test_request_list_round_trip_and_identical_bytes(reqs, fields):
    twins = _twins()
    if twins is None:
        pytest.skip("core not built")
    encoded = {}
    for impl, mod in twins.items():
        rl = mod.RequestList([mod.Request(**f) for f in reqs], **fields)
        data = rl.to_bytes()
        back = mod.RequestList.from_bytes(data)
        assert back == rl
        assert {k: getattr(back, k) for k in fields} == fields
        encoded[impl] = data
    assert encoded["reference"] == encoded["core"]
    # each twin parses the other's bytes into the same values
    ref = twins["reference"].RequestList.from_bytes(encoded["core"])
    core = twins["core"].RequestList.from_bytes(encoded["reference"])
    assert [(r.tensor_name, r.tensor_shape, r.prescale_factor, r.group_id) for r in ref.requests] == \
        [(r.tensor_name, r.tensor_shape, r.prescale_factor, r.group_id) for r in core.requests]


@settings(max_examples=60, deadline=None)
@given(resps=st.lists(response_fields, max_size=4), fields=list_fields)
def test_response_list_round_trip_and_identical_bytes(resps, fields):
    twins = _twins()
    if twins is None:
        pytest.skip("core not built")
    encoded = {}
    for impl, mod in twins.items():
        rl = mod.ResponseList([mod.Response(**f) for f in resps], **fields)
        data = rl.to_bytes()
        assert mod.ResponseList.from_bytes(data) == rl
        encoded[impl] = data
    assert encoded["reference"] == encoded["core"]


def test_layout_is_the_documented_one(negotiation):
    request = negotiation.Request("ab", RequestType.BROADCAST, 7, (3, 4), request_rank=2, root_rank=1,
                                  device=-1, reduce_op=0, prescale_factor=1.0, postscale_factor=0.5)
    data = negotiation.RequestList([request], shutdown=True, shutdown_reason="bye", process_set_id=3).to_bytes()
    assert data[:LIST_HEADER.size + 3] == LIST_HEADER.pack(REQUEST_MAGIC, WIRE_VERSION, 1, 3, 1, 3) + b"bye"
    body = data[LIST_HEADER.size + 3:]
    assert body == (struct.pack("<iBBBBiiiiddH", 2, 2, 7, 0, 2, 1, -1, -1, 0, 1.0, 0.5, 2) + b"ab"
                    + struct.pack("<qq", 3, 4))
    response = negotiation.Response(ResponseType.ERROR, ["x"], 7, "bad", [0, -1], [5], reduce_op=1, group_id=9)
    data = negotiation.ResponseList([response]).to_bytes()
    assert data[:LIST_HEADER.size] == LIST_HEADER.pack(RESPONSE_MAGIC, WIRE_VERSION, 0, 0, 1, 0)
    assert data[LIST_HEADER.size:] == (struct.pack("<BBBBiiddI", 8, 7, 1, 0, -1, 9, 1.0, 1.0, 1) + b"\x01\x00x"
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
        # a rank running the previous distlab (wire version 1, a 10-byte header) is named, not "truncated"
        old = bytes(data[:4]) + bytes([1, 0]) + (0).to_bytes(4, "little")
        with pytest.raises(MessageFormatError, match=f"wire version 1, this distlab speaks version {WIRE_VERSION}"):
            cls.from_bytes(old)
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
    start = LIST_HEADER.size + 42
    raw[start] = 0xFF  # invalid UTF-8 in the name
    with pytest.raises(MessageFormatError, match="UTF-8"):
        type(requests).from_bytes(bytes(raw))


def test_response_fields_at_their_bounds_round_trip(negotiation):
    """The host device (-1), many sizes with an empty error after them (nothing but the error's length follows
    the sizes), sizes up to the int64 byte limit, and non-ASCII names come back as they were sent."""
    response = negotiation.Response(ResponseType.ALLGATHER, ["grad.é", "€"], 7, "", [-1, 0, 2**31 - 1],
                                    [0, 1, 2, 3, 4, 5, 6, 2**59 - 1])
    message = negotiation.ResponseList([negotiation.Response(ResponseType.ALLREDUCE, ["b"], 7, devices=[-1],
                                                             tensor_sizes=[3]), response])   # the last: no slack
    back = type(message).from_bytes(message.to_bytes())
    assert back == message
    assert back.responses[1].devices == [-1, 0, 2**31 - 1]
    assert back.responses[1].tensor_sizes == [0, 1, 2, 3, 4, 5, 6, 2**59 - 1]
    for cut in range(len(message.to_bytes())):   # a cut inside a multi-byte name is a truncation, not bad UTF-8
        with pytest.raises(MessageFormatError, match="truncated"):
            type(message).from_bytes(message.to_bytes()[:cut])


@pytest.mark.parametrize("field,value,words", [("devices", [-1, -2], "device 1 is -2, out of range"),
                                               ("tensor_sizes", [4, -1], "tensor size 1 is -1, out of range")])
def test_a_peer_sending_a_negative_device_or_size_is_refused(negotiation, field, value, words):
    """Both twins write whatever a (buggy) peer put in its response; the reader refuses it and names the field."""
    response = negotiation.Response(ResponseType.ALLREDUCE, ["a", "b"], 7, **{field: value})
    data = negotiation.ResponseList([response]).to_bytes()
    with pytest.raises(MessageFormatError, match=words):
        negotiation.ResponseList.from_bytes(data)


def test_defaults_and_equality(negotiation):
    """A request built from its name alone is an allreduce by rank 0 on the host, with no reduce op, unit scale
    factors and no group; lists equal only lists of their own kind."""
    assert negotiation.Request("g") == negotiation.Request("g", RequestType.ALLREDUCE, 0, (), 0, 0, -1, 0, 1.0, 1.0,
                                                           -1, 0)
    assert negotiation.Response(ResponseType.ALLREDUCE, ["g"]) == negotiation.Response(
        ResponseType.ALLREDUCE, ["g"], 0, "", [], [], 1.0, 1.0, 0, -1, -1)
    requests, responses = negotiation.RequestList([]), negotiation.ResponseList([])
    assert requests == negotiation.RequestList([]) and responses == negotiation.ResponseList([])
    assert requests != responses and responses != requests
    assert responses != [] and requests != None  # noqa: E711 - __eq__ against a foreign type


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
