"""Sequence diagrams of a recorded run: one lifeline per rank, time downwards, an arrow per message.

What a diagram shows comes from the trace, never from a script: point-to-point messages are the flows the RPC
agent records (:meth:`distlab.timeline.Timeline.send` / ``receive``), collectives are the comm layer's spans
matched across ranks by sequence number (a band across the ranks that took part, with a gap at a lifeline that
did not), and notes are instants a component recorded on a lane you name (the
negotiation's request lists, Join's shadowing). Rows follow the order of events in time, one event per row, so
that every label has room; the left margin gives each row's time.
"""
from __future__ import annotations

from dataclasses import dataclass

from ._style import fit_text, pyplot, resolve_window
from .trace import Collective, Message, load_trace

__all__ = ["plot_sequence", "sequence_rows"]

ROW_INCHES = 0.26
HEADER_ROWS = 1.6
GUTTER = 0.9  # lifeline columns reserved on the left for the time of each row
MESSAGE_COLOUR = "#2f5d8a"
COLLECTIVE_COLOUR = "#f3d9b1"
NOTE_COLOUR = "#fff4c2"


@dataclass
class _Row:
    ts: float
    kind: str    # "send", "receive", "collective", "note"
    item: object


def sequence_rows(trace, *, ranks=None, window=None, messages=True, collectives=True, notes=()) -> list[_Row]:
    """The rows a sequence diagram of ``trace`` would draw, in time order (see :func:`plot_sequence`)."""
    trace = load_trace(trace)
    ranks = list(trace.ranks if ranks is None else ranks)
    start, end = resolve_window(trace, window)
    rows: list[_Row] = []

    def inside(ts):
        return start <= ts <= end

    if messages:
        for m in trace.messages:
            keep = messages(m) if callable(messages) else True
            if keep and m.src != m.dst and m.src in ranks and m.dst in ranks and inside(m.sent):
                rows += [_Row(m.sent, "send", m), _Row(max(m.received, m.sent), "receive", m)]
    if collectives:
        for c in trace.collectives(None if collectives is True or callable(collectives) else collectives):
            keep = collectives(c) if callable(collectives) else True
            if keep and inside(c.start) and any(r in ranks for r in c.ranks):
                rows.append(_Row(c.start, "collective", c))
    for mark in trace.marks:
        if mark.lane in notes and mark.rank in ranks and inside(mark.ts):
            rows.append(_Row(mark.ts, "note", mark))
    order = {"send": 0, "collective": 1, "note": 2, "receive": 3}
    rows.sort(key=lambda r: (r.ts, order[r.kind]))
    return rows


def plot_sequence(trace, *, ranks=None, names=None, window=None, messages=True, collectives=True, notes=(),
                  label=None, title=None, width=7.0, max_rows=90):
    """Draw a sequence diagram of a recorded run.

    Parameters
    ----------
    trace : path, dict, list or Trace
        A merged trace (see :func:`distlab.viz.load_trace`).
    ranks : list of int, optional
        The lifelines, left to right (default: every rank in the trace).
    names : dict, optional
        A lifeline's title per rank (default: the trace's process names, ``"rank N"``).
    window : tuple, optional
        ``(start, end)``: only events between the two, each in microseconds or the name of an event (the
        window starts at the first event of that name on any rank and ends at the last).
    messages, collectives : bool or callable
        Draw point-to-point messages / collectives; a callable keeps those for which it returns true
        (``collectives`` may also be a comm lane name such as ``"comm world"``).
    notes : tuple of str
        Lanes whose instant events are drawn as notes on their rank's lifeline.
    label : callable, optional
        ``label(item) -> str`` for a Message, Collective or Mark (default: its name).
    title : str, optional
    width : float
        Figure width in inches (7 fits the docs' page).
    max_rows : int
        Refuse to draw more rows than this (narrow the window instead).

    Returns
    -------
    matplotlib.figure.Figure
    """
    plt = pyplot()
    trace = load_trace(trace)
    ranks = list(trace.ranks if ranks is None else ranks)
    if not ranks:
        raise ValueError("plot_sequence: the trace has no ranks to draw")
    rows = sequence_rows(trace, ranks=ranks, window=window, messages=messages, collectives=collectives,
                         notes=notes)
    if len(rows) > max_rows:
        raise ValueError(f"plot_sequence: {len(rows)} events to draw, more than max_rows={max_rows}; narrow the "
                         "window (window=(start, end)) or filter messages/collectives")
    names = dict(names or {})
    label = label or (lambda item: item.name)
    column = {rank: GUTTER + i for i, rank in enumerate(ranks)}
    right = GUTTER + len(ranks) - 0.5
    top = HEADER_ROWS + (1.1 if title else 0.0)
    height = (len(rows) + top + 0.8) * ROW_INCHES
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.5, right)
    ax.set_ylim(len(rows) + 0.4, -top)
    ax.axis("off")
    renderer = fig.canvas.get_renderer()
    column_px = fig.bbox.width / (right + 0.5)

    for rank in ranks:  # lifelines and their titles
        x = column[rank]
        ax.plot([x, x], [-0.6, len(rows) + 0.2], color="#9a9a9a", linewidth=0.8, linestyle=(0, (4, 3)), zorder=1)
        head = ax.text(x, -HEADER_ROWS / 2 - 0.2, names.get(rank, trace.rank_label(rank)), ha="center",
                       va="center", fontsize=9, fontweight="bold", zorder=4,
                       bbox={"boxstyle": "round,pad=0.3", "facecolor": "#eef2f7", "edgecolor": "#5a6f8c"})
        fit_text(head, column_px * 0.92, renderer)
    ax.text(0.5 - GUTTER * 0.5 + 0.05, -HEADER_ROWS / 2 - 0.2, "ms", ha="center", va="center", fontsize=7,
            color="#777777")

    t0 = rows[0].ts if rows else 0.0
    send_row = {}
    for y, row in enumerate(rows):
        ax.text(0.35 - GUTTER * 0.5, y, f"{(row.ts - t0) / 1000:.2f}", ha="center", va="center", fontsize=6.5,
                color="#777777")
        if row.kind == "send":
            send_row[id(row.item)] = y
        elif row.kind == "receive":
            _message(ax, row.item, send_row[id(row.item)], y, column, label, renderer, column_px)
        elif row.kind == "collective":
            _collective(ax, row.item, y, ranks, column, label, renderer, column_px)
        else:
            _note(ax, row.item, y, column, label, renderer, column_px)
    if title:
        heading = ax.text((right - 0.5) / 2, -top + 0.55, title, ha="center", va="center", fontsize=9.5)
        fit_text(heading, fig.bbox.width * 0.96, renderer)
    return fig


def _message(ax, message: Message, y0, y1, column, label, renderer, column_px) -> None:
    x0, x1 = column[message.src], column[message.dst]
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=3,
                arrowprops={"arrowstyle": "-|>", "color": MESSAGE_COLOUR, "linewidth": 1.1,
                            "shrinkA": 0, "shrinkB": 0, "mutation_scale": 9})
    # the label sits just above the arrow's tail row, between the sender and the next lifeline the arrow
    # crosses (never over a lifeline): the arrow runs below it
    step = 0.5 if x1 > x0 else -0.5
    lx, ly = x0 + step, y0 - 0.22
    text = ax.text(lx, ly, label(message), ha="center", va="center", fontsize=7.5, color=MESSAGE_COLOUR, zorder=5,
                   bbox={"boxstyle": "square,pad=0.08", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    fit_text(text, column_px * 0.9, renderer)


def _collective(ax, call: Collective, y, ranks, column, label, renderer, column_px) -> None:
    from matplotlib.patches import Rectangle

    xs = sorted(column[r] for r in call.ranks if r in column)
    left, right = xs[0] - 0.42, xs[-1] + 0.42
    ax.add_patch(_band(left, y, right - left))
    # lifelines the band crosses without taking part (a process set): a gap in the band, the label beside it
    gaps = sorted(column[r] for r in ranks if r not in call.ranks and xs[0] < column[r] < xs[-1])
    for x in gaps:
        ax.add_patch(Rectangle((x - 0.09, y - 0.42), 0.18, 0.84, facecolor="white", edgecolor="none", zorder=2.5))
    edges = [left] + [e for x in gaps for e in (x - 0.09, x + 0.09)] + [right]
    start, end = max(zip(edges[::2], edges[1::2]), key=lambda seg: seg[1] - seg[0])
    text = ax.text((start + end) / 2, y, label(call), ha="center", va="center", fontsize=7.5, color="#4d3208",
                   zorder=5, bbox={"boxstyle": "square,pad=0.1", "facecolor": COLLECTIVE_COLOUR, "edgecolor": "none"})
    fit_text(text, (end - start) * column_px * 0.94, renderer)


def _band(x, y, width):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x, y - 0.36), width, 0.72, boxstyle="round,pad=0,rounding_size=0.12",
                          facecolor=COLLECTIVE_COLOUR, edgecolor="#c89b55", linewidth=0.8, zorder=2,
                          mutation_aspect=1 / 3)


def _note(ax, mark, y, column, label, renderer, column_px) -> None:
    text = ax.text(column[mark.rank], y, label(mark), ha="center", va="center", fontsize=7.5, color="#3d3d3d",
                   zorder=5, bbox={"boxstyle": "round,pad=0.25", "facecolor": NOTE_COLOUR, "edgecolor": "#c9b458",
                                   "linewidth": 0.6})
    fit_text(text, column_px * 0.88, renderer)
