"""The strict device stand-in (distlab.fakegpu): it refuses what cupy refuses, keeps results on the "device",
counts every transfer by the module that asked, and is recognised by distlab through the device registry."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from distlab import fakegpu as xp
from distlab.autograd import array_module, is_cupy

CUPY_MESSAGE = ("Implicit conversion to a NumPy array is not allowed. "
                "Please use `.get()` to construct a NumPy array explicitly.")


@pytest.fixture
def dev():
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    xp.reset()
    return a


@pytest.mark.parametrize("convert", [np.asarray, np.array, np.ascontiguousarray,
                                     lambda a: np.asarray(a, dtype=np.float64), lambda a: np.array([a, a]),
                                     lambda a: np.frombuffer(a, dtype=np.uint8), lambda a: memoryview(a)])
def test_implicit_conversion_to_numpy_is_refused_as_cupy_refuses_it(dev, convert):
    with pytest.raises(TypeError) as info:
        convert(dev)
    assert CUPY_MESSAGE in str(info.value) or "bytes-like object is required" in str(info.value)


@pytest.mark.parametrize("mix", [lambda d, h: d + h, lambda d, h: h * d, lambda d, h: np.add(d, h),
                                 lambda d, h: np.concatenate([d, h]), lambda d, h: d @ h.T,
                                 lambda d, h: np.copyto(h, d)])
def test_host_arrays_mixed_with_device_arrays_are_refused(dev, mix):
    with pytest.raises(TypeError, match="Unsupported type"):
        mix(dev, np.ones((2, 3), np.float32))


@pytest.mark.parametrize("op", [lambda a, m: a + 1, lambda a, m: 2.0 * a, lambda a, m: np.add(a, a),
                                lambda a, m: a @ a.T, lambda a, m: a.sum(), lambda a, m: a[0], lambda a, m: a[0, 1],
                                lambda a, m: a.reshape(3, 2), lambda a, m: a.T, lambda a, m: a.astype(np.float64),
                                lambda a, m: a.copy(), lambda a, m: np.concatenate([a, a]), lambda a, m: np.exp(a),
                                lambda a, m: -a, lambda a, m: a > 1, lambda a, m: m.zeros_like(a),
                                lambda a, m: np.float32(2) * a, lambda a, m: a.max(axis=0),
                                lambda a, m: np.stack([a, a]), lambda a, m: m.sqrt(a), lambda a, m: m.where(a > 2, a, 0),
                                lambda a, m: m.matmul(a, a.T), lambda a, m: a.mean(axis=1, keepdims=True)])
def test_results_stay_on_the_device_and_equal_numpy(dev, op):
    out = op(dev, xp)
    assert isinstance(out, xp.ndarray), type(out)  # reductions and integer indexing give 0-d arrays, as cupy's
    want = np.asarray(op(np.arange(6, dtype=np.float32).reshape(2, 3), np))
    got = out.get()
    assert got.dtype == want.dtype and np.array_equal(got, want)  # bit-equal: the stand-in computes with numpy


def test_views_share_the_device_memory(dev):
    flat = dev.reshape(-1)
    flat[0] = 42.0
    part = dev[1]
    part[...] = 7.0
    assert dev.get().tolist() == [[42.0, 1.0, 2.0], [7.0, 7.0, 7.0]]
    assert flat.base is not None and dev.base is None


def test_explicit_transfers_are_counted_by_the_calling_module(dev):
    dev.get()
    float(dev[0, 0])
    dev.set(np.zeros((2, 3), np.float32))
    xp.asarray(np.ones(3))
    with xp.cuda.Stream() as stream:
        assert xp.cuda.get_current_stream() is stream
        stream.record().synchronize()
    xp.cuda.Device().synchronize()
    assert xp.transfers() == {("to_host", __name__): 1, ("item", __name__): 1, ("from_host", __name__): 2,
                              ("synchronize", __name__): 2}
    assert xp.total("from_host") == 2 and xp.total(prefix="distlab.") == 0


def test_set_takes_only_a_host_array_of_the_same_shape_and_dtype(dev):
    with pytest.raises(TypeError, match="Only numpy.ndarray"):
        dev.set(xp.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="cannot be set"):
        dev.set(np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match="Shape mismatch"):
        dev.set(np.zeros(6, np.float32))


def test_cuda_array_interface_points_at_the_memory(dev):
    iface = dev.__cuda_array_interface__
    assert iface["shape"] == (2, 3) and iface["typestr"] == "<f4" and iface["version"] == 3
    assert iface["data"][0] == dev.data.ptr and iface["strides"] is None
    assert dev.T.__cuda_array_interface__["strides"] == (4, 12)


def test_distlab_recognises_it_through_the_registry(dev):
    assert is_cupy(dev) and array_module(dev) is xp
    assert not is_cupy(np.ones(2)) and array_module(np.ones(2)) is np
    assert xp.get_array_module(dev) is xp and xp.get_array_module(np.ones(1)) is np


def test_seeded_draws_equal_numpy_and_pickling_round_trips(dev):
    a = xp.random.default_rng(3).standard_normal((4, 4))
    assert np.array_equal(a.get(), np.random.default_rng(3).standard_normal((4, 4)))
    back = pickle.loads(pickle.dumps(dev))
    assert isinstance(back, xp.ndarray) and np.array_equal(back.get(), dev.get())


def test_host_only_functions_are_absent():
    for name in ("frombuffer", "fromfile", "asanyarray", "load"):
        with pytest.raises(AttributeError):
            getattr(xp, name)


def test_a_local_training_step_on_the_device_moves_nothing_through_the_host(impl):
    """DDP (default arguments, one rank), the autograd engine, nn and Adam on the stand-in: the only host copies
    are the comm layer's staging (MPI is not CUDA-aware); every other module keeps the data on the device."""
    import distlab
    from distlab import nn, optim
    from distlab.ddp import DistributedDataParallel as DDP

    xp.use_as_cuda()
    try:
        distlab.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to("cuda"), impl=impl)
        opt = optim.Adam(model.parameters(), lr=0.01)
        x, y = (distlab.tensor(xp.asarray(np.ones((3, n), np.float32))) for n in (4, 2))
        xp.reset()
        for _ in range(3):
            opt.zero_grad()
            nn.MSELoss()(model(x), y).backward()
            opt.step()
    finally:
        xp.use_as_cuda(False)
    assert all(isinstance(p.data, xp.ndarray) and isinstance(p.grad.data, xp.ndarray) for p in model.parameters())
    outside = {key: n for key, n in xp.transfers().items()
               if key[0] != "synchronize" and not key[1].startswith("distlab.comm.")}
    assert outside == {}, outside
    staged = xp.total("to_host", "distlab.comm.")
    assert staged == xp.total("from_host", "distlab.comm.")  # every staged bucket comes back


def test_a_function_given_out_returns_that_very_array(dev):
    out = xp.empty((2, 2), np.float32)
    assert xp.matmul(dev, dev.T, out=out) is out and np.add(out, 1, out=out) is out
    assert np.array_equal(out.get(), dev.get() @ dev.get().T + 1)


def test_as_strided_gives_a_view_of_the_device_memory():
    """``xp.lib.stride_tricks.as_strided`` as cupy's: a strided view that writes through; a host array is refused."""
    flat = xp.asarray(np.arange(12, dtype=np.float32))
    pairs = xp.lib.stride_tricks.as_strided(flat[1:], (2, 3), (6 * 4, 4))
    assert isinstance(pairs, xp.ndarray) and pairs.tolist() == [[1, 2, 3], [7, 8, 9]]
    pairs[1, 0] = -1
    assert float(flat[7]) == -1
    with pytest.raises(TypeError, match="device array"):
        xp.lib.stride_tricks.as_strided(np.zeros(4), (2,), (8,))


def test_raw_pointers_resolve_to_the_memory_of_live_arrays_only(dev):
    from distlab.fakegpu._ndarray import resolve_pointer

    view = resolve_pointer(dev.data.ptr + 4, 8)
    view.view(np.float32)[:] = [7, 8]
    assert dev.get().reshape(-1)[:4].tolist() == [0, 7, 8, 3]
    with pytest.raises(ValueError, match="illegal address"):
        resolve_pointer(dev.data.ptr + 20, 8)  # runs past the end of the array
    gone = xp.zeros(16, np.float32)
    ptr = gone.data.ptr
    del gone
    with pytest.raises(ValueError, match="not inside any live device array"):
        resolve_pointer(ptr, 4)


def test_the_stand_in_nccl_mirrors_cupy_on_a_one_rank_communicator():
    """cupy.cuda.nccl's names and argument order; collectives queued on the stream they were given (an event
    after them is done once they completed); every NCCL datatype; refusals as NcclError with NCCL's words."""
    import ml_dtypes

    nccl = xp.cuda.nccl
    uid = nccl.get_unique_id()
    assert type(uid) is bytes and len(uid) == 128 and uid != nccl.get_unique_id()  # cupy 14
    assert nccl.available and nccl.get_version() == 22809 and not hasattr(nccl, "NCCL_AVG")
    comm = nccl.NcclCommunicator(1, uid, 0)
    assert (comm.size(), comm.rank_id(), comm.device_id()) == (1, 0, 0) and comm.comm
    stream = xp.cuda.Stream(non_blocking=True)
    for datatype, dtype in ((nccl.NCCL_INT8, np.int8), (nccl.NCCL_UINT64, np.uint64), (nccl.NCCL_HALF, np.float16),
                            (nccl.NCCL_FLOAT64, np.float64), (nccl.NCCL_BFLOAT16, ml_dtypes.bfloat16)):
        for op in (nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN):
            send, recv = xp.asarray(np.arange(5).astype(dtype)), xp.zeros(5, dtype)
            comm.allReduce(send.data.ptr, recv.data.ptr, 5, datatype, op, stream.ptr)
            event = xp.cuda.Event()
            event.record(stream)
            assert event.done and recv.get().tobytes() == send.get().tobytes()
    gathered, block = xp.zeros(4, np.int32), xp.asarray(np.array([3, 4], np.int32))
    comm.allGather(block.data.ptr, gathered.data.ptr, 2, nccl.NCCL_INT32, stream.ptr)
    comm.reduceScatter(block.data.ptr, gathered.data.ptr + 8, 2, nccl.NCCL_INT32, nccl.NCCL_SUM, stream.ptr)
    comm.broadcast(block.data.ptr, gathered.data.ptr, 1, nccl.NCCL_INT32, 0, stream.ptr)
    comm.bcast(block.data.ptr, 2, nccl.NCCL_INT32, 0, 0)
    stream.synchronize()
    assert gathered.get().tolist() == [3, 4, 3, 4] and stream.done
    for call, words in ((lambda: comm.allReduce(1, 1, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0), "INVALID_ARGUMENT"),
                        (lambda: comm.allReduce(block.data.ptr, block.data.ptr, 2, 42, 0, 0), "datatype 42"),
                        (lambda: comm.allReduce(block.data.ptr, block.data.ptr, 2, nccl.NCCL_INT32, 4, 0), "op 4"),
                        (lambda: comm.bcast(block.data.ptr, 2, nccl.NCCL_INT32, 1, 0), "root 1"),
                        (lambda: nccl.NcclCommunicator(1, bytes(128), 0), "not a unique id"),
                        (lambda: nccl.NcclCommunicator(2, uid, 2), r"rank 2 is not in \[0, 2\)")):
        with pytest.raises(nccl.NcclError, match=words):
            call()
    with pytest.raises(TypeError, match="'commId' has incorrect type \\(expected bytes, got tuple\\)"):
        nccl.NcclCommunicator(1, tuple(uid), 0)  # what cupy before 14 took
    comm.destroy()
    assert comm.comm == 0
    with pytest.raises(nccl.NcclError, match="destroyed"):
        comm.allReduce(block.data.ptr, block.data.ptr, 2, nccl.NCCL_INT32, nccl.NCCL_SUM, 0)
    comm.destroy()  # twice: nothing more


def test_a_stream_waits_for_the_collectives_queued_on_it_and_a_synchronize_is_bounded(monkeypatch):
    """A stand-in NCCL collective runs until every member issued it: events and streams after it are not done,
    a stream waiting on such an event inherits it, and a synchronize gives up after DISTLAB_TIMEOUT."""
    from distlab.fakegpu._queue import enqueue

    class Running:
        finished = False

        def Test(self):  # noqa: N802 - polled like an MPI request
            return self.finished

    work, stream, other = Running(), xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True)
    enqueue(stream.ptr, work)
    event = stream.record()
    other.wait_event(event)
    assert not event.done and not stream.done and not other.done
    monkeypatch.setenv("DISTLAB_TIMEOUT", "0.05")
    with pytest.raises(TimeoutError, match="did not complete within 0.05 s"):
        other.synchronize()
    work.finished = True
    assert event.done and stream.done and other.done
    event.synchronize()


def test_the_stand_in_presents_several_devices_on_request_and_one_by_default(monkeypatch):
    """DISTLAB_FAKEGPU_DEVICES=N: cupy's Device(i).use(), getDevice, getDeviceCount, a uuid per (node, device),
    peer access between distinct devices, and an NCCL communicator on the device current when it was made."""
    runtime = xp.cuda.runtime
    assert runtime.getDeviceCount() == 1 and runtime.getDevice() == 0 and xp.cuda.Device().id == 0
    with pytest.raises(ValueError, match=r"the stand-in has 1 device \(0 .. 0; DISTLAB_FAKEGPU_DEVICES"):
        xp.cuda.Device(1)
    monkeypatch.setenv("DISTLAB_FAKEGPU_DEVICES", "3")
    try:
        assert runtime.getDeviceCount() == 3
        uuids = [runtime.getDeviceProperties(k)["uuid"] for k in range(3)]
        assert len(set(uuids)) == 3 and all(len(u) == 16 for u in uuids)
        assert runtime.deviceCanAccessPeer(0, 2) and not runtime.deviceCanAccessPeer(1, 1)
        with xp.cuda.Device(2):
            assert runtime.getDevice() == 2 and xp.cuda.Device() == xp.cuda.Device(2)
        assert runtime.getDevice() == 0
        xp.cuda.Device(1).use()
        assert runtime.getDevice() == 1
        comm = xp.cuda.nccl.NcclCommunicator(1, xp.cuda.nccl.get_unique_id(), 0)
        assert comm.device_id() == 1
        comm.destroy()
        from distlab.comm.transports import local_placement

        placement = local_placement(0, "auto")
        assert placement.device_id == 1 and placement.peers == 0b101
        runtime.setDevice(0)
        other = local_placement(0, "auto")
        assert other.device != placement.device and other.peers == 0b110
        for bad in ("0", "two"):
            monkeypatch.setenv("DISTLAB_FAKEGPU_DEVICES", bad)
            with pytest.raises(ValueError, match=f"DISTLAB_FAKEGPU_DEVICES='{bad}'"):
                runtime.getDeviceCount()
    finally:
        monkeypatch.delenv("DISTLAB_FAKEGPU_DEVICES")
        runtime.setDevice(0)


def test_the_stand_in_nccl_reduces_to_a_root_and_reads_in_place_offsets_as_nccl():
    """reduce (cupy's argument order, only the root's buffer written); reduce-scatter and all-gather whose receive
    buffer is the send buffer at the rank's offset (NCCL's in-place forms)."""
    nccl = xp.cuda.nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    values = xp.asarray(np.array([1.0, 2.0, 3.0]))
    out = xp.zeros(3)
    comm.reduce(values.data.ptr, out.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0, 0)
    comm.reduce(values.data.ptr, values.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_MAX, 0, 0)
    comm.reduceScatter(values.data.ptr, values.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
    comm.allGather(values.data.ptr, values.data.ptr, 3, nccl.NCCL_FLOAT64, 0)
    xp.cuda.Stream.null.synchronize()
    assert out.get().tolist() == values.get().tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(nccl.NcclError, match=r"root 1 is not in \[0, 1\)"):
        comm.reduce(values.data.ptr, out.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 1, 0)
    comm.destroy()


# ---------------------------------------------------------------------------------------------- CUDA IPC emulation
_PEER = r"""
import os, sys
import numpy as np
from distlab import fakegpu as xp

def inode_held():  # whether this process still maps the memory or has it open (by the file's inode)
    fds = os.listdir("/proc/self/fd")
    return any(line.split()[4] == str(INODE) for line in open("/proc/self/maps")) or \
        any(os.stat(f"/proc/self/fd/{fd}").st_ino == INODE for fd in fds if os.path.exists(f"/proc/self/fd/{fd}"))

handle = bytes.fromhex(sys.stdin.readline())
INODE = int(sys.stdin.readline())
runtime = xp.cuda.runtime
ptr = runtime.ipcOpenMemHandle(handle)
memory = xp.cuda.UnownedMemory(ptr, 4096, None)
view = xp.ndarray((1024,), dtype=np.int32, memptr=xp.cuda.MemoryPointer(memory, 0))
print("read", int(view[:8].sum()), int(view[1023]), flush=True)
view[8:16] = 7  # the owner sees this write
print("wrote", flush=True)
sys.stdin.readline()  # the owner freed its Memory meanwhile: what this process mapped is still there
print("after owner freed", int(view[:16].sum()), flush=True)
del view, memory
runtime.ipcCloseMemHandle(ptr)
print("held after close", inode_held(), flush=True)
try:
    runtime.ipcCloseMemHandle(ptr)
except runtime.CUDARuntimeError as exc:
    print("second close", exc, flush=True)
"""


def _peer():
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-P", "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _holds(pid: int, inode: int) -> set[str]:
    """The names under which process ``pid`` maps or has open the file of ``inode`` (empty: it holds none)."""
    import os

    names = {line.split(maxsplit=5)[5].strip() for line in open(f"/proc/{pid}/maps")
             if line.split()[4] == str(inode) and len(line.split()) > 5}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            continue
    return names


def test_an_ipc_handle_maps_the_same_memory_in_another_process_until_every_side_closed():
    """As CUDA IPC: a dedicated Memory's 64-byte handle, opened by another process, maps the very bytes both ways;
    the owner freeing its Memory leaves the peer's mapping intact; once both closed no process holds the memory,
    and none of it was ever a file in /dev/shm."""
    import os
    import struct

    memory = xp.cuda.Memory(4096)
    view = xp.ndarray((1024,), dtype=np.int32, memptr=xp.cuda.MemoryPointer(memory, 0))
    view[...] = 0
    view[:8] = 3
    view[1023] = -5
    handle = xp.cuda.runtime.ipcGetMemHandle(memory.ptr)
    assert type(handle) is bytes and len(handle) == 64
    inode = struct.unpack_from("<q", handle, 48)[0]
    assert inode == os.fstat(memory._fd).st_ino
    assert _holds(os.getpid(), inode) == {"/memfd:distlab.fakegpu.Memory (deleted)"}  # a name in no filesystem
    peer = _peer()
    try:
        peer.stdin.write(f"{handle.hex()}\n{inode}\n")
        peer.stdin.flush()
        assert peer.stdout.readline().split() == ["read", "24", "-5"]
        assert peer.stdout.readline().strip() == "wrote"
        assert view[8:16].tolist() == [7] * 8  # the peer's write, seen here
        del view, memory  # the owner frees its Memory: nothing here holds it any more
        assert not _holds(os.getpid(), inode) and _holds(peer.pid, inode) == {"/memfd:distlab.fakegpu.Memory (deleted)"}
        peer.stdin.write("\n")
        peer.stdin.flush()
        out, err = peer.communicate(timeout=60)
    finally:
        peer.kill()
    assert peer.returncode == 0, err
    assert out.splitlines() == ["after owner freed 80", "held after close False",
                                "second close cudaErrorInvalidValue: invalid argument"]


def test_ipc_refuses_what_cuda_refuses():
    """A pointer that is not the base of a live Memory has no handle; a process cannot open its own handle
    (CUDA's "invalid device context"); a closed or unknown address cannot be closed; a malformed handle, a
    handle of a freed Memory or of a process gone, and flags other than cudaIpcMemLazyEnablePeerAccess are
    refused; the arguments are checked as cupy's Cython signatures check them."""
    import pickle as pickling
    import subprocess
    import sys

    runtime = xp.cuda.runtime
    error = runtime.CUDARuntimeError
    memory = xp.cuda.Memory(256)
    handle = runtime.ipcGetMemHandle(memory.ptr)
    plain = xp.zeros(64, np.float32)
    for ptr in (memory.ptr + 64, plain.data.ptr, 0, 12345):
        with pytest.raises(error, match=r"^cudaErrorInvalidValue: invalid argument$") as info:
            runtime.ipcGetMemHandle(ptr)
        assert info.value.status == 1 and isinstance(info.value, RuntimeError)
    with pytest.raises(error, match=r"^cudaErrorDeviceUninitialized: invalid device context$") as info:
        runtime.ipcOpenMemHandle(handle)
    assert info.value.status == 201
    copy = pickling.loads(pickling.dumps(info.value))
    assert (type(copy), copy.status, str(copy)) == (error, 201, str(info.value))
    with pytest.raises(error, match="cudaErrorInvalidValue"):
        runtime.ipcOpenMemHandle(handle, 0)
    with pytest.raises(error, match="cudaErrorInvalidValue"):
        runtime.ipcOpenMemHandle(b"\1" * 64)
    with pytest.raises(error, match="cudaErrorInvalidValue"):
        runtime.ipcCloseMemHandle(memory.ptr)  # never opened: a Memory of this process
    with pytest.raises(TypeError, match=r"expected bytes, got bytearray"):
        runtime.ipcOpenMemHandle(bytearray(handle))
    with pytest.raises(IndexError, match="expected 64, got 10"):
        runtime.ipcOpenMemHandle(handle[:10])
    with pytest.raises(TypeError, match="an integer is required"):
        runtime.ipcGetMemHandle(1.5)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # a handle naming a process that ended
    gone.wait(timeout=60)
    forged = handle[:24] + gone.pid.to_bytes(8, "little") + handle[32:]
    with pytest.raises(error, match=r"^cudaErrorMapBufferObjectFailed: mapping of buffer object failed$"):
        runtime.ipcOpenMemHandle(forged)


def test_arrays_over_device_memory_keep_it_alive_and_stay_inside_it():
    """``ndarray(shape, dtype, memptr=MemoryPointer(mem, offset))`` views ``mem`` and holds it, as cupy's; an
    address outside every live allocation is an illegal address; the signatures are cupy 14's."""
    import gc
    import inspect

    memory = xp.cuda.Memory(64)
    ptr = memory.ptr
    assert (memory.size, memory.device_id, int(memory)) == (64, 0, ptr)
    pointer = xp.cuda.MemoryPointer(memory, 16)
    assert (pointer.ptr, pointer.mem, int(pointer + 8)) == (ptr + 16, memory, ptr + 24)
    view = xp.ndarray((4,), dtype=np.float32, memptr=pointer)
    view[...] = 2
    del memory, pointer
    gc.collect()
    assert view.data.ptr == ptr + 16 and xp.cuda.runtime.ipcGetMemHandle(ptr)  # still allocated: the view holds it
    whole = xp.ndarray((2, 8), dtype=np.float32, memptr=view.data + -16, order="F")
    assert float(whole.sum()) == 8
    with pytest.raises(ValueError, match="illegal address"):
        xp.ndarray((17,), dtype=np.float32, memptr=whole.data)  # one element past the allocation
    del view, whole
    gc.collect()
    with pytest.raises(xp.cuda.runtime.CUDARuntimeError):
        xp.cuda.runtime.ipcGetMemHandle(ptr)  # freed with its last array
    stray = xp.cuda.MemoryPointer(xp.cuda.UnownedMemory(ptr, 64, None), 0)
    with pytest.raises(ValueError, match="illegal address"):
        xp.ndarray((1,), dtype=np.uint8, memptr=stray)
    with pytest.raises(RuntimeError, match="explicit device ID for a null pointer"):
        xp.cuda.UnownedMemory(0, 0, None)
    assert xp.cuda.Memory(0).ptr == 0
    assert xp.ndarray((2, 3), np.int16).shape == (2, 3)
    signatures = {xp.cuda.UnownedMemory: "(ptr, size, owner, device_id=-1)", xp.cuda.Memory: "(size)",
                  xp.cuda.MemoryPointer: "(mem, offset)",
                  xp.ndarray: "(shape, dtype=<class 'float'>, memptr=None, strides=None, order='C')",
                  xp.cuda.runtime.ipcGetMemHandle: "(devPtr)", xp.cuda.runtime.ipcCloseMemHandle: "(devPtr)",
                  xp.cuda.runtime.ipcOpenMemHandle: "(handle, flags=1)"}
    assert {f: str(inspect.signature(f)) for f in signatures} == signatures
    assert xp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess == 1


def test_a_killed_peer_leaves_nothing_behind():
    """A process killed while it maps another's Memory: the kernel drops its mapping and the owner's free then
    releases the memory; it never had a name in /dev/shm or any other filesystem."""
    import os
    import signal
    import struct

    memory = xp.cuda.Memory(1 << 20)
    handle = xp.cuda.runtime.ipcGetMemHandle(memory.ptr)
    inode = struct.unpack_from("<q", handle, 48)[0]
    peer = _peer()
    try:
        peer.stdin.write(f"{handle.hex()}\n{inode}\n")
        peer.stdin.flush()
        assert peer.stdout.readline().split()[0] == "read"
        assert _holds(peer.pid, inode) == {"/memfd:distlab.fakegpu.Memory (deleted)"}
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(timeout=60)
    finally:
        peer.kill()
        peer.communicate()
    assert peer.returncode == -signal.SIGKILL
    del memory
    assert not _holds(os.getpid(), inode)
