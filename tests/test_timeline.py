"""Chrome trace timelines: events per rank, merged into one file that Perfetto opens."""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab.timeline import Timeline, flow_id, merge, nesting_lanes, now_us


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


# -- lanes that nest: Perfetto's rule for complete events on one thread -------------------------------------------

def partial_overlaps(trace) -> dict:
    """Every lane's pairs of spans that partly overlap, as Perfetto reads the file (integer microseconds).

    Returns ``{(rank, lane name): [(span, span), ...]}`` for the lanes that break nesting; empty when every lane
    nests.
    """
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lanes: dict = {}
    for e in events:
        if e.get("ph") == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int), e
            lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = {}
    for key, spans in lanes.items():
        stack = []
        for span in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= span[0]:
                stack.pop()
            if stack and span[1] > stack[-1][1]:
                bad.setdefault((key[0], names.get(key)), []).append((stack[-1], span))
            stack.append(span)
    return bad


def _merged(tmp_path, per_rank_spans, lane="comm world"):
    path = str(tmp_path / "t.json")
    for rank, spans in per_rank_spans.items():
        tl = Timeline(path, rank=rank)
        for name, start, end in spans:
            tl.complete(name, 1e6 + start, 1e6 + end, lane=lane)
        tl.flush()
    merge(path)
    return json.load(open(path))


def test_partial_overlaps_finds_spans_that_cross_on_one_lane_only():
    # the check the example traces rely on: it must see a crossing pair, and only on the lane that has it
    meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": t, "args": {"name": f"lane {t}"}} for t in (1, 2)]
    spans = [{"ph": "X", "name": n, "pid": 0, "tid": t, "ts": ts, "dur": dur}
             for n, t, ts, dur in [("a", 1, 0, 50), ("b", 1, 30, 50), ("outer", 2, 0, 100), ("inner", 2, 10, 20),
                                   ("next", 2, 100, 5)]]
    bad = partial_overlaps({"traceEvents": meta + spans})
    assert list(bad) == [(0, "lane 1")]
    assert bad[(0, "lane 1")] == [((0, 50, "a"), (30, 80, "b"))]


def test_spans_in_flight_together_go_to_sub_lanes_that_nest(tmp_path):
    # bucket 0 and bucket 1 overlap partly; "step" contains both; "inner" lies inside bucket 0 (and bucket 1)
    trace = _merged(tmp_path, {0: [("step", 0, 100), ("bucket 0", 10, 50), ("bucket 1", 30, 80),
                                   ("bucket 2", 60, 90), ("inner", 35, 40)]})
    assert partial_overlaps(trace) == {}
    lanes = {e["tid"]: e["args"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert [a["name"] for _, a in sorted(lanes.items())] == ["comm world", "comm world (2)"]
    assert {a["lane"] for a in lanes.values()} == {"comm world"}
    where = {e["name"]: lanes[e["tid"]]["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert where == {"step": "comm world", "bucket 0": "comm world", "bucket 2": "comm world",
                     "bucket 1": "comm world (2)", "inner": "comm world"}


def test_a_lane_that_nests_is_left_alone(tmp_path):
    trace = _merged(tmp_path, {0: [("a", 0, 10), ("b", 10, 20), ("c", 12, 15)], 1: [("a", 0, 10)]})
    lanes = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    assert lanes == ["comm world", "comm world"]


def test_timestamps_are_whole_microseconds_and_spans_ending_together_still_nest(tmp_path):
    # ends differing below a microsecond: rounded separately they could cross; rounding start and end keeps order
    trace = _merged(tmp_path, {0: [("outer", 0.4, 10.4999), ("inner", 0.6, 10.4998)]})
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert all(isinstance(e["ts"], int) and isinstance(e["dur"], int) for e in spans.values())
    assert partial_overlaps(trace) == {}
    assert len({e["tid"] for e in spans.values()}) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1000, allow_nan=False), st.floats(0, 300, allow_nan=False)), max_size=40))
def test_nesting_lanes_always_nest_and_reuse_lanes(spans):
    spans = [(start, start + length) for start, length in spans]
    lanes = nesting_lanes(spans)
    assert len(lanes) == len(spans)
    for lane in set(lanes):
        mine = sorted((spans[i] for i in range(len(spans)) if lanes[i] == lane), key=lambda s: (s[0], -s[1]))
        stack = []
        for start, end in mine:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1]
            stack.append(end)
    # never more sub-lanes than spans overlapping at one instant (greedy first-fit on interval graphs)
    if spans:
        points = sorted({s for s, _ in spans})
        depth = max(sum(1 for s, e in spans if s <= p < e) for p in points)
        assert max(lanes) + 1 <= max(depth, 1)


def test_messages_are_flows_from_the_sender_to_the_receiver(tmp_path):
    path = str(tmp_path / "m.json")
    fid = flow_id("call", 0, 1, 7)
    assert fid == flow_id("call", 0, 1, 7) != flow_id("call", 0, 1, 8) and 0 <= fid < 2 ** 53
    sender, receiver = Timeline(path, rank=0), Timeline(path, rank=1)
    sender.send("call f", 1, fid, args={"mid": 7})
    receiver.receive("call f", 0, fid)
    sender.flush(), receiver.flush()
    merge(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("bind_id") == fid]
    out, into = sorted(events, key=lambda e: e["pid"])
    assert out["ph"] == into["ph"] == "X" and out["flow_out"] and into["flow_in"]
    assert out["args"] == {"to": 1, "mid": 7} and into["args"] == {"from": 0}
    assert "flow_in" not in out and "flow_out" not in into


def test_a_disabled_timeline_records_no_messages():
    tl = Timeline(None)
    tl.send("x", 1, 3)
    tl.receive("x", 1, 3)
    assert tl.events() == []


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.mpi
@pytest.mark.parametrize("script, np_, args", [
    ("train_ddp.py", 2, ["--epochs", "3", "--target", "0"]),
    ("uneven_inputs.py", 2, ["--batches", "9"]),
    ("dist_autograd_pipeline.py", 3, []),
    ("parameter_server.py", 3, []),
], ids=lambda v: v if isinstance(v, str) else None)
def test_every_lane_of_the_examples_traces_nests(mpirun, tmp_path, script, np_, args):
    path = tmp_path / "trace.json"
    mpirun(str(EXAMPLES / script), np=np_, args=args, timeout=240, timeline=str(path))
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) > 20 and {e["pid"] for e in spans} == set(range(np_))
    bad = partial_overlaps(trace)
    assert bad == {}, {lane: pairs[:3] for lane, pairs in bad.items()}


@pytest.mark.mpi
def test_rpc_messages_are_recorded_at_both_ends(mpirun, tmp_path):
    from distlab.viz import load_trace

    path = tmp_path / "rpc.json"
    mpirun("rpc_lifecycle.py", np=2, timeout=120, timeline=str(path))
    trace = load_trace(str(path))
    sent = {e["bind_id"]: e for e in trace.events if e.get("flow_out")}
    received = {e["bind_id"]: e for e in trace.events if e.get("flow_in")}
    assert set(received) <= set(sent) and len(trace.messages) == len(received) > 5  # paired by their flow ids
    # the scenario's non-graceful shutdown may leave its call in flight, or the call's response, unreceived
    lost = [e["name"] for key, e in sent.items() if key not in received]
    assert len(lost) <= 1 and all(name.split()[0] in ("call", "response") for name in lost), lost
    kinds = {(m.src, m.dst, m.name.split()[0]) for m in trace.messages}
    assert {(0, 1, "call"), (1, 0, "response")} <= kinds, sorted(kinds)
    assert all(m.received >= m.sent and m.args["mid"] >= 1 for m in trace.messages)
