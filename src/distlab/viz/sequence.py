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
                  label=None, title=None, width=7.0, max_rows=90, legend=True):
    """Draw a sequence diagram of a recorded run.

    Parameters
    ----------
    trace : str or os.PathLike, dict, list or Trace
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
    legend : bool
        Draw a legend below the diagram: what an arrow, a band and a note are, and the time column.

    Returns
    -------
    matplotlib.figure.Figure
        A label too wide for its place is wrapped over up to three lines (its row grows); only one that still
        does not fit is shortened with an ellipsis. ``fig.sequence_labels`` lists every label drawn (dicts
        with ``kind``, ``text``, ``shown`` and ``shortened``), ``fig.sequence_legend`` the legend's entries.
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
    fig = plt.figure(figsize=(width, 2.0))  # the height follows once the rows are laid out
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    renderer = fig.canvas.get_renderer()
    column_px = fig.bbox.width / (right + 0.5)
    fig.sequence_labels = []
    fitter = _Fitter(ax, renderer, fig.sequence_labels)

    # each row's label, wrapped to fit its place; a row is as tall as its label's lines
    shown, heights = [], []
    for row in rows:
        if row.kind == "send":
            text, lines = fitter.fit("message", label(row.item), column_px * 0.9)
        elif row.kind == "collective":
            start, end = _collective_span(row.item, ranks, column)[2]
            text, lines = fitter.fit("collective", label(row.item), (end - start) * column_px * 0.94)
        elif row.kind == "note":
            text, lines = fitter.fit("note", label(row.item), column_px * 0.88, fontsize=7.5, pad=6)
        else:
            text, lines = "", 1
        shown.append(text)
        heights.append(1.0 + LINE_ROWS * (lines - 1))
    heading, heading_lines = fitter.fit("title", title, fig.bbox.width * 0.96, fontsize=9.5) if title else ("", 0)
    fitter.probe.remove()
    top = HEADER_ROWS + (1.1 + LINE_ROWS * (heading_lines - 1) if title else 0.0)
    ys, y = [], 0.0
    for height in heights:  # a row's events sit at the bottom of its extra height (a label wraps above)
        ys.append(y + height - 1.0)
        y += height
    bottom = y

    for rank in ranks:  # lifelines and their titles
        x = column[rank]
        ax.plot([x, x], [-0.6, bottom + 0.2], color="#9a9a9a", linewidth=0.8, linestyle=(0, (4, 3)), zorder=1)
        head = ax.text(x, -HEADER_ROWS / 2 - 0.2, names.get(rank, trace.rank_label(rank)), ha="center",
                       va="center", fontsize=9, fontweight="bold", zorder=4,
                       bbox={"boxstyle": "round,pad=0.3", "facecolor": "#eef2f7", "edgecolor": "#5a6f8c"})
        full = head.get_text()
        fit_text(head, column_px * 0.92, renderer)
        fig.sequence_labels.append({"kind": "lifeline", "text": full, "shown": head.get_text(),
                                    "shortened": head.get_text() != full})
    ax.text(0.5 - GUTTER * 0.5 + 0.05, -HEADER_ROWS / 2 - 0.2, "ms", ha="center", va="center", fontsize=7,
            color="#777777")

    t0 = rows[0].ts if rows else 0.0
    send_row = {}
    for row, y, text, height in zip(rows, ys, shown, heights):
        middle = y if row.kind in ("send", "receive") else y - (height - 1.0) / 2
        ax.text(0.35 - GUTTER * 0.5, middle, f"{(row.ts - t0) / 1000:.2f}", ha="center", va="center",
                fontsize=6.5, color="#777777")
        if row.kind == "send":
            send_row[id(row.item)] = (y, text, height)
        elif row.kind == "receive":
            _message(ax, row.item, send_row[id(row.item)], y, column)
        elif row.kind == "collective":
            _collective(ax, row.item, y - (height - 1.0) / 2, ranks, column, text, height)
        else:
            _note(ax, row.item, y - (height - 1.0) / 2, column, text)
    if title:
        ax.text((right - 0.5) / 2, -top + 0.55 + LINE_ROWS * (heading_lines - 1) / 2, heading, ha="center",
                va="center", fontsize=9.5)
    fig.sequence_legend = []
    legend_rows = _legend(ax, rows, notes, fig, renderer, (right - 0.5) / 2, bottom) if legend else 0.0
    ax.set_xlim(-0.5, right)
    ax.set_ylim(bottom + 0.4 + legend_rows, -top)
    fig.set_size_inches(width, (bottom + top + 0.8 + legend_rows) * ROW_INCHES)
    return fig


LINE_ROWS = 0.62  # the height, in rows, of each further line of a wrapped label


class _Fitter:
    """Wraps a label over up to three lines until it fits its width; shortens it only as the last resort."""

    def __init__(self, ax, renderer, record):
        self.probe = ax.text(0, 0, "", fontsize=7.5)  # measures a label; removed once the rows are laid out
        self.renderer, self.record = renderer, record

    def _width(self, text, fontsize):
        self.probe.set_fontsize(fontsize)
        self.probe.set_text(text)
        return self.probe.get_window_extent(self.renderer).width

    def fit(self, kind, text, max_px, fontsize=7.5, pad=0):
        for lines in (1, 2, 3):
            wrapped = _wrap(text, lines)
            if wrapped is not None and self._width(wrapped, fontsize) + pad <= max_px:
                self.record.append({"kind": kind, "text": text, "shown": wrapped, "shortened": False})
                return wrapped, wrapped.count("\n") + 1
        shown = text
        while shown and self._width(shown + "…", fontsize) + pad > max_px:
            shown = shown[:-1].rstrip()
        shown += "…"
        self.record.append({"kind": kind, "text": text, "shown": shown, "shortened": True})
        return shown, 1


def _wrap(text: str, lines: int):
    """``text`` over ``lines`` lines of about equal length, broken at spaces (None if it has too few)."""
    if lines == 1:
        return text
    words = text.split(" ")
    if len(words) < lines:
        return None
    target = len(text) / lines
    out, current = [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > target * 1.15 and len(out) < lines - 1:
            out.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return "\n".join(out + [current])


def _legend(ax, rows, notes, fig, renderer, centre, bottom) -> float:
    """What the marks mean, below the diagram (only the kinds drawn); the rows it takes."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds = {row.kind for row in rows}
    entries = []
    if "send" in kinds:
        entries.append((Line2D([], [], color=MESSAGE_COLOUR, marker=">", markersize=5, linewidth=1.1),
                        "message, sender to receiver"))
    if "collective" in kinds:
        entries.append((Patch(facecolor=COLLECTIVE_COLOUR, edgecolor="#c89b55"),
                        "collective, across the ranks in it"))
    if "note" in kinds:
        entries.append((Patch(facecolor=NOTE_COLOUR, edgecolor="#c9b458"),
                        f"note a rank recorded ({', '.join(notes)})"))
    entries.append((Line2D([], [], linestyle="none"), "left: ms since the first row"))
    fig.sequence_legend = [text for _, text in entries]
    for columns in range(len(entries), 0, -1):
        shown = ax.legend([h for h, _ in entries], [t for _, t in entries], loc="upper center", ncol=columns,
                          fontsize=7, frameon=False, handlelength=1.5, columnspacing=1.2,
                          bbox_to_anchor=(centre, bottom + 0.35), bbox_transform=ax.transData)
        if shown.get_window_extent(renderer).width <= fig.bbox.width * 0.98 or columns == 1:
            break
        shown.remove()
    return 0.5 + 0.8 * -(-len(entries) // columns)


def _message(ax, message: Message, send, y1, column) -> None:
    y0, text, height = send
    x0, x1 = column[message.src], column[message.dst]
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=3,
                arrowprops={"arrowstyle": "-|>", "color": MESSAGE_COLOUR, "linewidth": 1.1,
                            "shrinkA": 0, "shrinkB": 0, "mutation_scale": 9})
    # the label sits just above the arrow's tail row, between the sender and the next lifeline the arrow
    # crosses (never over a lifeline): the arrow runs below it; a wrapped label takes its row's extra height
    step = 0.5 if x1 > x0 else -0.5
    ax.text(x0 + step, y0 - 0.22 - (height - 1.0) / 2, text, ha="center", va="center", fontsize=7.5,
            color=MESSAGE_COLOUR, zorder=5,
            bbox={"boxstyle": "square,pad=0.08", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})


def _collective_span(call: Collective, ranks, column):
    """The band's left and right edges, the lifelines it crosses without taking part, and its widest
    segment between them (where the label goes)."""
    xs = sorted(column[r] for r in call.ranks if r in column)
    left, right = xs[0] - 0.42, xs[-1] + 0.42
    gaps = sorted(column[r] for r in ranks if r not in call.ranks and xs[0] < column[r] < xs[-1])
    edges = [left] + [e for x in gaps for e in (x - 0.09, x + 0.09)] + [right]
    return (left, right), gaps, max(zip(edges[::2], edges[1::2]), key=lambda seg: seg[1] - seg[0])


def _collective(ax, call: Collective, y, ranks, column, text, height) -> None:
    from matplotlib.patches import Rectangle

    (left, right), gaps, (start, end) = _collective_span(call, ranks, column)
    band = 0.72 + (height - 1.0)
    ax.add_patch(_band(left, y, right - left, band))
    # lifelines the band crosses without taking part (a process set): a gap in the band, the label beside it
    for x in gaps:
        ax.add_patch(Rectangle((x - 0.09, y - band / 2 - 0.06), 0.18, band + 0.12, facecolor="white",
                               edgecolor="none", zorder=2.5))
    ax.text((start + end) / 2, y, text, ha="center", va="center", fontsize=7.5, color="#4d3208", zorder=5,
            bbox={"boxstyle": "square,pad=0.1", "facecolor": COLLECTIVE_COLOUR, "edgecolor": "none"})


def _band(x, y, width, height=0.72):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x, y - height / 2), width, height, boxstyle="round,pad=0,rounding_size=0.12",
                          facecolor=COLLECTIVE_COLOUR, edgecolor="#c89b55", linewidth=0.8, zorder=2,
                          mutation_aspect=1 / 3)


def _note(ax, mark, y, column, text) -> None:
    ax.text(column[mark.rank], y, text, ha="center", va="center", fontsize=7.5, color="#3d3d3d", zorder=5,
            bbox={"boxstyle": "round,pad=0.25", "facecolor": NOTE_COLOUR, "edgecolor": "#c9b458",
                  "linewidth": 0.6})
