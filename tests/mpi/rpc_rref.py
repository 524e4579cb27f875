"""RRefs on N ranks: all fork cases, RRefs as arguments and return values, debug info, proxies, errors,
timeouts, graceful shutdown with nothing leaked. ``mixed``: even ranks run the reference twin, odd the core."""
import os
import sys
import threading
import time

import numpy as np

if len(sys.argv) > 1 and sys.argv[1] == "mixed":
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab.rpc as rpc
from distlab import _backend
from distlab.errors import DistTimeoutError, RemoteError, RRefCreationTimeoutError, RRefDeletedError
from distlab.rpc import RRef, rref_debug_info

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
_done = threading.Event()
_held = []


def finish():
    _done.set()


def make(x):
    return np.full(4, x, dtype=np.int64)


def hold(rref):
    _held.append(rref)
    return rref.confirmed_by_owner(), rref.is_owner()


def clear():
    _held.clear()


def fetch(rref):
    return rref.to_here()


def fetch_from(rref, via):
    # user -> user again: forward the RRef to a third worker
    return rpc.rpc_sync(via, fetch, (rref,))


def give_back(rref):
    return rref          # an RRef as a return value


def new_rref(x):
    return RRef(make(x))  # an owner's local RRef returned to the caller (owner -> user)


def debug():
    return rref_debug_info()


def wait_until(pred, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {rref_debug_info()}")
        time.sleep(0.005)


def wait_remote(dst, key, value, timeout=20):
    deadline = time.monotonic() + timeout
    while rpc.rpc_sync(dst, debug)[key] != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {dst}: {key} never became {value}: {rpc.rpc_sync(dst, debug)}")
        time.sleep(0.005)


rpc.init_rpc(f"w{rank}", rpc_timeout=30)
impl = _backend.active_impl()
if rank == 0:
    peers = list(range(1, world))
    # -- local RRef: not registered until forked
    local = RRef(make(1))
    assert local.is_owner() and local.confirmed_by_owner() and local.owner_name() == "w0"
    assert np.array_equal(local.local_value(), make(1)) and np.array_equal(local.to_here(), make(1))
    assert rref_debug_info()["num_owner_rrefs"] == 0
    assert repr(local).startswith("OwnerRRef(rref_id=GloballyUniqueId(created_on=0")
    # -- owner -> user (shared RRef): the owner counts the fork until the user drops it
    assert rpc.rpc_sync(1, hold, (local,)) == (True, False)
    info = rref_debug_info()
    assert info["num_owner_rrefs"] == 1 and info["num_forks"] == 1, info
    rpc.rpc_sync(1, clear)
    wait_until(lambda: rref_debug_info()["num_owner_rrefs"] == 0, "the owner to drop the shared RRef")
    # -- owner -> self
    assert np.array_equal(rpc.rpc_sync(0, fetch, (local,)), make(1))
    assert rref_debug_info()["num_forks"] == 0
    for dst in peers:
        # -- remote + to_here: the user is confirmed, the owner holds it
        r = rpc.remote(f"w{dst}", make, (dst,))
        assert not r.is_owner() and r.owner() == rpc.get_worker_info(f"w{dst}") and r.owner_name() == f"w{dst}"
        assert repr(r).startswith("UserRRef(rref_id=GloballyUniqueId(created_on=0")
        assert np.array_equal(r.to_here(), make(dst))
        wait_until(r.confirmed_by_owner, "confirmation")
        assert rref_debug_info()["num_pending_users"] == 0
        assert rpc.rpc_sync(dst, debug)["num_owner_rrefs"] >= 1
        # -- user -> owner
        assert np.array_equal(rpc.rpc_sync(dst, fetch, (r,)), make(dst))
        # -- user -> user (and on to a third worker), user -> self
        for via in range(world):
            assert np.array_equal(rpc.rpc_sync(via, fetch, (r,)), make(dst))
            third = (via + 1) % world
            assert np.array_equal(rpc.rpc_sync(via, fetch_from, (r, third)), make(dst))
        # -- RRefs as return values (user to user, owner to user)
        back = rpc.rpc_sync((dst + 1) % world, give_back, (r,))
        assert np.array_equal(back.to_here(), make(dst)) and not back.is_owner()
        made = rpc.rpc_sync(dst, new_rref, (dst + 10,))
        assert made.owner_name() == f"w{dst}" and np.array_equal(made.to_here(), make(dst + 10))
        # -- proxies
        assert r.rpc_sync().sum() == 4 * dst
        assert r.rpc_async().tolist().wait(10) == [dst] * 4
        assert np.array_equal(r.remote().__mul__(2).to_here(), make(2 * dst))
        # -- deletion: the owner's count drops when every user is gone
        del r, back, made
        wait_remote(dst, "num_owner_rrefs", 0)
    # -- remote to self
    s = rpc.remote("w0", make, (7,))
    assert s.is_owner() and np.array_equal(s.to_here(), make(7)) and np.array_equal(s.local_value(), make(7))
    # -- remote exceptions through to_here
    e = rpc.remote(1, np.reshape, (np.arange(3), (2, 2)))
    try:
        e.to_here()
        raise AssertionError("remote error not raised")
    except RemoteError as exc:
        assert exc.worker_name == "w1" and "ValueError" in exc.exc_type and "reshape" in str(exc), exc
    # -- to_here timeout (the value is not ready), then a creation timeout
    slow = rpc.remote(1, time.sleep, (3.0,))
    t0 = time.monotonic()
    try:
        slow.to_here(timeout=0.2)
        raise AssertionError("to_here timeout not raised")
    except DistTimeoutError as exc:
        assert time.monotonic() - t0 < 2.5 and "w1" in str(exc)
    late = rpc.remote(1, time.sleep, (0.6,), timeout=0.1)
    time.sleep(0.2)
    try:
        late.to_here()
        raise AssertionError("creation timeout not raised")
    except RRefCreationTimeoutError as exc:
        assert "timed out" in str(exc)
    # -- many in flight at once, dropped without waiting
    rrefs = [rpc.remote(dst, make, (i,)) for i in range(200) for dst in peers]
    assert [int(x.to_here()[0]) for x in rrefs[::len(peers)]] == list(range(200))
    del rrefs
    # -- RRef pickled outside an RPC is refused
    import pickle
    try:
        pickle.dumps(local)
        raise AssertionError("bare pickling accepted")
    except pickle.PicklingError:
        pass
    kept = rpc.remote(1, make, (3,))   # still referenced at shutdown: graceful shutdown deletes it
    kept.to_here()
    for dst in peers:
        rpc.rpc_sync(dst, finish)
else:
    assert _done.wait(90), "rank 0 never finished"
rpc.shutdown()   # raises RRefLeakError if anything leaked
if rank == 0:
    try:
        kept.to_here()
        raise AssertionError("to_here after shutdown accepted")
    except RRefDeletedError as exc:
        assert "has been deleted" in str(exc)
    try:
        kept.rpc_sync().sum()
        raise AssertionError("proxy after shutdown accepted")
    except RRefDeletedError as exc:
        assert "Cannot call a proxy" in str(exc)
print(f"rref OK rank {rank} impl {impl}", flush=True)
