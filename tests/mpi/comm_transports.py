"""Conformance of one device transport (``DISTLAB_DEVICE_COMM``, run by test_comm_mpi per transport) on the
stand-in: every collective it serves, every dtype and op, odd sizes across chunk boundaries, async work waited on
in reverse, 1,000 reuses of one buffer, the same bits on every rank, a joined rank's host zeros shadowing the
others' device collectives, and a timeout naming the missing rank. For nccl also: the reductions NCCL lacks go
through the staged path, auto picks nccl across nodes, the stand-in's rendezvous (two communicators at once, a
missing member named, a rank claimed twice), rank 0 missing at the transport's set-up named by its barrier, and the
communicator destroyed (or aborted) with its group. For ipc: the slots' set-up refused on every rank, naming the
ranks (a peer's slot a rank cannot open, slot sizes that differ), and a destroyed group's slots unmapped at once.
For hierarchical (2 simulated nodes of 2 ranks, local rank k on stand-in device k): counts below, at and around the
local size, what auto picks on the opt-in and where NCCL has no network, nodes of different sizes refused. For ipc
also the path each collective signature takes, agreed by the ranks: host arrays on every rank go by the host path
once their first collective agreed it (no copy through the slots), a signature that is device memory on any rank
stays on the slots for every rank (a shadow's host zeros too), counted in copies per collective."""
import os
import time

import ml_dtypes
import numpy as np

from mpi4py import MPI

from distlab import comm
from distlab import fakegpu as xp
from distlab.comm.reduce_ops import is_bfloat16, mpi_reduction, parse_op
from distlab.errors import DistTimeoutError

if os.environ.get("DISTLAB_FAKEGPU_DEVICES"):  # each local rank on a device of its own, as with LOCAL_RANK
    xp.cuda.Device(MPI.COMM_WORLD.Get_rank() % int(os.environ["DISTLAB_RANKS_PER_NODE"])).use()
pg = comm.world()
r, n = pg.rank, pg.size
transport = os.environ["DISTLAB_DEVICE_COMM"]
assert pg.device_comm == transport, pg
if transport == "ipc":  # one reducing rank when every rank shares one device, else each rank reduces its block
    assert pg._transport.mode == ("split" if os.environ.get("DISTLAB_FAKEGPU_DEVICES") else "leader"), pg
rng = np.random.default_rng(100 + r)
# ipc sums in rank order, MPI's tree may group 4 ranks differently; the stand-in NCCL reduces with MPI
exact = n == 2 or transport in ("staged", "nccl", "hierarchical")


plain = MPI.COMM_WORLD.Dup()  # the expected results come from plain MPI, never through the group's transport


def typed(host):
    return [host.view(np.uint16), MPI.UINT16_T] if is_bfloat16(host.dtype) else host


def mpi_allreduce(host, op):
    out = host.copy()
    plain.Allreduce(MPI.IN_PLACE, typed(out), op=mpi_reduction(host.dtype, parse_op(op), "expected"))
    if op == "avg":
        out /= n
    return out


def same_everywhere(device):
    """The result's bits, gathered: every rank must hold the very same."""
    bits = device.get().reshape(-1).view(np.uint8)
    table = np.empty((n, bits.size), dtype=np.uint8)
    plain.Allgather(bits, table)
    assert all(np.array_equal(row, table[0]) for row in table), "ranks disagree"


def agree(device, host, what, everywhere=True):
    got = device.get()
    if exact or host.dtype.kind in "biu":
        assert got.tobytes() == host.tobytes(), (what, got, host)
    else:
        # float16: sums of ~50 in rank order; bfloat16 (8 bits of mantissa): a quarter at 32
        tolerance = 0.5 if is_bfloat16(host.dtype) else 0.1 if host.dtype.itemsize == 2 else 1e-5
        np.testing.assert_allclose(got, host, rtol=tolerance, atol=tolerance, err_msg=str(what))
    if everywhere:
        same_everywhere(device)


DTYPES = {"float32": "sum avg min max product", "float64": "sum avg min max", "float16": "sum max",
          "int32": "sum min max product band bor", "int64": "sum", "uint8": "band bor max", "bool": "sum min max",
          "complex64": "sum avg", "int16": "sum", "bfloat16": "sum max"}
if transport == "ipc":  # kernels of one single-chunk allreduce on each rank: leader or not, the slots' traffic
    device = xp.asarray(np.arange(64, dtype=np.float32))
    xp.reset()
    pg.allreduce(device)
    kernels = xp.launch_total(prefix="distlab.comm.transports.ipc")
    if pg._transport.mode == "split":  # copy in, its block summed and written to the n - 1 peers, copy out
        assert kernels == 2 + 2 * (n - 1), kernels
    else:  # the leader sums straight in its own array and writes the peers' slots; the others copy in and out
        assert kernels == (2 * (n - 1) if r == 0 else 2), (r, kernels)
    assert device.get().tolist() == (np.arange(64, dtype=np.float32) * n).tolist()
    # arrays in memory every rank maps (DDP's buckets): reduced where they are, in several chunks, the bits of MPI's
    # sum in rank order; a rank may pass an ordinary array instead (a joined rank's shadow), which goes by its slot
    memory, (odd, buckets) = pg.device_shared_arrays([(7, np.float32), (3000, np.float64)])
    assert odd.get().tolist() == [0] * 7 and not buckets.get().any()
    for ordinary in (None, 1, 0):
        values = rng.standard_normal(3000) * (r + 1)
        array = xp.asarray(values) if r == ordinary else buckets
        array[...] = xp.asarray(values)
        xp.reset()
        pg.allreduce(array, name=f"shared.{ordinary}")
        copies = xp.launch_total(prefix="distlab.comm.transports.ipc") - (2 * (n - 1) * 6 if r == 0 or
                                                                          pg._transport.mode == "split" else 0)
        agree(array, mpi_allreduce(values, "sum"), ("shared", ordinary))
        if pg._transport.mode == "leader":  # 6 chunks of 512 elements: a rank in shared memory copies nothing
            assert copies == (0 if r == 0 or r != ordinary else 2 * 6), (r, ordinary, copies)
    odd[...] = xp.asarray(np.full(7, r + 1, dtype=np.float32))
    pg.allreduce(odd, op="max")
    assert odd.get().tolist() == [n] * 7
    assert pg.device_shared_arrays([(100 + 100 * r, np.float32)]) is None  # sizes differ: no rank gets any
    del memory, odd, buckets

    def copies():
        """Host <-> device copies the comm layer made since the last reset."""
        return xp.total("to_host", prefix="distlab.comm") + xp.total("from_host", prefix="distlab.comm")

    # host arrays on every rank (Join's counts, DDP's used-parameter map): the first collective of a signature
    # agrees the path through the slots (a copy in and out), every later one takes the host path, copying nothing
    for step in range(3):
        counts, rows = np.full(3, r + 1, dtype=np.int64), np.full(2, float(r))
        xp.reset()
        pg.allreduce(counts, name="host counts")
        pg.broadcast(rows, src=n - 1, name="host rows")
        gathered = pg.allgather(np.array([r + 1], np.int64), name="host gather")
        half = np.empty(1, np.float64)
        pg.reduce_scatter(half, np.full(n, 1.0), name="host scatter")
        assert copies() > 0 if step == 0 else copies() == 0, (step, xp.transfers())
        assert counts.tolist() == [n * (n + 1) // 2] * 3 and rows.tolist() == [n - 1.0] * 2
        assert gathered.ravel().tolist() == list(range(1, n + 1)) and half.tolist() == [n]
    # a signature that is device memory on some rank stays on the slots, on every rank: the last rank's host zeros
    # (a joined rank's shadow) are copied in and out of its slot, every time
    for step in range(3):
        shadow = r == n - 1
        array = np.zeros(5, np.float32) if shadow else xp.full(5, 1.0, dtype=np.float32)
        xp.reset()
        pg.allreduce(array, name="shadowed path")
        assert copies() == (2 if shadow else 0), (step, copies())
        assert np.all((array if shadow else array.get()) == n - 1)
    # a rank that calls a signature again before its first collective arrived waits for that one to agree
    works = [pg.allreduce(np.full(4, 1.0), name="twice", async_op=True) for _ in range(2)]
    assert all(w.wait() and w.result().tolist() == [float(n)] * 4 for w in works)

for dtype, ops in DTYPES.items():
    for size in (1, 7, 1023, 5001):
        values = rng.integers(0, 3, size) if dtype in ("bool", "uint8") else rng.standard_normal(size) * 4
        host = values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        for op in ops.split():
            expected = mpi_allreduce(host, op)
            device = xp.asarray(host)
            assert pg.allreduce(device, op=op, name=f"{dtype}.{op}.{size}") is device
            agree(device, expected, (dtype, op, size))
        device, expected = xp.asarray(host), host.copy()
        pg.broadcast(device, src=n - 1)
        plain.Bcast(typed(expected), root=n - 1)
        agree(device, expected, ("broadcast", dtype, size))
        gathered = pg.allgather(xp.asarray(host.reshape(1, -1)))
        assert gathered.shape == (n, 1, size)
        expected = np.empty((n, 1, size), dtype=host.dtype)
        plain.Allgather(typed(host.reshape(1, -1)), typed(expected))
        agree(gathered, expected, ("allgather", dtype, size))
        if dtype != "bool":
            block = host[:size].repeat(n)[:size * n] * (r + 1) if dtype != "uint8" else host.repeat(n)
            out = xp.empty(size, dtype=host.dtype)
            pg.reduce_scatter(out, xp.asarray(block), op="sum")
            reference = np.empty(size, dtype=host.dtype)
            plain.Reduce_scatter_block(typed(block), typed(reference),
                                       op=mpi_reduction(block.dtype, parse_op("sum"), "expected"))
            agree(out, reference, ("reduce_scatter", dtype, size), everywhere=False)

if transport == "hierarchical":  # counts below, at and around the local size (2): shards, remainder, or both
    for size in (0, 1, 2, 3, 4, 5, 64):
        for dtype, op in (("float64", "avg"), ("int64", "max"), ("bfloat16", "sum"), ("complex64", "sum")):
            host = (rng.standard_normal(size) * 4).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            expected, device = mpi_allreduce(host, op), xp.asarray(host)
            pg.allreduce(device, op=op, name=f"around.{dtype}.{size}")
            agree(device, expected, ("around", dtype, op, size))
    assert pg._transport.local_size == 2 and pg._transport.local_rank == r % 2
    scatter, gather, cross = pg._transport.communicators
    assert scatter.device_id() == gather.device_id() == r % 2 and cross.Get_size() == n // 2
    # async work waited on in different orders on different ranks, a blocking allreduce issued meanwhile: every
    # phase still goes out in call order on every rank
    works = [pg.allreduce(xp.full(1001, float(r + k)), async_op=True, name=f"order{k}") for k in range(4)]
    between = xp.full(7, 1.0)
    pg.allreduce(between, name="between")
    assert np.all(between.get() == n)
    for k in (range(4) if r % 2 else reversed(range(4))):
        assert works[k].wait() and np.all(works[k].result().get() == sum(range(n)) + n * k)

# async work waited on in reverse order; each keeps its arrays
works = [pg.allreduce(xp.full(3001, float(r + k), dtype=np.float64), async_op=True, name=f"async{k}")
         for k in range(6)]
for k, work in reversed(list(enumerate(works))):
    assert work.wait()
    assert np.all(work.result().get() == sum(range(n)) + n * k)

# 1,000 reuses of one buffer
buffer = xp.zeros(257, dtype=np.float32)
for step in range(1000):
    buffer[...] = float(step + r)
    pg.allreduce(buffer, name="reused")
    assert float(buffer[0]) == n * step + sum(range(n)), step
same_everywhere(buffer)

# a joined rank's shadow: its host zeros meet the others' device arrays (several chunks long), async too
for size in (5, 3001):
    shadow = r == n - 1
    array = np.zeros(size, np.float32) if shadow else xp.full(size, 1.0, dtype=np.float32)
    pg.allreduce(array, name="shadowed")
    pg.broadcast(array, src=0, async_op=True).wait()
    result = array if shadow else array.get()
    assert np.all(result == n - 1), (size, result[:3])

if transport == "nccl":
    nccl = xp.cuda.nccl
    # what NCCL has no reduction for went through the staged path (per size: band and bor of int32 and uint8, the
    # int16 allreduce and reduce_scatter); the rest (bfloat16 and complex sums too) through NCCL
    assert pg._transport.fallbacks == 24, pg._transport.fallbacks
    # auto picks nccl for ranks on several nodes (here each rank its own) that all have NCCL: its own communicator
    os.environ["DISTLAB_DEVICE_COMM"] = "auto"
    with pg.new_group(list(range(n))) as sub:
        assert sub.device_comm == "nccl", sub
        communicator = sub._transport.communicator
        assert communicator is not pg._transport.communicator and communicator.size() == n
        ints = xp.full(5, r + 1, dtype=np.int64)
        sub.allreduce(ints)
        assert np.all(ints.get() == n * (n + 1) // 2)
    assert communicator.comm == 0  # destroyed with its group
    os.environ["DISTLAB_DEVICE_COMM"] = transport

    # the stand-in's rendezvous: two ids made by world rank 0 at once; on 4 ranks the second's members ask while
    # rank 0 still serves the first (rank 1 comes late), so their requests wait in its mailbox
    stream = xp.cuda.Stream(non_blocking=True)
    ids = plain.bcast((nccl.get_unique_id(), nccl.get_unique_id()) if r == 0 else None, root=0)
    first, second = [0, 1], ([0] + list(range(2, n)) if n > 2 else [1, 0])
    if r == 1:
        time.sleep(0.3)
    made = [(nccl.NcclCommunicator(len(m), uid, m.index(r)), m) for m, uid in ((first, ids[0]), (second, ids[1]))
            if r in m]
    for communicator, members in made:
        values = xp.full(3, float(r + 1))
        communicator.allReduce(values.data.ptr, values.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()
        assert np.all(values.get() == sum(m + 1 for m in members)), (members, values)
        assert communicator.rank_id() == members.index(r)
        communicator.destroy()
        assert communicator.comm == 0
    # a member that never comes is named by the creator and by the members that came; a rank claimed twice
    os.environ["DISTLAB_TIMEOUT"] = "0.3"
    uid = plain.bcast(nccl.get_unique_id() if r == 0 else None, root=0)
    if r != n - 1:
        try:
            nccl.NcclCommunicator(n, uid, r)
            raise AssertionError("must time out")
        except DistTimeoutError as exc:
            assert exc.missing_ranks == [n - 1] and f"ranks [{n - 1}] never joined" in str(exc), exc
    uid = plain.bcast(nccl.get_unique_id() if r == 0 else None, root=0)
    try:
        nccl.NcclCommunicator(n, uid, max(r - 1, 0) if r < 2 else r)  # ranks 0 and 1 both claim rank 0
        raise AssertionError("must be refused")
    except nccl.NcclError as exc:
        assert "NCCL_ERROR_INVALID_USAGE" in str(exc) and "ranks [0]" in str(exc), exc
    del os.environ["DISTLAB_TIMEOUT"]
    plain.Barrier()
    # the transport's set-up: a rank that never came, rank 0 (the id's maker) included, is named by its barrier
    # before any rank waits for the id
    from types import SimpleNamespace

    from distlab.comm.setup import bounded_wait
    from distlab.comm.transports.nccl import NcclTransport

    lonely = MPI.COMM_WORLD.Dup()
    if r != 0:
        half = SimpleNamespace(comm=lonely, rank=r, size=n, name="half", timeout=0.3)
        try:
            NcclTransport(half, xp, lambda request, step: bounded_wait(request, step, lonely, 0.3,
                                                                       time.monotonic() + 0.3))
            raise AssertionError("must time out")
        except DistTimeoutError as exc:
            assert exc.missing_ranks == [0] and "nccl transport of group 'half' set-up" in str(exc), exc
    plain.Barrier()

if transport == "hierarchical":
    # the reductions NCCL lacks went through the staged path (per size: band and bor of int32 and uint8, int16 sum)
    assert pg._transport.fallbacks == 20, pg._transport.fallbacks
    # auto: across nodes on the opt-in (HOROVOD_HIERARCHICAL_ALLREDUCE's), or where NCCL has no network; else nccl
    os.environ["DISTLAB_DEVICE_COMM"] = "auto"
    for env, expected in (({"DISTLAB_HIERARCHICAL_ALLREDUCE": "1"}, "hierarchical"),
                          ({"DISTLAB_NCCL_NET": "0"}, "hierarchical"), ({}, "nccl")):
        os.environ.update(env)
        with pg.new_group(list(range(n))) as sub:
            assert sub.device_comm == expected, (env, sub)
            ints = xp.full(5, r + 1, dtype=np.int64)
            sub.allreduce(ints)
            assert np.all(ints.get() == n * (n + 1) // 2)
        for key in env:
            del os.environ[key]
    # nodes holding different numbers of ranks: refused on every member, naming the nodes
    os.environ["DISTLAB_DEVICE_COMM"] = transport
    try:
        pg.new_group([0, 1, 2])
        assert r == 3, "must be refused"
    except ValueError as exc:
        assert r < 3 and "node 0: ranks [0, 1]; node 2: ranks [2]" in str(exc), exc
    plain.Barrier()

if transport == "ipc":
    # the slots' set-up is collective: a rank that cannot open a peer's slot, or ranks that disagree on the slot
    # size, make every rank raise the same error naming them; a destroyed group's slots are unmapped at once (the
    # stand-in's CUDA IPC: anonymous memory the kernel frees with its last mapping, never a file in /dev/shm)
    def slots_mapped():
        return sum("/memfd:distlab.fakegpu.Memory" in line for line in open("/proc/self/maps"))

    runtime, before = xp.cuda.runtime, slots_mapped()
    opener = runtime.ipcOpenMemHandle

    def refused(handle, flags=runtime.cudaIpcMemLazyEnablePeerAccess):
        raise runtime.CUDARuntimeError(205)

    for case in ("open", "size"):
        with pg.new_group(list(range(n))) as sub:
            assert sub.device_comm == "ipc", sub
            if r == 1:
                runtime.ipcOpenMemHandle = refused if case == "open" else opener
                os.environ["DISTLAB_IPC_SLOT_BYTES"] = "8192" if case == "size" else "4096"
            try:
                sub.allreduce(xp.ones(8), name=f"refused.{case}")
                raise AssertionError("must be refused")
            except RuntimeError as exc:
                if case == "open":
                    assert f"group '{sub.name}': ranks [1] could not map the slots" in str(exc), exc
                    assert (r == 1) == ("this rank failed opening rank 0's slot: CUDARuntimeError: "
                                        "cudaErrorMapBufferObjectFailed" in str(exc)), exc
                else:
                    ranks = [k for k in range(n) if k != 1]
                    assert f"slot sizes differ (DISTLAB_IPC_SLOT_BYTES): ranks {ranks}: 4096 bytes; ranks [1]: " \
                           "8192 bytes" in str(exc), exc
            finally:
                runtime.ipcOpenMemHandle = opener
                os.environ["DISTLAB_IPC_SLOT_BYTES"] = "4096"
    assert slots_mapped() == before, (slots_mapped(), before)
    with pg.new_group(list(range(n))) as sub:
        ints = xp.full(5, r + 1, dtype=np.int64)
        sub.allreduce(ints)
        assert np.all(ints.get() == n * (n + 1) // 2) and slots_mapped() == before + n
    assert slots_mapped() == before, (slots_mapped(), before)

# a rank that never arrives is named
pg.barrier()
late = n - 1
if r == late:
    time.sleep(3.0)
else:
    try:
        pg.allreduce(xp.ones(64), name="dev.bucket", async_op=True).wait(timeout=1.0)
        raise AssertionError("must time out")
    except DistTimeoutError as exc:
        assert exc.missing_ranks == [late] and exc.name == "dev.bucket", exc
if transport == "hierarchical":  # the group's end destroys the node's communicators, or aborts them
    scatter, gather, _ = pg._transport.communicators
    pg.destroy()
    assert scatter.comm == gather.comm == 0
if transport == "nccl":  # the group's end destroys its communicator, or aborts it where a collective never ended
    communicator = pg._transport.communicator
    pg.destroy()
    assert communicator.comm == 0
    try:
        communicator.check_async_error()
        assert r == late, "a timed-out collective's communicator is aborted"
    except xp.cuda.nccl.NcclError:
        assert r != late
print(f"rank {r}: transport {transport} conformance OK", flush=True)
