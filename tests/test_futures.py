"""distlab.futures.Future: completion, chaining, errors, timeouts, collect_all, drivers."""
import datetime
import math
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distlab.errors import DistTimeoutError
from distlab.futures import Future, check_timeout, collect_all, default_timeout


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


def test_a_wait_without_timeout_leaves_the_driver_its_own():
    # A collective's future is driven by its Work, whose default is its process group's timeout: a wait() without
    # timeout (DDP's bucket wait, a hook's then()) used to impose DISTLAB_TIMEOUT on it, so a group made with
    # timeout=1 waited 300 s for a rank that never came.
    seen = []

    def driver(timeout):
        seen.append(timeout)
        parent.set_result(1)

    for make in (lambda: parent, lambda: parent.then(lambda f: f.value()), lambda: collect_all([parent])):
        parent = Future(driver=driver)
        make().wait()
    assert seen == [None, None, None]
    parent = Future(driver=driver)
    collect_all([parent.then(lambda f: f.value())]).wait(timeout=7)
    assert len(seen) == 4 and 6 < seen[-1] <= 7  # a given timeout still reaches the driver


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


# -- a failed or timed-out parent reaches every combinator ---------------------------------------------------
def _timed_out_driver(missing):
    error = DistTimeoutError(f"allreduce #3 of 'grad' timed out: ranks {missing} have not entered it",
                             op="allreduce", seq=3, name="grad", missing_ranks=missing, timeout=1.0)

    def driver(timeout):
        raise error

    return driver, error


def test_then_on_a_timed_out_parent_raises_the_parents_error():
    driver, error = _timed_out_driver([1])
    parent = Future(driver=driver, description="allreduce #3")
    child = parent.then(lambda f: f.value() * 2)
    grandchild = child.then(lambda f: f.value() + 1)
    for fut in (child, grandchild):
        with pytest.raises(DistTimeoutError) as caught:
            fut.wait(timeout=5)
        assert caught.value is error and caught.value.missing_ranks == [1]
        assert "ranks [1] have not entered it" in str(caught.value)


def test_then_on_a_failed_parent_fails_with_the_same_exception():
    error = DistTimeoutError("barrier #2 timed out: ranks [3] have not entered it", missing_ranks=[3])
    parent = Future()
    child = parent.then(lambda f: f.value())
    parent.set_exception(error)
    with pytest.raises(DistTimeoutError) as caught:
        child.wait(timeout=5)
    assert caught.value is error


def test_then_child_completed_by_a_parent_callback_still_running_in_another_thread():
    # The parent's earlier callback is slow: the parent is done (its event set) before the child's callback
    # ran. Waiting on the child must wait for it, not report the child "not completed yet".
    parent = Future(description="rpc")
    parent.add_done_callback(lambda f: time.sleep(0.3))
    child = parent.then(lambda f: f.value() + 1)
    threading.Timer(0.05, parent.set_result, args=(1,)).start()
    assert child.wait(timeout=10) == 2


def test_then_on_an_rpc_future_that_timed_out_raises_the_parents_timeout():
    parent = Future(description="rpc to worker1")
    child = parent.then(lambda f: f.value())
    with pytest.raises(DistTimeoutError, match="rpc to worker1 did not complete within 0.1 s"):
        child.wait(timeout=0.1)
    parent.set_result(5)  # the reply came after all: the child completes too
    assert child.wait() == 5


def test_collect_all_waits_for_callbacks_running_in_another_thread_and_keeps_timeouts():
    slow, fast = Future(), Future()
    slow.add_done_callback(lambda f: time.sleep(0.3))
    combined = collect_all([fast, slow])
    fast.set_result(0)
    threading.Timer(0.05, slow.set_result, args=(1,)).start()
    assert [f.value() for f in combined.wait(timeout=10)] == [0, 1]
    driver, error = _timed_out_driver([2])
    with pytest.raises(DistTimeoutError) as caught:
        collect_all([Future(driver=driver)]).wait(timeout=5)
    assert caught.value is error
    failed = Future()
    failed.set_exception(ValueError("bad"))
    assert collect_all([failed]).wait(timeout=5)[0].exception().args == ("bad",)


# -- timeouts: what is refused, what 0 and inf mean ----------------------------------------------------------
@pytest.mark.parametrize("bad, error, words", [
    (float("nan"), ValueError, "NaN"), (-1, ValueError, "negative"), (0, ValueError, "ambiguous"),
    (datetime.timedelta(0), ValueError, "ambiguous"), ("5", TypeError, "number of seconds"),
    (True, TypeError, "number of seconds"), (None, TypeError, "number of seconds"),
])
def test_check_timeout_refuses_what_is_not_a_timeout(bad, error, words):
    with pytest.raises(error, match=words) as caught:
        check_timeout(bad, "ProcessGroup(timeout)")
    assert "ProcessGroup(timeout)" in str(caught.value)


@given(st.floats(min_value=1e-3, max_value=1e9) | st.integers(min_value=1, max_value=10**9))
def test_check_timeout_accepts_positive_seconds_and_timedeltas(seconds):
    assert check_timeout(seconds, "t") == float(seconds)
    delta = datetime.timedelta(seconds=float(seconds))  # whole microseconds
    assert check_timeout(delta, "t") == delta.total_seconds()
    assert check_timeout(math.inf, "t") == math.inf


@pytest.mark.parametrize("value, words", [("nan", "NaN"), ("-1", "negative"), ("0", "ambiguous"),
                                          ("soon", "not a number")])
def test_default_timeout_refuses_bad_environment(monkeypatch, value, words):
    monkeypatch.setenv("DISTLAB_TIMEOUT", value)
    with pytest.raises(ValueError, match=words) as caught:
        default_timeout()
    assert "DISTLAB_TIMEOUT" in str(caught.value)


def test_infinite_timeout_means_no_deadline(monkeypatch):
    monkeypatch.setenv("DISTLAB_TIMEOUT", "inf")
    assert default_timeout() == math.inf
    fut = Future()
    threading.Timer(0.05, fut.set_result, args=("late",)).start()
    assert fut.wait() == "late"  # Event.wait(inf) would overflow
    with pytest.raises(ValueError, match="NaN"):
        Future().wait(timeout=float("nan"))


def test_importing_futures_does_not_import_mpi(impl):
    code = "import sys, distlab.futures; sys.exit('mpi4py' in sys.modules)"
    env = {**os.environ, "DISTLAB_IMPL": impl}
    assert subprocess.run([sys.executable, "-P", "-c", code], env=env, timeout=120).returncode == 0
