"""distlab.viz: reading traces, and figures whose contents come from the trace and stay inside the figure."""
import json
import subprocess
import sys

import pytest

from distlab.timeline import Timeline, flow_id, merge

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _run(tmp_path):
    """A small recorded run on 3 ranks: messages, a collective, a note, overlapping spans."""
    path = str(tmp_path / "run.json")
    base = 1.7e15
    tls = {r: Timeline(path, rank=r) for r in range(3)}
    for r, tl in tls.items():
        tl.complete("allreduce negotiation bits", base + 100, base + 180, cat="comm", lane="comm world",
                    args={"seq": 1, "op": "allreduce", "bytes": 8})
        tl.complete("bucket 0 allreduce", base + 10 + r, base + 60, lane="reducer buckets", args={"iteration": 1})
        tl.complete("bucket 1 allreduce", base + 40, base + 90, lane="reducer buckets", args={"iteration": 1})
        tl.instant("grad fc.w", lane="reducer grads", ts=base + 5)
        tl.instant("grad fc.b", lane="reducer grads", ts=base + 38)
    fid = flow_id("call", 0, 1, 1)
    tls[0]._events.append({"ph": "X", "name": "call f with a long label that cannot fit between two lifelines",
                           "cat": "message", "pid": 0, "tid": tls[0]._lane("messages"), "ts": base + 200, "dur": 0,
                           "bind_id": fid, "flow_out": True, "args": {"to": 1}})
    tls[1]._events.append({"ph": "X", "name": "call f", "cat": "message", "pid": 1, "tid": tls[1]._lane("messages"),
                           "ts": base + 230, "dur": 0, "bind_id": fid, "flow_in": True, "args": {"from": 0}})
    tls[2].instant("RequestList [a, b, c, d, e, f, g, h, i, j, k, l, m]", lane="negotiation", ts=base + 90)
    for tl in tls.values():
        tl.flush()
    merge(path)
    return path


def test_load_trace_groups_spans_messages_and_collectives(tmp_path):
    from distlab.viz import load_trace

    trace = load_trace(_run(tmp_path))
    assert trace.ranks == [0, 1, 2]
    assert trace.lanes(0) == ["reducer grads", "reducer buckets", "comm world", "messages"]
    (message,) = trace.messages
    assert (message.src, message.dst, message.received - message.sent) == (0, 1, 30)
    (call,) = trace.collectives()
    assert (call.group, call.seq, call.ranks, call.op) == ("comm world", 1, (0, 1, 2), "allreduce")
    # the writer split the overlapping buckets into sub-lanes; the reader folds them back into their lane
    buckets = trace.select(rank=0, lane="reducer buckets")
    assert len(buckets) == 2 and {s.sub_lane for s in buckets} == {"reducer buckets", "reducer buckets (2)"}
    assert trace.time_of("grad fc.b") - trace.time_of("grad fc.w") == 33
    assert trace.time_of("bucket 1 allreduce", last=True) - trace.time_of("bucket 1 allreduce") == 50  # its end
    with pytest.raises(KeyError, match="no event named 'nothing'"):
        trace.time_of("nothing")
    with pytest.raises(TypeError, match="path, a trace dict or a list"):
        load_trace(42)
    assert load_trace(json.load(open(tmp_path / "run.json"))["traceEvents"]).ranks == [0, 1, 2]


def _inside(fig):
    """Every text of the figure lies within the figure (with a pixel of rounding), as drawn."""
    fig.canvas.draw()  # a legend places its texts when drawn
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    out = []
    for text in fig.findobj(matplotlib.text.Text):
        if not text.get_text() or not text.get_visible():
            continue
        ext = text.get_window_extent(renderer)
        if ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or ext.y1 > box.y1 + 1:
            out.append(text.get_text())
    return out


def test_sequence_diagram_draws_the_recorded_events_with_labels_inside(tmp_path):
    from distlab import viz

    trace = viz.load_trace(_run(tmp_path))
    rows = viz.sequence_rows(trace, notes=("negotiation",))
    assert [r.kind for r in rows] == ["note", "collective", "send", "receive"]
    fig = viz.plot_sequence(trace, notes=("negotiation",), title="a run", names={1: "worker B (owner)"}, width=6.5)
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
    assert "worker B (owner)" in texts and "rank 0" in texts and "allreduce negotiation bits" in texts
    # too wide for its place: wrapped over lines (its row grows), never shortened
    assert "call f with a long\nlabel that cannot fit\nbetween two lifelines" in texts
    assert any(t.startswith("RequestList [a,") and "\n" in t for t in texts)
    assert [label["text"] for label in fig.sequence_labels if label["shortened"]] == []
    assert {"call f with a long label that cannot fit between two lifelines",
            "RequestList [a, b, c, d, e, f, g, h, i, j, k, l, m]"} <= {label["text"] for label in fig.sequence_labels}
    # a legend names the kinds drawn, the lanes of the notes, and the time column
    assert fig.sequence_legend == ["message, sender to receiver", "collective, across the ranks in it",
                                   "note a rank recorded (negotiation)", "left: ms since the first row"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == fig.sequence_legend
    assert _inside(fig) == []
    # a word longer than its place is shortened as the last resort, and said so
    narrow = viz.plot_sequence(trace, notes=("negotiation",), width=2.0, legend=False)
    assert narrow.sequence_legend == [] and narrow.axes[0].get_legend() is None
    assert any(label["shortened"] and label["shown"].endswith("…") for label in narrow.sequence_labels)
    # a window keeps only what happened in it; a collective filter drops collectives
    assert [r.kind for r in viz.sequence_rows(trace, window=("call f with a long label that cannot fit between "
                                                             "two lifelines", None))] == ["send", "receive"]
    assert [r.kind for r in viz.sequence_rows(trace, collectives=False)] == ["send", "receive"]
    with pytest.raises(ValueError, match="more than max_rows=1"):
        viz.plot_sequence(trace, max_rows=1)
    with pytest.raises(ValueError, match="no ranks"):
        viz.plot_sequence(viz.load_trace([]))


def test_timeline_and_bucket_overlap_plots(tmp_path):
    from distlab import viz

    trace = viz.load_trace(_run(tmp_path))
    ax = viz.plot_timeline(trace, lanes=["reducer buckets", "comm world"], title="buckets")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"rank {r} · {lane}" for r in range(3) for lane in ("reducer buckets", "comm world")]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["bucket", "allreduce"]
    assert len(ax.collections) == 9  # 2 bucket spans + 1 collective span per rank
    fig = viz.plot_bucket_overlap(trace, ranks=[0, 1])
    titles = [a.get_title(loc="left") for a in fig.axes]
    assert titles == ["rank 0: 1 of 2 bucket allreduces started before backward ended",
                      "rank 1: 1 of 2 bucket allreduces started before backward ended"]
    with pytest.raises(ValueError, match="no iteration 7"):
        viz.plot_bucket_overlap(trace, iteration=7)
    with pytest.raises(ValueError, match="no 'reducer buckets' spans"):
        viz.plot_bucket_overlap(viz.load_trace([]))


def test_importing_viz_imports_no_matplotlib():
    code = "import sys, distlab.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_collective_of_some_ranks_leaves_a_gap_at_the_others(tmp_path):
    from distlab import viz

    path = str(tmp_path / "set.json")
    for rank in range(3):
        tl = Timeline(path, rank=rank)
        if rank != 1:  # a process set of ranks 0 and 2
            tl.complete("allreduce grad", 1e15, 1e15 + 50, cat="comm", lane="comm set 1", args={"seq": 1})
        tl.instant("idle", lane="x", ts=1e15)
        tl.flush()
    merge(path)
    fig = viz.plot_sequence(path, width=6)
    (label,) = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().startswith("allreduce")]
    middle = fig.axes[0].transData.transform((viz.sequence.GUTTER + 1, 0))[0]  # rank 1's lifeline, in pixels
    box = label.get_window_extent(fig.canvas.get_renderer())
    assert not box.x0 <= middle <= box.x1  # the label is not drawn over a lifeline that is not in the set
    assert _inside(fig) == []
