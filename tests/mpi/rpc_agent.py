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


_released = threading.Event()


def wait_for_release():
    """Blocks until release() runs here: it can only if this worker listens while this handler blocks (the
    standby takes the seat of the thread that runs it)."""
    return "released" if _released.wait(15) else "never released"


def release():
    _released.set()


def ping(n, a, b):
    """a -> b -> a -> ...: each level blocks in rpc_sync while the next runs on the other worker."""
    me = rpc.get_worker_info().id
    return [me] if n == 0 else [me] + rpc.rpc_sync(b if me == a else a, ping, (n - 1, a, b))


def slow_or_not(i):
    if i == 37:
        time.sleep(0.05)   # longer than the takeover: the rest of its batch goes on on another thread
    return i * i


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
    # The reply to a call that timed out comes later to this thread's reply slot: dropped, never taken for the
    # answer of the next call.
    try:
        rpc.rpc_sync(peer, time.sleep, (0.3,), timeout=0.05)
        raise AssertionError("timeout not raised")
    except DistTimeoutError:
        pass
    time.sleep(0.5)
    assert rpc.rpc_sync(peer, add, (20, 3)) == 23
    # A handler that blocks leaves its worker listening: release() reaches the worker while wait_for_release()
    # blocks there (it would wait 15 s, and say so, if the worker were deaf meanwhile).
    blocked = []
    waiter_thread = threading.Thread(target=lambda: blocked.append(rpc.rpc_sync(peer, wait_for_release)))
    waiter_thread.start()
    time.sleep(0.1)
    rpc.rpc_sync(peer, release)
    waiter_thread.join(30)
    assert blocked == ["released"], blocked
    # calls that call back, each level blocking its worker's handler while the next one runs
    assert rpc.rpc_sync(peer, ping, (5, 0, peer)) == [peer, 0, peer, 0, peer, 0]
    # many in flight: sent in batches, run by the listener; one handler stays away past the takeover, and the
    # rest of its batch still runs, in order of arrival
    assert [f.wait(20) for f in [rpc.rpc_async(peer, slow_or_not, (i,)) for i in range(200)]] == [
        i * i for i in range(200)]
    # every reply slot taken: a blocking call's reply comes through the listener instead
    agent = rpc.get_agent()
    saved, agent._replies._free_slots = agent._replies._free_slots, []
    through_listener = []
    helper = threading.Thread(target=lambda: through_listener.append(rpc.rpc_sync(peer, add, (4, 4))))
    helper.start()
    helper.join(30)
    agent._replies._free_slots = saved + agent._replies._free_slots
    assert through_listener == [8], through_listener
    # how the agent's threads wait: the core twin calls libmpi (the mpich wheel's), the reference mpi4py
    assert agent.wait_path == ("mpi4py" if os.environ.get("DISTLAB_IMPL") == "reference" else "libmpi"), \
        agent.wait_path
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
