"""Distributed autograd containers (ANCHORS section 4): ids, init, contexts, current context per thread, context
contents, outstanding RPCs; run on both twins, plus a twin equivalence test over random operation sequences."""
from __future__ import annotations

import os

import random
import threading

import numpy as np
import pytest

from distlab import _backend
from distlab._common.autograd_container import AUTO_INCREMENT_MASK, INVALID_CONTEXT_ID, worker_of
from distlab.autograd import SparseGrad, Tensor
from distlab.errors import AutogradContextNotFoundError, AutogradIdOverflowError, DistAutogradError
from distlab.futures import Future


@pytest.fixture
def ac(autograd_container):
    """The twin's module with its per-worker singleton reset around the test."""
    autograd_container.shutdown()
    yield autograd_container
    autograd_container.shutdown()


# -- ids ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("worker", [0, 1, 7, 65535])
def test_ids_carry_the_worker_id(ac, worker):
    c = ac.DistAutogradContainer(worker)
    base = worker << 48
    assert c.worker_id == worker
    assert c.max_id == base | AUTO_INCREMENT_MASK
    ctx = c.new_context()
    assert ctx.context_id == base
    assert [c.new_autograd_message_id() for _ in range(3)] == [base, base + 1, base + 2]
    c.release_context(ctx.context_id)
    assert c.new_context().context_id == base + 1
    assert worker_of(c.new_autograd_message_id()) == worker


@pytest.mark.parametrize("worker", [-1, 65536, 1 << 20])
def test_worker_id_range(ac, worker):
    with pytest.raises(ValueError, match=r"range \[0, 65535\]"):
        ac.DistAutogradContainer(worker)
    with pytest.raises(ValueError, match=r"range \[0, 65535\]"):
        ac.init(worker)
    assert not ac.is_initialized()


def test_bad_shards_and_start(ac):
    with pytest.raises(ValueError, match="power of two"):
        ac.DistAutogradContainer(0, num_shards=3)
    with pytest.raises(ValueError, match="start"):
        ac.DistAutogradContainer(0, start=AUTO_INCREMENT_MASK + 1)


def test_context_id_overflow(ac):
    c = ac.DistAutogradContainer(2, start=AUTO_INCREMENT_MASK - 1)
    last = c.new_context()
    assert last.context_id == c.max_id - 1
    c.release_context(last.context_id)
    with pytest.raises(AutogradIdOverflowError, match="context id overflow on worker 2"):
        c.new_context()
    assert c.current_context_id() == INVALID_CONTEXT_ID
    assert c.num_autograd_contexts() == 0


def test_message_id_overflow(ac):
    c = ac.DistAutogradContainer(65535, start=AUTO_INCREMENT_MASK - 1)
    assert c.new_autograd_message_id() == c.max_id - 1 == (65535 << 48) | (AUTO_INCREMENT_MASK - 1)
    with pytest.raises(AutogradIdOverflowError, match="message id overflow on worker 65535"):
        c.new_autograd_message_id()
    with pytest.raises(OverflowError):  # the shared error is an OverflowError too
        c.new_autograd_message_id()


# -- init once per worker --------------------------------------------------------------------------------------
def test_init_once(ac):
    with pytest.raises(DistAutogradError, match="not initialized"):
        ac.get_container()
    c = ac.init(4)
    assert ac.is_initialized() and ac.get_container() is c
    assert ac.init(4) is c
    with pytest.raises(DistAutogradError, match="already initialized with worker_id: 4.*different worker_id: 5"):
        ac.init(5)
    ac.shutdown()
    assert not ac.is_initialized()
    assert ac.init(5).worker_id == 5


# -- contexts ---------------------------------------------------------------------------------------------------
def test_nested_context_is_an_error(ac):
    c = ac.DistAutogradContainer(1)
    ctx = c.new_context()
    assert c.current_context() is ctx and c.has_valid_context()
    with pytest.raises(DistAutogradError, match="Already have an autograd context id for this thread"):
        c.new_context()
    with pytest.raises(DistAutogradError, match="Already have an autograd context id"):
        c.set_current_context_id(123)
    c.release_context(ctx.context_id)
    assert c.current_context_id() == INVALID_CONTEXT_ID
    assert c.new_context().context_id == ctx.context_id + 1


def test_no_current_context(ac):
    c = ac.DistAutogradContainer(1)
    assert not c.has_valid_context()
    with pytest.raises(DistAutogradError, match=r"with distlab.distributed_autograd.context\(\) as context_id"):
        c.current_context()
    c.force_current_context_id(99)  # a current id whose context does not exist
    assert not c.has_valid_context()
    with pytest.raises(AutogradContextNotFoundError, match="Could not find autograd context with id: 99"):
        c.current_context()
    assert c.force_current_context_id(-1) == 99
    assert c.current_context_id() == INVALID_CONTEXT_ID


def test_retrieve_release(ac):
    c = ac.DistAutogradContainer(1)
    with pytest.raises(AutogradContextNotFoundError, match="Could not find autograd context with id: 5 on worker 1"):
        c.retrieve_context(5)
    with pytest.raises(LookupError):
        c.release_context(5)
    assert c.release_context_if_present(5) == set()
    remote_id = (3 << 48) | 17
    ctx = c.get_or_create_context(remote_id)
    assert c.get_or_create_context(remote_id) is ctx is c.retrieve_context(remote_id)
    assert c.current_context_id() == INVALID_CONTEXT_ID  # the receiving side does not adopt it
    ctx.add_known_worker_id(2)
    ctx.add_known_worker_id(0)
    assert c.release_context_if_present(remote_id) == {0, 2}
    assert c.release_context_if_present(remote_id) == set()
    with pytest.raises(AutogradContextNotFoundError):
        c.retrieve_context(remote_id)


def test_release_from_another_thread_keeps_this_threads_current_id(ac):
    c = ac.DistAutogradContainer(0)
    ctx = c.new_context()
    t = threading.Thread(target=c.release_context, args=(ctx.context_id,))
    t.start()
    t.join(10)
    assert c.num_autograd_contexts() == 0
    assert c.current_context_id() == ctx.context_id and not c.has_valid_context()
    c.clear_current_context_id()


def test_current_context_is_per_thread(ac):
    c = ac.DistAutogradContainer(6)
    mine = c.new_context()
    seen = {}

    def other():
        seen["before"] = c.current_context_id()
        ctx = c.new_context()
        seen["own"] = ctx.context_id
        seen["current"] = c.current_context().context_id
        c.release_context(ctx.context_id)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert seen == {"before": INVALID_CONTEXT_ID, "own": mine.context_id + 1, "current": mine.context_id + 1}
    assert c.current_context() is mine


def test_sharded_map_and_concurrent_ids(ac):
    c = ac.DistAutogradContainer(9, num_shards=4)
    made, ids = [], []
    lock = threading.Lock()

    def work():
        local = []
        for _ in range(50):
            ctx = c.new_context()
            local.append(ctx.context_id)
            c.clear_current_context_id()
            local.append(c.new_autograd_message_id())
        with lock:
            ids.extend(local)
            made.extend(local[::2])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(made)) == 200 and c.num_autograd_contexts() == 200
    assert c.context_ids() == sorted(made)
    assert len(set(ids[1::2])) == 200
    for cid in made[:100]:
        c.release_context(cid)
    assert c.num_autograd_contexts() == 100


@pytest.mark.parametrize("num_shards", [1, 2, 128])
def test_any_power_of_two_of_shards_holds_every_context(ac, num_shards):
    """A single shard (mask 0) and the default's many shards hold the same contexts, local and remote."""
    c = ac.DistAutogradContainer(3, num_shards=num_shards)
    made = []
    for _ in range(5):
        made.append(c.new_context().context_id)
        c.clear_current_context_id()
    remote = [c.get_or_create_context((5 << 48) | n).context_id for n in (1, 2, 255)]
    assert c.context_ids() == sorted(made + remote) and c.num_autograd_contexts() == 8
    for cid in made + remote:
        assert c.retrieve_context(cid).context_id == cid
    assert c.release_context(made[1]) == set() and c.release_context_if_present(remote[2]) == set()
    assert c.context_ids() == sorted(made[:1] + made[2:] + remote[:2])


# -- context contents -----------------------------------------------------------------------------------------
def test_known_workers_and_functions(ac):
    ctx = ac.DistAutogradContext(42)
    assert ctx.context_id == 42 and ctx.known_worker_ids() == set()
    for w in (3, 1, 3):
        ctx.add_known_worker_id(w)
    assert ctx.known_worker_ids() == {1, 3}
    send, recv = object(), object()
    ctx.add_send_function(send, 7)
    ctx.add_recv_function(recv, 7)  # same id on both sides is fine (a worker may call itself)
    assert ctx.send_functions() == {7: send} and ctx.recv_functions() == {7: recv}
    assert ctx.retrieve_send_function(7) is send
    with pytest.raises(DistAutogradError, match="already has a send function for message id 7"):
        ctx.add_send_function(object(), 7)
    with pytest.raises(DistAutogradError, match="already has a recv function for message id 7"):
        ctx.add_recv_function(object(), 7)
    with pytest.raises(DistAutogradError, match="None send function"):
        ctx.add_send_function(None, 8)
    with pytest.raises(DistAutogradError, match="Could not find send function for autograd message id 9"):
        ctx.retrieve_send_function(9)
    ctx.send_functions().clear()  # a copy
    assert len(ctx.send_functions()) == 1


def test_accumulated_gradients(ac):
    ctx = ac.DistAutogradContext(1)
    a = Tensor(np.zeros(3, np.float32), requires_grad=True)
    b = Tensor(np.zeros((4, 2)), requires_grad=True)
    g = np.ones(3, np.float64)
    ctx.accumulate_grad(a, g)
    g[:] = 100  # stored privately, in the parameter's dtype
    grads = ctx.get_gradients()
    assert list(grads) == [a] and grads[a].data.dtype == np.float32
    np.testing.assert_array_equal(grads[a].data, [1, 1, 1])
    ctx.accumulate_grad(a, np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(grads[a].data, [1, 1, 1])  # an earlier result never changes
    np.testing.assert_array_equal(ctx.get_gradients()[a].data, [3, 3, 3])
    ctx.accumulate_grad(b, SparseGrad(np.array([1, 1]), np.ones((2, 2)), (4, 2)))
    ctx.accumulate_grad(b, SparseGrad(np.array([3]), np.ones((1, 2)), (4, 2)))
    sparse = ctx.get_gradients()[b]
    assert isinstance(sparse, SparseGrad)
    np.testing.assert_array_equal(sparse.to_dense(), [[0, 0], [2, 2], [0, 0], [1, 1]])
    ctx.accumulate_grad(b, np.ones((4, 2)))
    np.testing.assert_array_equal(ctx.get_gradients()[b].data, [[1, 1], [3, 3], [1, 1], [2, 2]])
    assert a.grad is None and b.grad is None  # never written to .grad


def test_outstanding_rpcs_first_error_wins(ac):
    ctx = ac.DistAutogradContext(1)
    done = ctx.clear_and_wait_for_outstanding_rpcs_async()
    assert done.done() and done.value() is None
    futs = [Future() for _ in range(3)]
    for f in futs:
        ctx.add_outstanding_rpc(f)
    assert ctx.num_outstanding_rpcs() == 3
    waiter = ctx.clear_and_wait_for_outstanding_rpcs_async()
    assert ctx.num_outstanding_rpcs() == 0
    futs[0].set_result(1)
    assert not waiter.done()
    futs[2].set_exception(ValueError("first"))
    assert waiter.done()  # completes at the first error, not waiting for futs[1]
    futs[1].set_exception(KeyError("second"))
    with pytest.raises(ValueError, match="first"):
        waiter.value()
    ok = [Future(), Future()]
    for f in ok:
        ctx.add_outstanding_rpc(f)
    waiter = ctx.clear_and_wait_for_outstanding_rpcs_async()
    for f in ok:
        f.set_result(None)
    assert waiter.value() is None
    ctx.add_outstanding_rpc(Future())
    ctx.clear_outstanding_rpcs()
    assert ctx.num_outstanding_rpcs() == 0


def test_graph_task_slot(ac):
    ctx = ac.DistAutogradContext(1)
    assert ctx.retrieve_graph_task() is None
    ctx.set_graph_task("task")
    with pytest.raises(DistAutogradError, match="already has a running backward pass"):
        ctx.set_graph_task("other")
    assert ctx.retrieve_graph_task() == "task"
    ctx.reset_graph_task()
    ctx.set_graph_task("other")


def test_metadata(ac):
    m = ac.AutogradMetadata(1 << 48, (1 << 48) + 5)
    assert m.to_tuple() == (1 << 48, (1 << 48) + 5)
    assert m == ac.AutogradMetadata(*m.to_tuple()) and hash(m) == hash(ac.AutogradMetadata(*m.to_tuple()))
    assert m != ac.AutogradMetadata(1, 2) and "message_id" in repr(m)


# -- twin equivalence -------------------------------------------------------------------------------------------
def _scenario(module, seed):
    """Run a seeded random sequence of container operations; return the trace of results and errors."""
    rng = random.Random(seed)
    c = module.DistAutogradContainer(rng.randrange(0, 8), num_shards=8, start=AUTO_INCREMENT_MASK - 40)
    trace = []
    for _ in range(120):
        op = rng.choice(["new", "msg", "get", "retrieve", "release", "release_if", "known", "send", "recv", "ids",
                         "current", "force", "clear"])
        cid = rng.choice([(c.worker_id << 48) | (AUTO_INCREMENT_MASK - 40 + rng.randrange(8)), (5 << 48) | 3])
        try:
            if op == "new":
                out = c.new_context().context_id
            elif op == "msg":
                out = c.new_autograd_message_id()
            elif op == "get":
                out = c.get_or_create_context(cid).context_id
            elif op == "retrieve":
                out = repr(c.retrieve_context(cid))
            elif op == "release":
                out = sorted(c.release_context(cid))
            elif op == "release_if":
                out = sorted(c.release_context_if_present(cid))
            elif op == "known":
                c.retrieve_context(cid).add_known_worker_id(rng.randrange(4))
                out = sorted(c.retrieve_context(cid).known_worker_ids())
            elif op in ("send", "recv"):
                ctx = c.retrieve_context(cid)
                getattr(ctx, f"add_{op}_function")(f"{op}fn", rng.randrange(4))
                out = sorted(getattr(ctx, f"{op}_functions")().items())
            elif op == "ids":
                out = (c.context_ids(), c.num_autograd_contexts())
            elif op == "current":
                out = repr(c.current_context())
            elif op == "force":
                out = c.force_current_context_id(rng.choice([cid, -1]))
            else:
                c.clear_current_context_id()
                out = c.current_context_id()
            trace.append((op, "ok", out))
        except Exception as exc:  # noqa: BLE001 - errors are part of the trace
            trace.append((op, type(exc).__name__, str(exc)))
    return trace


@pytest.mark.parametrize("seed", range(12))
def test_twins_trace_identically(seed):
    if not _backend.core_available():
        (pytest.fail if os.environ.get("CI", "").lower() in ("1", "true", "yes") else pytest.skip)(
            "the core twin is not compiled")
    twins = _backend.load_twins("autograd_container")
    ref, core = (_scenario(twins[i], seed) for i in ("reference", "core"))
    assert ref == core
    assert any(kind != "ok" for _op, kind, _out in ref)  # the scenario reaches error paths


def test_ids_are_unsigned_64_bit(ac):
    c = ac.DistAutogradContainer(0)
    for bad in (-5, 1 << 64):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            c.retrieve_context(bad)
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            c.get_or_create_context(bad)
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            ac.DistAutogradContext(1).add_send_function(object(), bad)
    assert c.get_or_create_context((1 << 64) - 1).context_id == (1 << 64) - 1


def test_ids_of_other_integer_types(ac):
    """numpy integers and other int-convertible ids are accepted as the reference's int() accepts them."""
    c = ac.DistAutogradContainer(0)
    ctx = c.get_or_create_context(np.uint64((1 << 64) - 2))
    assert c.retrieve_context(np.uint64((1 << 64) - 2)) is ctx and c.retrieve_context((1 << 64) - 2) is ctx
    assert c.release_context_if_present(np.int64(3)) == set()
    for bad in (np.int64(-1), -(1 << 70)):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            c.retrieve_context(bad)
    with pytest.raises(TypeError):
        c.retrieve_context(None)
    ctx.add_send_function("fn", np.int32(9))
    assert ctx.send_functions() == {9: "fn"}
