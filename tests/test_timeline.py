"""Chrome trace timelines: events per rank, merged into one file that Perfetto opens."""
import json

import pytest

from distlab.timeline import Timeline, merge, now_us


def test_events_and_merge(tmp_path):
    path = str(tmp_path / "trace.json")
    for rank in (0, 1):
        tl = Timeline(path, rank=rank)
        start = now_us()
        tl.complete("allreduce bucket0", start, start + 10, cat="comm", lane="comm", args={"bytes": 64})
        tl.instant("grad ready: fc.weight", lane="autograd")
        tl.counter("cache", {"hits": 3})
        with tl.span("step", lane="main"):
            pass
        tl.flush()
    assert merge(path, expected_parts=2) == path
    trace = json.load(open(path))
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["name"] for e in events}
    assert {"allreduce bucket0", "grad ready: fc.weight", "cache", "step", "process_name", "thread_name"} <= names
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    assert min(e["ts"] for e in events if "ts" in e) == 0  # rebased
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"comm", "autograd", "main"}
    assert not list(tmp_path.glob("trace.json.rank*"))  # parts removed


def test_disabled_timeline_records_nothing(tmp_path):
    tl = Timeline(None)
    tl.complete("x", now_us())
    tl.instant("y")
    assert tl.events() == [] and tl.flush() is None


def test_merge_without_parts_returns_none(tmp_path):
    assert merge(str(tmp_path / "none.json")) is None


def test_merge_waits_for_expected_parts_only_as_long_as_asked(tmp_path):
    path = str(tmp_path / "t.json")
    Timeline(path, rank=0).flush()
    assert merge(path, expected_parts=2, wait=0.2) == path  # merges what is there once the wait is over
    assert json.load(open(path))["otherData"]["ranks"] == 1


@pytest.mark.mpi
def test_launcher_writes_a_merged_timeline_of_collectives(mpirun, tmp_path):
    path = tmp_path / "demo.json"
    mpirun("comm_collectives.py", np=2, timeline=str(path))
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "comm"]
    assert {e["pid"] for e in spans} == {0, 1}
    ops = {e["args"]["op"] for e in spans}
    assert {"allreduce", "broadcast", "allgather", "barrier", "reduce_scatter", "alltoall"} <= ops
    assert all("seq" in e["args"] and "bytes" in e["args"] for e in spans)
