"""Device arrays over RPC (distlab.rpc.devices): device maps and their checks, the sender's refusals, the device
records of the wire codec (both twins), and the 2-worker scenario on the strict stand-in, each twin and mixed."""
import pickle
import struct

import numpy as np
import pytest

from distlab import _backend
from distlab import fakegpu as xp
from distlab._common.rpc_framing import HEADER, HOST_DEVICE
from distlab._wire import RPC_FLAG_DEVICES, RPC_WIRE_MAGIC, RPC_WIRE_VERSION
from distlab.errors import RpcDeviceError, RpcMessageError
from distlab.rpc import RpcBackendOptions, devices, framing

CODECS = (_backend.load_twins("rpc_framing") if _backend.core_available()
          else {"reference": _backend.load("rpc_framing", "reference")})


# -- options (torch's TensorPipeRpcBackendOptions rules) --------------------------------------------------------
def test_devices_are_named_as_torch_names_them():
    assert [devices.to_device(d) for d in (0, 3, "cuda:2", xp.cuda.Device(0), np.int64(1))] == [0, 3, 2, 0, 1]
    for bad in ("cpu", "cuda", -1, True, 1.0, None):
        with pytest.raises(ValueError, match="device maps take CUDA devices|a device is an index"):
            devices.to_device(bad)


def test_device_maps_must_be_one_to_one():
    options = RpcBackendOptions(device_maps={"w1": {0: 1}}, devices=["cuda:0"])
    assert options.device_maps == {"w1": {0: 1}} and options.devices == [0]
    options.set_device_map("w1", {1: 0})         # incremental, as torch's
    options.set_device_map("w1", {0: 1})         # the same entry again is fine
    assert options.device_maps == {"w1": {0: 1, 1: 0}}
    with pytest.raises(RpcDeviceError, match="trying to map cuda:0 to cuda:2 and cuda:1"):
        options.set_device_map("w1", {0: 2})
    with pytest.raises(RpcDeviceError, match="trying to map cuda:1 and cuda:0 to cuda:3"):
        RpcBackendOptions(device_maps={"w2": {0: 3, 1: 3}})
    with pytest.raises(RpcDeviceError, match="trying to map cuda:2 and cuda:1 to cuda:0"):
        options.set_device_map("w1", {2: 0})
    with pytest.raises(ValueError, match="a device map is a dict"):
        options.set_device_map("w1", [0, 1])
    with pytest.raises(ValueError, match="the callee is a worker name"):
        options.set_device_map("", {0: 0})
    assert "device_maps={'w1': {0: 1, 1: 0}}" in repr(options)


def test_init_checks_name_the_worker_and_what_is_wrong():
    names = ["w0", "w1"]

    def check(maps, devs=None, counts=(1, 1)):
        devices.check_device_maps(names, dict(zip(names, counts)), {n: maps.get(n, {}) for n in names},
                                  {n: (devs or {}).get(n, []) for n in names})

    check({"w0": {"w1": {0: 0}}, "w1": {"w0": {0: 0}}})  # consistent
    for maps, devs, counts, words in [
        ({"w0": {"w1": {0: 1}}}, None, (1, 1), "target devices ['cuda:1'] in its device map for 'w1', but worker "
                                               "'w1' sees 1 device(s)"),
        ({"w0": {"w1": {1: 0}}}, None, (1, 1), "source devices ['cuda:1']"),
        ({"w0": {"w9": {0: 0}}}, None, (1, 1), "device maps for unknown workers ['w9']"),
        ({"w0": {"w1": {0: 0, 1: 0}}}, None, (2, 2), "maps two devices to one"),
        ({}, {"w1": [0, 0]}, (1, 1), "worker 'w1' has duplicated devices"),
        ({}, {"w1": [3]}, (1, 1), "worker 'w1' lists devices it lacks"),
        ({"w0": {"w1": {0: 1}}}, {"w1": [0]}, (2, 2), "not among worker 'w1''s devices [0]"),
        ({"w0": {"w1": {1: 0}}}, {"w0": [0]}, (2, 2), "source devices ['cuda:1'] in its device map for 'w1' that "
                                                      "are not among worker 'w0''s devices [0]"),
    ]:
        with pytest.raises(RpcDeviceError) as info:
            check(maps, devs, counts)
        assert words in str(info.value), (words, str(info.value))
    assert devices.reverse_device_maps("w1", names, {"w0": {"w1": {0: 2, 1: 0}}, "w1": {}}) == {"w0": {2: 0, 0: 1}}


def test_the_sender_refuses_what_no_map_covers_and_says_what_to_set():
    placement = devices.Placement("w0", ["w0", "w1", "w2"], {"w1": {0: 1}}, {"w2": {1: 0}})
    assert placement.target(1, "request", 0) == 1
    assert placement.target(2, "reply", 1) == 0
    assert placement.target(1, "either", 0) == 1 and placement.target(2, "either", 1) == 0
    with pytest.raises(RpcDeviceError, match=r"a device array is on device cuda:0 but no device map is set for "
                                             r"worker 'w2'.*set_device_map\('w2', \{0: N\}\)"):
        placement.target(2, "request", 0)
    with pytest.raises(RpcDeviceError, match=r"device map for worker 'w1' \(\{0: 1\}\) has no cuda:1"):
        placement.target(1, "request", 1)
    with pytest.raises(RpcDeviceError, match="sent back to worker 'w1'.*worker 'w1' set no device map for worker "
                                             "'w0'"):
        placement.target(1, "reply", 0)


# -- framing: device arrays as out-of-band buffers with device records ---------------------------------------
def test_device_arrays_travel_out_of_band_and_land_on_their_device():
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    body, buffers, forks = framing.dumps({"a": a, "h": np.ones(2)}, None, lambda device: device)
    assert len(buffers) == 1 and isinstance(buffers[0], devices.DeviceBuffer)  # even 24 bytes: always out of band
    assert framing.buffer_devices(buffers) == (0,)
    header = framing.pack_header(1, 0, 3, buffers, None, forks, body)
    assert framing.unpack_header(header)[1] & RPC_FLAG_DEVICES
    assert framing.device_records(header, 1, 1, 0, 3) == (0,)
    received = framing.place_buffers([bytearray(b.data) for b in buffers], (0,))
    out = framing.loads(body, received)
    assert isinstance(out["a"], xp.ndarray) and out["a"].shape == (2, 3) and isinstance(out["h"], np.ndarray)
    assert np.array_equal(xp.asnumpy(out["a"]), np.arange(6, dtype=np.float32).reshape(2, 3))
    for count in (1, None):
        with pytest.raises(RpcMessageError, match="carries a device array for device cuda:0, but this worker sees"):
            framing.device_records(header, count - 1 if count else None, 1, 0, 3)
    with pytest.raises(RpcDeviceError, match="can only travel as an RPC argument or result"):
        framing.dumps(a)
    # next to something only cloudpickle can carry (plain pickle fails, the retry goes through cloudpickle)
    body, buffers, _ = framing.dumps((a, lambda: 3), None, lambda device: device)
    assert [type(b) for b in buffers] == [devices.DeviceBuffer]
    with pytest.raises(RpcDeviceError, match="can only travel as an RPC argument or result"):
        framing.dumps((a, lambda: 3))
    with pytest.raises(RpcDeviceError, match="arrived without its device record"):
        devices.rebuild_device_array("distlab.fakegpu", bytearray(8), "<f8", (1,))
    with pytest.raises(RpcDeviceError, match="which this worker cannot rebuild"):
        devices.kind_named("nosuchgpu")


def test_both_twins_write_and_read_the_device_records_alike():
    body = pickle.dumps([pickle.PickleBuffer(bytearray(n)) for n in (16, 8, 4)], protocol=5,
                        buffer_callback=lambda b: False)  # a body that takes its three buffers
    meta = pickle.dumps("m", protocol=5)
    args = (1, 0, 9, [16, 8, 4], [], meta, body, (0, HOST_DEVICE, 3))
    outputs = {impl: codec.pack_header(*args) for impl, codec in CODECS.items()}
    assert len(set(outputs.values())) == 1
    data = next(iter(outputs.values()))
    assert data[:HEADER.size] == HEADER.pack(RPC_WIRE_MAGIC, RPC_WIRE_VERSION, 0, 1, RPC_FLAG_DEVICES, 9, 3, 0,
                                             len(meta))
    assert data[HEADER.size:HEADER.size + 48] == struct.pack("<6q", 16, 8, 4, 0, -1, 3)
    for codec in CODECS.values():
        kind, flags, mid, sizes, forks, got_meta, got_body, _slot = codec.unpack_header(data, 1 << 20)
        assert (sizes, bytes(got_meta), bytes(got_body)) == ((16, 8, 4), meta, body)
        assert codec.unpack_devices(data) == (0, HOST_DEVICE, 3)
        assert codec.unpack_devices(codec.pack_header(1, 0, 9, [16], [], b"", b"")) == ()


# -- on 2 workers --------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_rpc_with_device_maps(mpirun, impl):
    result = mpirun("rpc_devices.py", np=2, args=[impl, "fake"], timeout=120)
    assert result.stdout.count(f"rpc devices OK ({impl}, fake)") == 2


@pytest.mark.mpi
def test_rpc_with_device_maps_mixed_world(mpirun):
    result = mpirun("rpc_devices.py", np=2, args=["mixed", "fake"], timeout=120)
    assert result.stdout.count("rpc devices OK (mixed, fake)") == 2
