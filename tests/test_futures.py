"""distlab.futures.Future: completion, chaining, errors, timeouts, collect_all, drivers."""
import threading
import time

import pytest

from distlab.errors import DistTimeoutError
from distlab.futures import Future, collect_all, default_timeout


def test_result_and_callbacks_in_order():
    fut, seen = Future(), []
    fut.add_done_callback(lambda f: seen.append(("a", f.value())))
    fut.add_done_callback(lambda f: seen.append(("b", f.value())))
    assert not fut.done()
    fut.set_result(5)
    assert fut.done() and fut.wait() == 5 and fut.value() == 5
    fut.add_done_callback(lambda f: seen.append(("late", f.value())))  # runs at once
    assert seen == [("a", 5), ("b", 5), ("late", 5)]


def test_value_before_completion_is_an_error():
    with pytest.raises(RuntimeError, match="not completed"):
        Future().value()


def test_completing_twice_is_an_error():
    fut = Future()
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="already completed"):
        fut.set_result(2)


def test_exception_propagates_through_then():
    fut = Future()
    chained = fut.then(lambda f: f.value() + 1)
    fut.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        chained.wait()
    with pytest.raises(TypeError):
        fut.set_exception("not an exception")


def test_then_chains_values_and_callback_errors():
    fut = Future()
    doubled = fut.then(lambda f: f.value() * 2)
    broken = doubled.then(lambda f: 1 / 0)
    fut.set_result(21)
    assert doubled.wait() == 42
    with pytest.raises(ZeroDivisionError):
        broken.wait()


def test_wait_from_another_thread_and_timeout():
    fut = Future(description="rpc to worker1")
    threading.Timer(0.05, fut.set_result, args=("ok",)).start()
    assert fut.wait(timeout=5) == "ok"
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="rpc to worker1 did not complete within 0.1 s"):
        Future(description="rpc to worker1").wait(timeout=0.1)
    assert time.monotonic() - start < 2


def test_driver_is_used_to_make_progress():
    calls = []

    def driver(timeout):
        calls.append(timeout)
        fut.set_result("driven")

    fut = Future(driver=driver)
    assert fut.wait(timeout=3) == "driven" and calls == [3]
    chained = Future(driver=lambda t: parent.set_result(1))
    parent = chained  # a chained future waits on its parent's driver
    assert chained.wait(1) == 1


def test_collect_all():
    futs = [Future() for _ in range(3)]
    combined = collect_all(futs)
    for i, f in enumerate(futs):
        assert not combined.done()
        f.set_result(i)
    assert [f.value() for f in combined.wait()] == [0, 1, 2]
    assert collect_all([]).wait() == []


def test_default_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("DISTLAB_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    monkeypatch.setenv("DISTLAB_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="not a number"):
        default_timeout()
    monkeypatch.delenv("DISTLAB_TIMEOUT")
    assert default_timeout() == 300
