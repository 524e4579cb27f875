"""RPC agent on N ranks: rpc_sync/rpc_async, arrays out-of-band, remote errors, timeouts, extension handlers."""
import os
import sys
import threading
import time

import numpy as np

if len(sys.argv) > 1 and sys.argv[1] == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab.rpc as rpc
from distlab.errors import DistTimeoutError, RemoteError, RpcError

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
_done = threading.Event()


def finish():
    _done.set()


def add(a, b):
    return a + b


def boom(x):
    raise KeyError(f"no key {x}")


@rpc.cheap
def nested_on_listener(dst):
    return rpc.rpc_sync(dst, add, (1, 2))


def meta_seen():
    return rpc.current_call().meta


def add_reply_hook():
    rpc.get_agent().add_reply_hook(lambda info, meta: ("reply-from", rank, info.meta))


def echo_meta(src, payload, meta):
    return (src, payload, meta, rpc.current_call().meta)


info = rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_timeout=20)
assert info == rpc.get_worker_info() == rpc.WorkerInfo(f"worker{rank}", rank)
rpc.get_agent().register_handler(64, echo_meta)
peer = (rank + 1) % world

if rank == 0:
    for dst in range(world):
        assert rpc.get_worker_info(f"worker{dst}").id == dst
        assert rpc.rpc_sync(f"worker{dst}", add, (dst, 1)) == dst + 1
        assert rpc.rpc_sync(dst, lambda x: x * 3, (dst,)) == 3 * dst          # __main__ lambda: cloudpickle
    arr = np.arange(300_000, dtype=np.float32).reshape(1000, 300)
    out = rpc.rpc_sync(peer, np.multiply, (arr, 2))
    assert out.shape == arr.shape and np.array_equal(out, arr * 2)
    futs = [rpc.rpc_async(peer, add, (i, i)) for i in range(2000)]
    assert [f.wait(20) for f in futs] == [2 * i for i in range(2000)]
    assert rpc.rpc_async(peer, add, (np.ones(3), 1)).then(lambda f: f.value().sum()).wait(10) == 6
    try:
        rpc.rpc_sync(peer, boom, (5,))
        raise AssertionError("remote exception not raised")
    except RemoteError as exc:
        assert exc.worker_name == f"worker{peer}" and exc.exc_type == "builtins.KeyError", exc
        assert "in boom" in exc.remote_traceback and isinstance(exc.remote_exception, KeyError)
        assert f"worker{peer}" in str(exc)
    t0 = time.monotonic()
    try:
        rpc.rpc_sync(peer, time.sleep, (3.0,), timeout=0.2)
        raise AssertionError("timeout not raised")
    except DistTimeoutError as exc:
        assert f"worker{peer}" in str(exc) and time.monotonic() - t0 < 2.5, exc
    fut = rpc.rpc_async(peer, time.sleep, (1.5,), timeout=0.2)
    try:
        fut.wait(5)
        raise AssertionError("async timeout not raised")
    except DistTimeoutError:
        pass
    for bad in ("nobody", world, -1):
        try:
            rpc.rpc_sync(bad, add, (1, 2))
            raise AssertionError("unknown worker accepted")
        except ValueError as exc:
            assert "unknown worker" in str(exc)
    try:
        rpc.rpc_sync(peer, 42)
        raise AssertionError("non-callable accepted")
    except TypeError:
        pass
    try:
        rpc.rpc_sync(peer, nested_on_listener, (0,))
        raise AssertionError("blocking call on the listener accepted")
    except RemoteError as exc:
        assert "listener thread" in str(exc), exc
    agent = rpc.get_agent()
    assert agent.send(peer, 64, {"x": 1}, meta=("ctx", 7)).wait(10) == (0, {"x": 1}, ("ctx", 7), ("ctx", 7))
    # hooks: metadata attached to every request and response without changing the calls (distributed autograd)
    responses = []
    remove_send = agent.add_send_hook(lambda dst, kind, meta: ("ctx", 42) if kind == 1 else meta)
    remove_resp = agent.add_response_hook(lambda src, mid, kind, meta: responses.append((src, kind, meta)))
    rpc.rpc_sync(peer, add_reply_hook)
    assert rpc.rpc_sync(peer, meta_seen) == ("ctx", 42)
    assert rpc.rpc_async(peer, add, (2, 3)).wait(10) == 5
    assert responses[-1] == (peer, 1, ("reply-from", peer, ("ctx", 42))), responses
    remove_send()
    remove_resp()
    assert rpc.rpc_sync(peer, meta_seen) is None
    try:
        agent.send(peer, 65, None).wait(10)
        raise AssertionError("unknown kind accepted")
    except RemoteError as exc:
        assert "no handler for message kind 65" in str(exc)
    try:
        agent.register_handler(3, echo_meta)
        raise AssertionError("reserved kind accepted")
    except ValueError:
        pass
    # a malformed message is dropped with a recorded error and the agent keeps working
    from mpi4py import MPI
    from distlab.rpc.agent import TAG_HEADER
    agent.comm.Send([b"xx", MPI.BYTE], peer, TAG_HEADER)
    from distlab.rpc import framing
    from distlab._wire import RPC_KIND_CODES
    bad_batch = framing.pack_header(RPC_KIND_CODES["batch"], 0, 0, [], None, (), b"\x05\x00\x00\x00ab")
    agent.comm.Send([bad_batch, MPI.BYTE], peer, TAG_HEADER)
    assert rpc.rpc_sync(peer, add, (1, 1)) == 2
    errors = rpc.rpc_sync(peer, lambda: rpc.get_agent().errors)
    assert any("malformed RPC message" in e for e in errors), errors
    assert any("malformed RPC batch" in e for e in errors), errors
    for dst in range(1, world):
        rpc.rpc_sync(dst, finish)
else:
    assert _done.wait(60), "rank 0 never finished"
time.sleep(0.1 * rank)
rpc.shutdown()
for call in (lambda: rpc.rpc_sync(peer, add, (1, 2)), lambda: rpc.shutdown()):
    try:
        call()
        raise AssertionError("use after shutdown accepted")
    except RpcError as exc:
        assert "not initialized" in str(exc)
print(f"rpc agent OK rank {rank}", flush=True)
