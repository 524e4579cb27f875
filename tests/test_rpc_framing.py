"""RPC message framing without MPI: header layout, limits, the pickle check, functions by value, RRef placeholders;
both twins of the wire codec, and hypothesis fuzzing of the decoder (only RpcMessageError, bounded allocation,
the same outcome from both twins, nothing unpickled from a message the codec refuses)."""
import pickle
import random
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlab import _backend
from distlab._common.rpc_framing import HEADER, MAX_BUFFERS
from distlab._wire import (RPC_FLAG_DEVICES, RPC_FLAG_ERROR, RPC_FLAG_INLINE, RPC_KIND_CODES, RPC_KINDS, RPC_WIRE_MAGIC,
                           RPC_WIRE_VERSION)
from distlab.errors import DistlabError, RpcMessageError
from distlab.rpc import framing

CODECS = (_backend.load_twins("rpc_framing") if _backend.core_available()
          else {"reference": _backend.load("rpc_framing", "reference")})
LIMIT = 1 << 20
TERA_PICKLE = b"\x80\x05\x8e" + (1 << 40).to_bytes(8, "little") + b"."


def header(kind=1, flags=0, mid=7, nbuf=0, nforks=0, nmeta=0, magic=RPC_WIRE_MAGIC, version=RPC_WIRE_VERSION,
           slot=0):
    return HEADER.pack(magic, version, slot, kind, flags, mid, nbuf, nforks, nmeta)


def out_of_band(*sizes) -> bytes:
    """A protocol-5 pickle taking one out-of-band buffer per size (NEXT_BUFFER opcodes)."""
    return pickle.dumps([pickle.PickleBuffer(bytearray(n)) for n in sizes], protocol=5, buffer_callback=lambda b: False)


class Marker:
    """Unpickling this creates the file ``path``: a pickle that runs code (what a hostile peer would send)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_header_round_trip_with_meta_and_forks():
    body, buffers, forks = framing.dumps({"a": np.arange(1000, dtype=np.float64), "b": np.ones(3)})
    assert len(buffers) == 1 and buffers[0].nbytes == 8000   # the big array is out-of-band, the tiny one not
    assert len(body) < 1000                                 # ... and not copied into the pickle bytes
    data = framing.pack_header(5, framing.FLAG_INLINE, 42, buffers, ("ctx", 7), [(0, 1, 2, 3, 4, 5)], body, 9)
    kind, flags, mid, sizes, meta, got_forks, got_body, slot = framing.unpack_header(bytearray(data))
    assert (kind, flags, mid, sizes, slot) == (5, framing.FLAG_INLINE, 42, (8000,), 9)
    assert framing.load_meta(meta, kind, flags, mid) == ("ctx", 7)   # unpacking unpickled nothing
    assert list(got_forks) == [(0, 1, 2, 3, 4, 5)]
    received = [bytearray(b) for b in buffers]
    out = framing.loads(got_body, received, checked=True)
    assert np.array_equal(out["a"], np.arange(1000.0)) and np.array_equal(out["b"], np.ones(3))


def test_twins_write_the_same_bytes_and_read_them_alike():
    meta_in, body_in = pickle.dumps("meta"), out_of_band(1, 0, 5)
    args = (70, 6, -(2 ** 40), [1, 0, 2 ** 33], [(0, 1, 2, 3, 4, 5), (6, 5, 4, 3, 2, 1)], meta_in, body_in, (), 255)
    outputs = {impl: codec.pack_header(*args) for impl, codec in CODECS.items()}
    assert len(set(outputs.values())) == 1
    data = next(iter(outputs.values()))
    assert data[:HEADER.size] == header(70, 6, -(2 ** 40), 3, 2, len(meta_in), slot=255)
    for codec in CODECS.values():
        kind, flags, mid, sizes, forks, meta, body, slot = codec.unpack_header(data, 1 << 40)
        assert (kind, flags, mid, sizes, forks, slot) == (70, 6, -(2 ** 40), (1, 0, 2 ** 33),
                                                          [(0, 1, 2, 3, 4, 5), (6, 5, 4, 3, 2, 1)], 255)
        assert bytes(meta) == meta_in and bytes(body) == body_in
        frames = [b"one", b"", b"three"]
        assert [bytes(f) for f in codec.split_batch(codec.pack_batch(frames))] == frames


@pytest.mark.parametrize("data,words", [
    (b"", "shorter than the 32-byte header"),
    (b"short", "shorter than the 32-byte header"),
    (header(magic=b"xx"), "does not start with distlab's magic"),
    (header(version=RPC_WIRE_VERSION + 1), f"wire version {RPC_WIRE_VERSION + 1}"),
    (header(nbuf=3), "needs 56 bytes but the message has 32"),
    (header(nmeta=99) + b"x", "needs 131 bytes"),
    (header(nbuf=-1), "-1 out-of-band buffers"),
    (header(nbuf=MAX_BUFFERS + 1), f"{MAX_BUFFERS + 1} out-of-band buffers"),
    (header(nforks=-2), "-2 RRef fork records"),
    (header(nbuf=1) + struct.pack("<q", -5), "buffer 0 of -5 bytes"),
    (header(nbuf=2) + struct.pack("<2q", LIMIT, 1), f"total so far {LIMIT + 1}"),
    # kinds that exist nowhere, flags the kind does not take, the reserved byte
    (header(kind=-1), "unknown message kind -1"),
    (header(kind=len(RPC_KINDS)), f"unknown message kind {len(RPC_KINDS)}"),
    (header(kind=63), "unknown message kind 63"),
    (header(kind=-2 ** 31, nbuf=-1), "unknown message kind -2147483648"),   # the kind is checked before counts
    (header(flags=16), "flags 0x10 on a call message"),
    (header(flags=RPC_FLAG_ERROR), "flags 0x1 on a call message"),
    (header(kind=0, flags=RPC_FLAG_INLINE), "flags 0x2 on a response message .it may carry 0x9 at most"),
    (header(kind=RPC_KIND_CODES["batch"], flags=RPC_FLAG_INLINE), "flags 0x2 on a batch message"),
    (header(kind=70, flags=-1), "flags -0x1 on a request message"),
    (header(kind=0, slot=1) + pickle.dumps(None), "a response message names reply slot 1 .only a request may"),
    (header(kind=RPC_KIND_CODES["batch"], slot=3), "a batch message names reply slot 3"),
    (header(version=0, kind=-1), "wire version 0"),                      # the version is checked first
    # fields that disagree with the frame: buffers the body does not take, or takes without the header saying so
    (header(nbuf=1) + struct.pack("<q", 5) + pickle.dumps(None), "payload takes 0 out-of-band buffers but its "
                                                                  "header announces 1"),
    (header() + out_of_band(5), "payload takes 1 out-of-band buffers but its header announces 0"),
    (header(nmeta=len(out_of_band(3))) + out_of_band(3) + pickle.dumps(None), "metadata takes 1 out-of-band"),
    (header() + pickle.dumps(None) + b"xyz", "3 bytes follow the STOP opcode"),
    (header(nmeta=5) + b"\x80\x05N.x" + pickle.dumps(None), "malformed RPC metadata: .* 1 bytes follow the STOP"),
    (header(nmeta=4) + b"\x80\x05\x8e." + pickle.dumps(None), "malformed RPC metadata: .* its byte count is cut off"),
    (header(), "malformed RPC payload: pickle the end at byte 0: no STOP opcode"),
    (header(kind=RPC_KIND_CODES["stop"]) + b"N.", "a stop message with 0 out-of-band buffers, 0 RRef fork records, "
                                                   "0 metadata bytes and a 2-byte body"),
    (header(kind=RPC_KIND_CODES["batch"], nbuf=1) + struct.pack("<q", 1), "a batch message with 1 out-of-band"),
    (header(kind=RPC_KIND_CODES["wake"], nmeta=2) + b"N.", "a wake message with 0 out-of-band buffers, 0 RRef fork "
                                                           "records, 2 metadata bytes"),
])
def test_malformed_headers_are_refused(rpc_framing, data, words):
    with pytest.raises(RpcMessageError, match=words.replace("(", r"\(")):
        rpc_framing.unpack_header(data, LIMIT)


def test_refusals_carry_the_header_fields_once_readable(rpc_framing):
    with pytest.raises(RpcMessageError) as info:
        rpc_framing.unpack_header(header(kind=1, flags=4, mid=99, nbuf=-1), LIMIT)
    assert (info.value.kind, info.value.flags, info.value.mid, info.value.sizes) == (1, 4, 99, None)
    with pytest.raises(RpcMessageError) as info:
        rpc_framing.unpack_header(header(magic=b"zz", mid=99), LIMIT)
    assert info.value.mid is None
    # once the buffer sizes were checked, a refusal carries them (the listener takes those buffers into nothing)
    with pytest.raises(RpcMessageError, match="payload takes 0") as info:
        rpc_framing.unpack_header(header(mid=5, nbuf=2) + struct.pack("<2q", 10, 20) + pickle.dumps(1), LIMIT)
    assert (info.value.mid, info.value.sizes) == (5, (10, 20))
    with pytest.raises(RpcMessageError, match="malformed RPC metadata") as info:
        rpc_framing.unpack_header(header(mid=6, nbuf=1, nmeta=1) + struct.pack("<q", 3) + b"N" + out_of_band(3), LIMIT)
    assert (info.value.kind, info.value.mid, info.value.sizes) == (1, 6, (3,))


def test_a_refused_message_runs_none_of_its_pickles(rpc_framing, tmp_path, monkeypatch):
    """Regression: a message of a kind that exists nowhere had its metadata unpickled (which can run code: here it
    creates a file) before it was refused. Now every check runs first, and the refused message unpickles nothing."""
    monkeypatch.setattr(framing, "_codec", rpc_framing)
    marker = tmp_path / "marker"
    meta, body = pickle.dumps(Marker(marker)), pickle.dumps(Marker(marker))
    for kind, flags, sizes in [(33, 0, ()), (-7, 0, ()), (1, 16, ()), (0, 2, ()), (1, 0, (5,)),
                               (RPC_KIND_CODES["stop"], 0, ())]:
        data = rpc_framing.pack_header(kind, flags, 9, sizes, [], meta, body)
        with pytest.raises(RpcMessageError):
            framing.unpack_header(data)
        assert not marker.exists(), (kind, flags, sizes)
    # a well-formed message of a registered kind (70 here) is unpacked without unpickling anything too: the
    # listener refuses a kind no handler takes before it calls load_meta
    kind, flags, mid, sizes, got_meta, _forks, got_body, _slot = framing.unpack_header(
        rpc_framing.pack_header(70, 0, 9, (), [], meta, body))
    assert not marker.exists()
    framing.load_meta(got_meta, kind, flags, mid).close()   # the trust model: a well-formed pickle runs
    assert marker.exists()


@pytest.mark.parametrize("data,words", [
    (TERA_PICKLE, "claims 1099511627776 bytes but only 1 remain"),
    (b"\x80\x05\x96" + (1 << 33).to_bytes(8, "little") + b".", "claims 8589934592 bytes"),
    (b"\x80\x05B\xff\xff\xff\x7f.", "claims 2147483647 bytes"),
    (b"\x80\x05\x95" + (1 << 40).to_bytes(8, "little") + b"N.", "claims 1099511627776 bytes"),
    (b"\x80\x05]r\xff\xff\xff\x7f.", "memo index 2147483647 but only 3 opcodes"),
    (b"\x80\x02(lp99999999999\n.", "memo index 99999999999"),
    (b"\x80\x02(lp+5\n.", "a PUT index is 1 to 18 decimal digits"),
    (b"(lp0\n.", "a pickle opens with PROTO 2 to 5"),                       # protocol 0
    (b"\x80\x06N.", "a pickle opens with PROTO 2 to 5"),
    (b"\x80\x05K\x01", "no STOP opcode"),
    (b"\x80\x05N.N.", "2 bytes follow the STOP opcode"),
    (b"\x80\x05\xff.", "not a pickle opcode"),
    (b"\x80\x05J\x01", "its argument is cut off"),
    (b"\x80\x05cbuiltins", "has no newline"),
    (b"", "no STOP opcode"),
])
def test_pickle_check_refuses_what_would_make_pickle_allocate(rpc_framing, data, words):
    with pytest.raises(RpcMessageError, match=words):
        rpc_framing.check_pickle(data)


def test_pickle_check_accepts_real_pickles(rpc_framing):
    def square(x):
        return x * x

    for obj in [None, 1, 2 ** 100, -3.5, "x" * 300, b"y" * 70000, bytearray(b"z" * 300), (1, [2, {3: "4"}]),
                {"a": np.arange(10)}, np.ones((3, 3)), {1, 2}, frozenset({3}), 1j]:
        for protocol in range(2, 6):   # protocols 0 and 1 open without PROTO, and are refused (see above)
            data = pickle.dumps(obj, protocol=protocol)
            assert rpc_framing.check_pickle(data) == 0, (obj, protocol)   # no out-of-band buffer
    data = framing.dumps((framing.by_value(square), (3,), None))[0]   # cloudpickled by value
    assert rpc_framing.check_pickle(data) == 0
    body, buffers, _ = framing.dumps([np.ones(1000), np.zeros(3), np.arange(2000)])
    assert rpc_framing.check_pickle(body) == len(buffers) == 2     # one per NEXT_BUFFER opcode


@pytest.mark.parametrize("data,value", [
    (b"\x80\x02I42\n.", 42),                                   # INT: one line of argument
    (b"\x80\x02L12345678901234567890\n.", 12345678901234567890),   # LONG
    (b"\x80\x02cbuiltins\nlen\nq\x00.", len),                  # GLOBAL: two lines, then a memo PUT
    (b"\x80\x02(I1\nI2\ntp0\n.", (1, 2)),                        # PUT with a decimal line
])
def test_pickle_check_reads_opcodes_whose_argument_is_a_line(rpc_framing, data, value):
    """Opcodes with newline-terminated arguments (what protocols 0 and 1 write, and still legal after PROTO 2):
    the check steps past each line exactly, to the next opcode."""
    assert rpc_framing.check_pickle(data) == 0
    assert pickle.loads(data) == value


def test_counts_up_to_their_limits_and_bodiless_control_messages_pass_the_header_checks(rpc_framing):
    """MAX_BUFFERS buffers and MAX_FORKS fork records are counts a header may give (such a frame is then only too
    short); a stop or wake message is its header alone; a PUT of MAX_PUT_DIGITS digits is read as an index."""
    for nbuf, nforks in ((MAX_BUFFERS, 0), (0, 1 << 16)):
        data = header(nbuf=nbuf, nforks=nforks)
        with pytest.raises(RpcMessageError, match="header needs"):
            rpc_framing.unpack_header(data, LIMIT)
    for kind in ("stop", "wake"):
        assert rpc_framing.unpack_header(header(kind=RPC_KIND_CODES[kind]), LIMIT)[:5] == (
            RPC_KIND_CODES[kind], 0, 7, (), [])
    with pytest.raises(RpcMessageError, match="memo index 1{18} but only"):
        rpc_framing.check_pickle(b"\x80\x02(lp" + b"1" * 18 + b"\n.")


def test_device_records_are_read_up_to_their_bounds(rpc_framing):
    """unpack_devices: no record without FLAG_DEVICES; a header that ends right after its records is whole; an
    index from HOST_DEVICE to MAX_DEVICES - 1 names a device, one outside is refused with its position."""
    assert rpc_framing.unpack_devices(header(flags=0, nbuf=1) + struct.pack("<q", 8)) == ()
    top = (1 << 16) - 1   # MAX_DEVICES - 1
    exact = header(flags=RPC_FLAG_DEVICES, nbuf=2) + struct.pack("<4q", 8, 8, -1, top)
    assert rpc_framing.unpack_devices(exact) == (-1, top)
    with pytest.raises(RpcMessageError, match=f"header needs {len(exact)} bytes but the message has {len(exact) - 1}"):
        rpc_framing.unpack_devices(exact[:-1])
    for bad in (top + 1, -2):
        with pytest.raises(RpcMessageError, match=f"buffer 1.*{bad}"):
            rpc_framing.unpack_devices(header(flags=RPC_FLAG_DEVICES, nbuf=2) + struct.pack("<4q", 8, 8, 0, bad))


def test_loads_refuses_a_terabyte_pickle_and_wraps_unpickling_errors():
    with pytest.raises(RpcMessageError, match="claims 1099511627776 bytes"):
        framing.loads(TERA_PICKLE)
    with pytest.raises(RpcMessageError, match="could not unpickle the RPC payload: .*no_such_module"):
        framing.loads(b"\x80\x05cno_such_module\nf\n.")


def test_a_function_sent_by_value_is_checked_before_it_is_loaded():
    # The cloudpickle bytes of a function travel as plain bytes inside the body's pickle: the body's walk skips
    # them, so they are walked when loaded. A terabyte claim there is refused, not allocated.
    for wrapper in (framing._ByValue(TERA_PICKLE), framing._MainFunction("no_such_function_here", TERA_PICKLE)):
        body, _, _ = framing.dumps((wrapper, (), None))
        with pytest.raises(RpcMessageError, match="claims 1099511627776 bytes"):
            framing.loads(body)


def test_lambdas_travel_by_value_and_importable_functions_by_name():
    assert framing.by_value(np.add) is np.add
    square = framing.by_value(lambda x: x * x)
    assert pickle.loads(pickle.dumps(square))(7) == 49
    body, _, _ = framing.dumps((framing.by_value(lambda: 3),))
    assert framing.loads(body)[0]() == 3


def test_rref_placeholders_need_the_framing():
    with pytest.raises(pickle.PicklingError, match="only be pickled by distlab.rpc"):
        framing.rref_reduce((0, 0, 0, 0, 1, 0))
    class Placeholder:
        def __reduce__(self):
            return framing._fork_placeholder, (0,)

    with pytest.raises(RpcMessageError, match="outside distlab.rpc"):
        framing.loads(pickle.dumps(Placeholder()))


def test_header_struct_is_fixed():
    assert HEADER.size == struct.calcsize("<2sBBiiqiii") == 32


# -- fuzzing ------------------------------------------------------------------------------------------------------
objects = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
              st.binary(max_size=300)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.tuples(children, children),
                               st.dictionaries(st.text(max_size=5), children, max_size=3)),
    max_leaves=12)


def _outcomes(fn):
    """Run ``fn(codec)`` on every twin under tracemalloc: (result or error words) per twin, and the peak."""
    results = {}
    tracemalloc.start()
    try:
        for impl, codec in CODECS.items():
            try:
                value = fn(codec)
                results[impl] = ("ok", repr(value))
            except RpcMessageError as exc:
                results[impl] = ("error", str(exc), exc.kind, exc.flags, exc.mid, exc.sizes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len({v for v in results.values()}) == 1, results
    return next(iter(results.values())), peak


def _mutate(rng, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.6 and len(data) >= 8:
            at = rng.randrange(len(data) - 7)
            data[at:at + 8] = rng.choice([2 ** 40, 2 ** 63 - 1, 2 ** 31, 1 << 33, 65537]).to_bytes(8, "little")
        elif choice < 0.75 and data:
            del data[rng.randrange(len(data)):]
        elif choice < 0.9:
            data.insert(rng.randint(0, len(data)), rng.choice(b"\x8e\x96Bpr\x95(.\n"))
        else:
            data += bytes(rng.randrange(16))
    return bytes(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=objects, meta=objects, seed=st.integers(0, 2 ** 32 - 1))
def test_fuzzed_messages_only_raise_message_errors_and_allocate_little(obj, meta, seed):
    rng = random.Random(seed)
    body, buffers, forks = framing.dumps(obj)
    message = framing.pack_header(rng.randrange(70), rng.randrange(8), rng.randrange(-5, 2 ** 40), buffers,
                                  meta, [(0, 0, 1, 0, 2, 1)] * rng.randrange(3), body)
    for _ in range(40):  # 60 x 40 = 2,400 mutated messages (and as many pickles) per run
        data = _mutate(rng, message)
        outcome, peak = _outcomes(lambda codec: codec.unpack_header(data, LIMIT)[:5])
        assert peak < (1 << 20) + 4 * len(data), peak
        pickled = _mutate(rng, body)
        _, peak = _outcomes(lambda codec: codec.check_pickle(pickled))
        try:  # what the facade does with a message: the codec's checks, then pickle (meta and body)
            tracemalloc.start()
            kind, flags, mid, sizes, meta_out, _forks, got_body, _slot = framing.unpack_header(data)
            framing.load_meta(meta_out, kind, flags, mid)
            framing.loads(got_body, [bytearray(s) for s in sizes], checked=True)
        except DistlabError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < (1 << 22) + 64 * len(data), (peak, data)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_fuzzed_batches_agree(seed):
    rng = random.Random(seed)
    frames = [bytes(rng.randrange(40)) for _ in range(rng.randrange(5))]
    data = _mutate(rng, CODECS["reference"].pack_batch(frames))
    _outcomes(lambda codec: [bytes(f) for f in codec.split_batch(data)])


RAN = []


def _ran(part):
    RAN.append(part)
    return part


class Runs:
    """Unpickling this runs ``_ran(part)``: how the fuzzer sees whether a pickle of a message was loaded."""

    def __init__(self, part):
        self.part = part

    def __reduce__(self):
        return _ran, (self.part,)


def mostly(good, *bad):
    """``good`` four times in five, else one of ``bad`` (each field is off in some examples, all sound in some)."""
    return st.sampled_from([good] * 4 * len(bad) + list(bad))


KINDS = st.one_of(st.sampled_from([0, 1, 2, 5, 7, 8, 9, 64, 80, 2 ** 31 - 1] * 3
                                  + [-1, len(RPC_KINDS), 63, -2 ** 31]), st.integers(-2 ** 31, 2 ** 31 - 1))
FLAGS = st.one_of(st.sampled_from([0, 0, 0, 1, 2, 4, 6]), st.integers(-2 ** 31, 2 ** 31 - 1))
DELTA = mostly(0, -2, -1, 1, 2)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=objects, kind=KINDS, flags=FLAGS, version=mostly(RPC_WIRE_VERSION, 0, RPC_WIRE_VERSION + 1, 255),
       slot=mostly(0, 1, 255), sizes=st.lists(mostly(8, -3, 0, LIMIT // 2), max_size=3), nforks=st.integers(0, 2),
       deltas=st.tuples(DELTA, DELTA, DELTA), taken=mostly(0, -1, 1), with_meta=st.booleans(),
       with_body=mostly(True, False))
def test_fuzzed_header_fields_agree_and_a_refused_message_runs_nothing(obj, kind, flags, version, slot, sizes,
                                                                      nforks, deltas, taken, with_meta, with_body):
    """Headers whose kind is unknown, whose flags the kind does not take, whose version is wrong, that name a reply
    slot on a message other than a request,
    whose counts (buffers, forks, metadata bytes) disagree with the frame, whose sizes are negative or too large,
    or whose body takes another number of out-of-band buffers than announced: both twins give the same outcome,
    only RpcMessageError, exactly the sound messages pass, and a refused message has none of its pickles loaded
    (each would run ``_ran``)."""
    meta = pickle.dumps(Runs("meta"), protocol=5) if with_meta else b""
    nbody = max(len(sizes) + taken, 0)
    body = pickle.dumps([obj, Runs("body")] + [pickle.PickleBuffer(bytearray(1)) for _ in range(nbody)],
                        protocol=5, buffer_callback=lambda b: False) if with_body else b""
    dbuf, dforks, dmeta = deltas
    data = (HEADER.pack(RPC_WIRE_MAGIC, version, slot, kind, flags, 3, len(sizes) + dbuf, nforks + dforks,
                        len(meta) + dmeta)
            + struct.pack(f"<{len(sizes)}q", *sizes)
            + (struct.pack(f"<{len(sizes)}q", *[-1] * len(sizes)) if flags & RPC_FLAG_DEVICES else b"")
            + bytes(48 * nforks) + meta + body)
    outcome, _peak = _outcomes(lambda codec: codec.unpack_header(data, LIMIT)[:5])
    control = kind in (RPC_KIND_CODES["stop"], RPC_KIND_CODES["wake"], RPC_KIND_CODES["batch"])
    allowed = (0 if control else RPC_FLAG_DEVICES) | (RPC_FLAG_ERROR if kind == 0 else
                                                     (0 if control else RPC_FLAG_INLINE | 4))
    sound = (version == RPC_WIRE_VERSION and (slot == 0 or not (control or kind == 0))
             and (0 <= kind < len(RPC_KINDS) or kind >= 64)
             and not flags & ~allowed and min(sizes, default=0) >= 0 and sum(sizes) <= LIMIT)
    if control:   # no buffers, forks or metadata; stop and wake no body (a batch's body is its frames)
        agrees = not (sizes or nforks or meta or (body and kind != RPC_KIND_CODES["batch"]))
    else:         # the body one pickle, taking exactly the buffers announced
        agrees = with_body and nbody == len(sizes)
    assert (outcome[0] == "ok") == (sound and agrees and deltas == (0, 0, 0)), (outcome, sound, agrees)
    for codec in CODECS.values():   # what the listener does with the bytes, on each twin: check, then unpickle
        previous, framing._codec = framing._codec, codec
        RAN.clear()
        try:
            kind_, flags_, mid_, sizes_, meta_, _forks, body_, _slot = framing.unpack_header(data)
        except RpcMessageError:
            assert RAN == [], RAN   # refused: not one of its pickles was loaded
            continue
        finally:
            framing._codec = previous
        if not control:
            framing.load_meta(meta_, kind_, flags_, mid_)
            framing.loads(body_, [bytearray(1)] * len(sizes_), checked=True)
            assert RAN == ["meta", "body"][not with_meta:]   # accepted: the trust model (a well-formed pickle runs)
