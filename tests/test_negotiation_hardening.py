"""Negotiation messages from an untrusted peer: out-of-range fields, impersonation, and a fuzz of both parsers.

Every malformed message must raise distlab's own MessageFormatError, with the same message from both twins,
before it can reach the coordinator; a coordinator that receives a list it cannot trust stops every rank with the
reason instead of dying in its cycle thread.
"""
from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _negotiation_sim import make_world, run_cycle
from distlab import _backend
from distlab._common.negotiation import dtype_code
from distlab._wire import (DTYPE_SIZES, LIST_HEADER, NEGOTIATION_WIRE_VERSION, REQUEST_HEAD, RESPONSE_HEAD,
                           RequestType)
from distlab.errors import DistlabError, MessageFormatError

F32 = dtype_code("float32")


def _twins():
    if not _backend.core_available():
        pytest.skip("core not built")
    return _backend.load_twins("negotiation")


def _request_list(mod, **fields):
    request = mod.Request("grad.w", RequestType.ALLREDUCE, F32, (2, 3), request_rank=1, reduce_op=1)
    return mod.RequestList([request], **fields).to_bytes()


def _response_list(mod):
    response = mod.Response(0, ["a", "b"], F32, devices=[-1, 0], tensor_sizes=[6, 2], reduce_op=1)
    return mod.ResponseList([response]).to_bytes()


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


REQ = LIST_HEADER.size          # the request starts after the header (empty reason)
RESP = LIST_HEADER.size
# (what, where, format, value, expected message): each field of the request head out of its range
REQUEST_CASES = [
    ("rank", REQ + 0, "<i", -2, "request list: request_rank -2 is out of range (>= 0)"),
    ("type", REQ + 4, "<B", 8, "request list: request_type 8 is out of range (0 to 7)"),
    ("dtype", REQ + 5, "<B", 200, "request list: tensor_type 200 is out of range (0 to 14)"),
    ("op", REQ + 6, "<B", 6, "request list: reduce_op 6 is out of range (0 to 5)"),
    ("root", REQ + 8, "<i", -1, "request list: root_rank -1 is out of range (>= 0)"),
    ("device", REQ + 12, "<i", -2, "request list: device -2 is out of range (>= -1)"),
    ("group", REQ + 16, "<i", -5, "request list: group_id -5 is out of range (>= -1)"),
    ("group size", REQ + 20, "<i", -1, "request list: group_size -1 is out of range (>= 0)"),
    ("group without members", REQ + 16, "<i", 7, "request list: group_id 7 with group_size 0"),
    ("nan prescale", REQ + 24, "<d", float("nan"), "request list: prescale_factor nan is out of range (a finite"),
    ("inf postscale", REQ + 32, "<d", float("inf"), "request list: postscale_factor inf is out of range"),
    ("negative dim", REQ + REQUEST_HEAD.size + len("grad.w") + 8, "<q", -3,
     "request list: dimension 1 is -3, out of range (>= 0)"),
    ("unused flag bits", 5, "<B", 0x6, "request list: flags 0x6 has unknown bits set (only 0x1 is defined)"),
    ("negative process set", 6, "<i", -1, "request list: process_set_id -1 is out of range (>= 0)"),
]
RESPONSE_CASES = [
    ("type", RESP + 0, "<B", 9, "response list: response_type 9 is out of range (0 to 8)"),
    ("dtype", RESP + 1, "<B", 15, "response list: tensor_type 15 is out of range (0 to 14)"),
    ("op", RESP + 2, "<B", 9, "response list: reduce_op 9 is out of range (0 to 5)"),
    ("pad", RESP + 3, "<B", 1, "response list: pad 1 is out of range (0 to 0)"),
    ("last joined", RESP + 4, "<i", -7, "response list: last_joined_rank -7 is out of range (>= -1)"),
    ("group", RESP + 8, "<i", -3, "response list: group_id -3 is out of range (>= -1)"),
    ("nan scale", RESP + 12, "<d", float("nan"), "response list: prescale_factor nan is out of range"),
    ("device", RESP + RESPONSE_HEAD.size + 2 * 2 + 2 + 4 + 4, "<i", -4,
     "response list: device 1 is -4, out of range (>= -1)"),
    ("negative size", RESP + RESPONSE_HEAD.size + 2 * 2 + 2 + 4 + 8 + 4, "<q", -1,
     "response list: tensor size 0 is -1, out of range (>= 0)"),
    ("size past int64 bytes", RESP + RESPONSE_HEAD.size + 2 * 2 + 2 + 4 + 8 + 4, "<q", 2**61,
     "response list: tensor size 0 is 2305843009213693952, out of range (at most 2305843009213693951 elements of "
     "4 bytes, a 64-bit byte count)"),
]


def _refused_identically(build, parse, offset, fmt, value, expected):
    """Patch one field of the message ``build(reference twin)`` wrote; ``parse(twin)(data)`` must refuse it on both
    twins with one and the same message, starting with ``expected``."""
    twins = _twins()
    data = _patch(build(twins["reference"]), offset, fmt, value)
    messages = set()
    for module in twins.values():
        with pytest.raises(MessageFormatError) as info:
            parse(module)(data)
        assert str(info.value).startswith(expected), str(info.value)
        messages.add(str(info.value))
    assert len(messages) == 1


@pytest.mark.parametrize("what,offset,fmt,value,expected", REQUEST_CASES, ids=[c[0] for c in REQUEST_CASES])
def test_out_of_range_request_fields_are_refused_identically(what, offset, fmt, value, expected):
    _refused_identically(_request_list, lambda m: m.RequestList.from_bytes, offset, fmt, value, expected)


@pytest.mark.parametrize("what,offset,fmt,value,expected", RESPONSE_CASES, ids=[c[0] for c in RESPONSE_CASES])
def test_out_of_range_response_fields_are_refused_identically(what, offset, fmt, value, expected):
    _refused_identically(_response_list, lambda m: m.ResponseList.from_bytes, offset, fmt, value, expected)


# -- shapes whose element or byte count overflows 64 bits ---------------------------------------------------------
I64 = 2**63 - 1
OVERFLOWING = [((2**62, 2**62), F32), ((2**62, 3), dtype_code("int64")), ((2**61,), F32), ((3, 5, 2**61), 0),
               ((2**32, 2**32), dtype_code("uint8")), ((2**31, 2**31, 2**31, 0, 7)[:3], dtype_code("complex128"))]
FITTING = [((I64,), dtype_code("uint8")), ((2**61 - 1,), F32), ((0, 2**62, 2**62), F32), ((2**62, 2**62, 0), F32),
           ((), F32), ((2**31, 2**31 - 1), dtype_code("int16"))]


def _shaped_list(module, shape, dtype, rank=0, name="evil"):
    request = module.Request(name, RequestType.ALLREDUCE, dtype, shape, request_rank=rank, reduce_op=1)
    return module.RequestList([request]).to_bytes()


@pytest.mark.parametrize("shape,dtype", OVERFLOWING, ids=[str(s) for s, _ in OVERFLOWING])
def test_a_shape_whose_byte_count_overflows_int64_is_refused_identically(shape, dtype):
    """The core's counts are int64: (2**62, 2**62) wrapped to 0 there and broke the reference's to_bytes."""
    twins = _twins()
    count = 1
    for d in shape:
        count *= d
    messages = set()
    for module in twins.values():
        data = _shaped_list(module, shape, dtype)
        assert data == _shaped_list(twins["reference"], shape, dtype)     # written alike: the parser refuses
        with pytest.raises(MessageFormatError) as info:
            module.RequestList.from_bytes(data)
        messages.add(str(info.value))
    assert messages == {f"request list: tensor 'evil' of shape {shape} holds {count} elements of "
                        f"{DTYPE_SIZES[dtype]} bytes ({count * DTYPE_SIZES[dtype]} bytes), more than a 64-bit size "
                        f"can count (at most {I64} bytes)"}


@pytest.mark.parametrize("shape,dtype", FITTING, ids=[str(s) for s, _ in FITTING])
def test_a_shape_at_the_int64_limit_still_parses(shape, dtype):
    for module in _twins().values():
        parsed = module.RequestList.from_bytes(_shaped_list(module, shape, dtype))
        assert parsed.requests[0].tensor_shape == shape


@pytest.mark.parametrize("shape", [(2**62, 2**62), (2**62, 3)], ids=["2**62x2**62", "2**62x3"])
def test_every_rank_stops_with_the_reason_on_an_overflowing_shape(shape):
    """Sent by every rank (a mixed world too): each rank's ResponseList stops with the same reason, none wraps."""
    twins = _twins()
    for modules in ([twins["reference"]] * 3, [twins["core"]] * 3, [twins["core"], twins["reference"],
                                                                     twins["core"]]):
        world, cs, ts = make_world(modules, cache_capacity=8)
        for rank, (m, c) in enumerate(zip(modules, cs)):
            c.enqueue(m.Request("evil", RequestType.ALLREDUCE, F32, shape, request_rank=rank, reduce_op=1))
        out = run_cycle(cs, ts)
        assert {o.shutdown for o in out} == {True} and all(o.responses == [] for o in out)
        assert len({o.shutdown_reason for o in out}) == 1
        assert out[0].shutdown_reason.startswith(f"the coordinator (rank 0) refused rank 0's request list: request "
                                                 f"list: tensor 'evil' of shape {shape} holds"), out[0]


def test_fusion_of_huge_responses_does_not_wrap(negotiation):
    """Two 2**62-byte allreduces exceed any int64 threshold together: never fused (the core's sum wrapped)."""
    m = negotiation
    u8 = dtype_code("uint8")
    big = [m.Response(0, [f"t{i}"], u8, devices=[-1], tensor_sizes=[2**62], reduce_op=1) for i in range(3)]
    fused = m.fuse_responses(big, I64)
    assert [r.tensor_names for r in fused] == [["t0"], ["t1"], ["t2"]]
    small = m.Response(0, ["s"], u8, devices=[-1], tensor_sizes=[10], reduce_op=1)
    for elements, expected in ((2**60 - 1, [["t0", "s"], ["o"]]),      # skipped over: 2**63 - 4 bytes in all
                               (2**60, [["t0"], ["o"], ["s"]])):        # 2**63 bytes: the look-ahead stops
        other = m.Response(0, ["o"], F32, devices=[-1], tensor_sizes=[elements], reduce_op=1)
        assert [r.tensor_names for r in m.fuse_responses([big[0], other, small], I64)] == expected


class _Failing:
    """A coordinator that fails in its cycle (a bug, or input nothing foresaw), as a subclass of either twin's."""

    @staticmethod
    def around(module, controller):
        class Failing(module.Coordinator):
            def coordinate(self, gathered, cache, cache_hits):
                raise RuntimeError("coordinator bug")

        old = controller.coordinator
        controller.coordinator = Failing(old.size, old.process_set_id, old.fusion_threshold, old.stall)


def test_a_failing_coordinator_stops_every_rank_with_the_reason(negotiation, caplog):
    """Rank 0's cycle raising used to end its engine alone, the others waiting in its broadcast for DISTLAB_TIMEOUT
    (and a re-init on rank 0 timing out meanwhile): it now broadcasts a shutdown list saying why."""
    m = negotiation
    world, cs, ts = make_world([m, m], cache_capacity=8)
    _Failing.around(m, cs[0])
    cs[1].enqueue(m.Request("w", RequestType.ALLREDUCE, F32, (2,), request_rank=1, reduce_op=1))
    with caplog.at_level("ERROR", logger="distlab.collectives"):
        out = run_cycle(cs, ts)
    assert [o.shutdown for o in out] == [True, True]
    assert out[0].shutdown_reason == out[1].shutdown_reason == (
        "the coordinator (rank 0) failed in its negotiation cycle (RuntimeError: coordinator bug); see rank 0's log")
    assert "coordinator bug" in caplog.text                          # the traceback is in rank 0's log


def test_huge_counts_fail_fast_without_allocating(negotiation):
    head = LIST_HEADER.pack(b"DLRQ", NEGOTIATION_WIRE_VERSION, 0, 0, 0xFFFFFFFF, 0)
    with pytest.raises(MessageFormatError, match="truncated"):
        negotiation.RequestList.from_bytes(head + b"\0" * 30)
    response = RESPONSE_HEAD.pack(0, 0, 0, 0, -1, -1, 1.0, 1.0, 0) + struct.pack("<I", 0xFFFFFFFF)
    lists = LIST_HEADER.pack(b"DLRS", NEGOTIATION_WIRE_VERSION, 0, 0, 1, 0xFFFF)
    for data in (lists + b"x" * 10, LIST_HEADER.pack(b"DLRS", NEGOTIATION_WIRE_VERSION, 0, 0, 1, 0) + response):
        tracemalloc.start()
        try:
            with pytest.raises(MessageFormatError, match="truncated"):
                negotiation.ResponseList.from_bytes(data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024, peak


def test_impersonated_request_rank_stops_every_rank_with_the_reason(negotiation):
    """A list from rank 1 claiming rank 0's request must not mark the tensor ready on rank 0's behalf."""
    m = negotiation
    world, cs, ts = make_world([m, m], cache_capacity=0)
    forged = m.RequestList([m.Request("w", RequestType.ALLREDUCE, F32, (2,), request_rank=0, reduce_op=1)])
    honest = m.RequestList([m.Request("w", RequestType.ALLREDUCE, F32, (2,), request_rank=1, reduce_op=1)])
    lists = [m.RequestList([]).to_bytes(), forged.to_bytes() + b""]
    original = ts[0].gather

    def gather(payload):
        values = original(payload)
        return [values[0], lists[1]] if values is not None else None

    ts[0].gather = gather
    cs[1].enqueue(honest.requests[0])
    out = run_cycle(cs, ts)
    for response_list in out:
        assert response_list.shutdown and response_list.responses == []
        assert response_list.shutdown_reason == (
            "the coordinator (rank 0) refused rank 1's request list: the request for 'w' claims to come from "
            "rank 0, but rank 1 sent it: a rank may only submit its own requests")


def test_list_for_another_process_set_is_refused(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m], cache_capacity=0)
    original = ts[0].gather

    def gather(payload):
        values = original(payload)
        return [values[0], m.RequestList([], process_set_id=4).to_bytes()] if values is not None else None

    ts[0].gather = gather
    out = run_cycle(cs, ts)
    assert out[1].shutdown and "is for process set 4, but this controller negotiates for process set 0" in \
        out[1].shutdown_reason


def test_garbage_from_a_peer_stops_every_rank_instead_of_killing_the_coordinator(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m, m], cache_capacity=0)
    original = ts[0].gather

    def gather(payload):
        values = original(payload)
        if values is None:
            return None
        bad = bytearray(values[2])
        bad[5] = 0x80                                  # an unknown flag bit
        return [values[0], values[1], bytes(bad)]

    ts[0].gather = gather
    out = run_cycle(cs, ts)
    assert all(o.shutdown for o in out)
    assert out[2].shutdown_reason.startswith("the coordinator (rank 0) refused rank 2's request list: request list: "
                                             "flags 0x80 has unknown bits set")


# -- the fuzz -----------------------------------------------------------------------------------------------------
def _seeds(module):
    r = module.Request
    reqs = [r("grad.w", RequestType.ALLREDUCE, F32, (2, 3), request_rank=1, reduce_op=1),
            r("b", RequestType.BROADCAST, 0, (), request_rank=0, root_rank=1, device=0, prescale_factor=0.5),
            r("g.0", RequestType.ALLREDUCE, 8, (4,), request_rank=2, reduce_op=2, group_id=77, group_size=2)]
    resps = [module.Response(0, ["a", "b"], F32, devices=[-1, 0], tensor_sizes=[6, 2], reduce_op=1, group_id=3),
             module.Response(8, ["x"], 0, "bad things", [-1, -1]),
             module.Response(3, ["join.noname"], last_joined_rank=1)]
    near_limit = r("big", RequestType.ALLREDUCE, dtype_code("int8"), (2**31, 2**31, 1), request_rank=1, reduce_op=1)
    return [module.RequestList(reqs, True, "called shutdown()", 2).to_bytes(), module.RequestList().to_bytes(),
            module.RequestList([near_limit]).to_bytes(),            # 2**62 bytes: a mutated dim goes past int64
            module.ResponseList(resps, False, "", 1).to_bytes(), module.ResponseList([], True, "rank 1 stopped").to_bytes()]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.45 and out:                                   # flip a byte
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif choice < 0.6 and out:                                  # a big little-endian number somewhere
            at = rng.randrange(len(out))
            out[at:at + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f"])
        elif choice < 0.75:                                         # truncate
            del out[rng.randrange(len(out) + 1):]
        elif choice < 0.9:                                          # insert junk
            at = rng.randrange(len(out) + 1)
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        elif choice < 0.95:                                         # a NaN or inf where a float may sit
            at = rng.randrange(max(len(out) - 8, 1))
            out[at:at + 8] = struct.pack("<d", rng.choice([float("nan"), float("inf"), -1e308]))
        else:                                                       # a huge int64 (a dim, a size)
            at = rng.randrange(max(len(out) - 8, 1))
            out[at:at + 8] = struct.pack("<q", rng.choice([2**62, 2**63 - 1, 3 * 2**61, 2**32 + 1]))
    return bytes(out)


def _outcome(cls, data):
    try:
        parsed = cls.from_bytes(data)
    except DistlabError as exc:
        assert isinstance(exc, MessageFormatError), type(exc)
        return ("error", str(exc))
    return ("ok", parsed.to_bytes())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_fuzz_both_parsers_agree_and_raise_only_message_format_errors(seed):
    """Thousands of mutated messages per run (40 seeds x 60 mutants x 5 seed messages), both twins."""
    twins = _twins()
    rng = random.Random(seed)
    for index, base in enumerate(_seeds(twins["reference"])):
        kind = "RequestList" if base[:4] == b"DLRQ" else "ResponseList"
        for _ in range(60):
            data = _mutate(base, rng)
            if rng.random() < 0.1:              # a list header of the other kind
                data = (b"DLRS" if kind == "RequestList" else b"DLRQ") + data[4:]
            outcomes = {impl: _outcome(getattr(module, kind), data) for impl, module in twins.items()}
            assert outcomes["reference"] == outcomes["core"], (data.hex(), outcomes)
            if outcomes["core"][0] == "ok":
                # what parsed is well formed: written again, it is the same message (a fixed point)
                assert outcomes["core"][1] == data, data.hex()


def _coordinated(modules, payload, process_set_id, answer=None, shape=(2, 3)):
    """One cycle of a 2-rank world for ``process_set_id`` where rank 1's request list is replaced by ``payload``
    (and, given ``answer``, the response list rank 1 receives by it): each rank's ResponseList as bytes, or the
    error a rank's controller raised."""
    world, cs, ts = make_world(modules, cache_capacity=4, process_set_id=process_set_id)
    for rank, (module, controller) in enumerate(zip(modules, cs)):   # rank 1 sends the payload instead of its own
        controller.enqueue(module.Request("grad.w", RequestType.ALLREDUCE, F32, shape, request_rank=rank,
                                          reduce_op=1))
    original = ts[0].gather

    def gather(mine):
        values = original(mine)
        return [values[0], payload] if values is not None else None

    ts[0].gather = gather
    if answer is not None:
        received = ts[1].broadcast
        ts[1].broadcast = lambda mine: (received(mine), answer)[1]
    outcomes = []
    for out in _cycle_outcomes(cs, ts):
        outcomes.append(out if isinstance(out, tuple) else ("ok", out.to_bytes()))
    return outcomes


def _cycle_outcomes(cs, ts):
    from concurrent.futures import ThreadPoolExecutor

    def one(c, t):
        try:
            return c.compute_response_list(t)
        except DistlabError as exc:
            return ("error", type(exc).__name__, str(exc))

    with ThreadPoolExecutor(len(cs)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(one, c, t) for c, t in zip(cs, ts)]]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_fuzz_the_coordinator_of_both_twins_agrees(seed):
    """Mutated request lists (overflowing shapes, process sets that do not exist, other ranks' requests) reach rank
    0's coordinator in a reference, a core and a mixed world, for the global set and for set 3: every world answers
    every rank with the same bytes (a refusal stops every rank with one reason; nothing wraps or dies)."""
    twins = _twins()
    rng = random.Random(seed)
    reference, core = twins["reference"], twins["core"]
    for _ in range(6):
        process_set_id = rng.choice([0, 3])
        request = reference.Request("grad.w", RequestType.ALLREDUCE, F32,
                                    rng.choice([(2, 3), (2**62, 2**62), (2**62, 3), (2**31, 2**31)]),
                                    request_rank=1, reduce_op=1)
        base = reference.RequestList([request], process_set_id=rng.choice([process_set_id, process_set_id,
                                                                           process_set_id + 1, 2**31 - 1]))
        payload = base.to_bytes() if rng.random() < 0.3 else _mutate(base.to_bytes(), rng)
        outcomes = [_coordinated(modules, payload, process_set_id, shape=request.tensor_shape)
                    for modules in ([reference, reference], [core, core], [core, reference])]
        assert outcomes[0] == outcomes[1] == outcomes[2], (payload.hex(), outcomes)
        assert outcomes[0][0] == outcomes[0][1]                      # every rank got the same list
        if base.process_set_id != process_set_id and payload == base.to_bytes() and request.tensor_shape == (2, 3):
            assert outcomes[0][0][0] == "ok" and b"is for process set" in outcomes[0][0][1]
        # rank 1 receives a response list for another (or no) process set, or a mutated one
        answer = reference.ResponseList([], False, "", rng.choice([process_set_id + 1, 2**31 - 1, 7])).to_bytes()
        answer = answer if rng.random() < 0.5 else _mutate(answer, rng)
        outcomes = [_coordinated(modules, base.to_bytes(), process_set_id, answer)[1]
                    for modules in ([reference, reference], [core, core], [reference, core])]
        assert outcomes[0] == outcomes[1] == outcomes[2], (answer.hex(), outcomes)
        assert outcomes[0][0] == "ok" or outcomes[0][1] == "MessageFormatError", outcomes[0]   # never another


def test_parsed_fuzz_survivor_memory_is_bounded():
    """Whatever the bytes say, parsing allocates in proportion to the bytes, not to a length field."""
    twins = _twins()
    rng = random.Random(7)
    seeds = _seeds(twins["reference"])
    for module in twins.values():
        for _ in range(300):
            base = rng.choice(seeds)
            data = _mutate(base, rng)
            cls = module.RequestList if data[:4] == b"DLRQ" else module.ResponseList
            tracemalloc.start()
            try:
                _outcome(cls, data)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 64 * len(data) + 256 * 1024, (peak, len(data))
