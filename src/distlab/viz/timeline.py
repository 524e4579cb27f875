"""Gantt charts of a recorded run: the per-rank timeline, and DDP's buckets against backward."""
from __future__ import annotations

from ._style import colours_for, pyplot, resolve_window
from .trace import load_trace

__all__ = ["plot_timeline", "plot_bucket_overlap", "first_word"]


def first_word(span) -> str:
    """The default kind of a span: the first word of its name (``allreduce``, ``compute``, ``bucket``...)."""
    return span.name.split()[0] if span.name else "?"


def plot_timeline(trace, *, ranks=None, lanes=None, window=None, kind=first_word, colors=None, marks=True,
                  ax=None, title=None, legend=True):
    """Draw every rank's lanes as rows of spans, coloured by kind; instants as ticks.

    Parameters
    ----------
    trace : str or os.PathLike, dict, list or Trace
        A merged trace (see :func:`distlab.viz.load_trace`).
    ranks : list of int, optional
        The ranks to draw, top to bottom (default: all).
    lanes : list of str, optional
        The lanes to draw, in this order (default: every lane, in order of first appearance). Spans the writer
        moved to sub-lanes (spans in flight together) are drawn as thinner rows inside their lane's row.
    window : tuple, optional
        Microseconds or event names, as in :func:`distlab.viz.plot_sequence`; the x axis is in milliseconds
        from its start.
    kind : callable
        ``kind(span) -> str`` decides a span's colour (default: the first word of its name).
    colors : dict, optional
        A colour per kind; other kinds get the palette's colours.
    marks : bool
        Draw instant events as ticks in their lane's row.
    ax : matplotlib Axes, optional
        Draw here (default: a new figure sized to the rows).
    title : str, optional
    legend : bool
        Show the kinds' colours above the plot.

    Returns
    -------
    matplotlib.axes.Axes
    """
    plt = pyplot()
    trace = load_trace(trace)
    start, end = resolve_window(trace, window)
    ranks = list(trace.ranks if ranks is None else ranks)
    rows = [(rank, lane) for rank in ranks for lane in (lanes or trace.lanes(rank)) if lane in trace.lanes(rank)]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * max(len(rows), 1)))
    spans = [s for s in trace.spans if s.end >= start and s.start <= end]
    kinds = colours_for(dict.fromkeys(kind(s) for s in spans if (s.rank, s.lane) in rows), colors)
    for y, (rank, lane) in enumerate(rows):
        mine = [s for s in spans if s.rank == rank and s.lane == lane]
        subs = sorted({s.sub_lane for s in mine}, key=lambda name: (name != lane, len(name), name))
        height = 0.76 / max(len(subs), 1)
        for s in mine:
            top = y - 0.38 + height * subs.index(s.sub_lane)
            ax.broken_barh([((s.start - start) / 1000, max(s.duration, 1.0) / 1000)], (top + height * 0.06,
                           height * 0.88), facecolors=kinds[kind(s)], edgecolor="black", linewidth=0.3)
        if marks:
            for m in trace.marks:
                if m.rank == rank and m.lane == lane and start <= m.ts <= end:
                    ax.plot([(m.ts - start) / 1000] * 2, [y - 0.38, y + 0.38], color="#333333", linewidth=0.7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{trace.rank_label(rank)} · {lane}" for rank, lane in rows], fontsize=8)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    if window is not None:
        ax.set_xlim(0, (end - start) / 1000)
    if legend and kinds:
        handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black", linewidth=0.3) for c in kinds.values()]
        ax.legend(handles, list(kinds), fontsize=7, ncol=min(len(kinds), 6), loc="lower left",
                  bbox_to_anchor=(0, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=9, pad=18 if legend and kinds else 6)
    ax.figure.tight_layout()
    return ax


def _iterations(trace, rank):
    """The reducer's bucket spans of ``rank`` by iteration (``args.iteration``), in order."""
    by_iteration = {}
    for s in trace.select(rank=rank, lane="reducer buckets"):
        if "iteration" in s.args:
            by_iteration.setdefault(s.args["iteration"], []).append(s)
    return dict(sorted(by_iteration.items()))


def plot_bucket_overlap(trace, *, iteration=None, ranks=None, fig=None, title=None):
    """DDP's overlap of communication with backward, one panel per rank, for one iteration.

    Backward runs from the iteration's first gradient to its last (the ``reducer grads`` marks, drawn as
    ticks); the dotted line marks its end. Below it, each bucket's allreduce from launch to the moment the rank
    saw it complete (``reducer buckets``). A bucket that starts left of the dotted line was reduced while
    backward was still computing.

    Parameters
    ----------
    trace : str or os.PathLike, dict, list or Trace
        A merged trace of a DDP run (``DISTLAB_TIMELINE`` set).
    iteration : int, optional
        The reducer iteration to draw (default: the last one every drawn rank recorded).
    ranks : list of int, optional
    fig : matplotlib Figure, optional
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
    """
    plt = pyplot()
    trace = load_trace(trace)
    ranks = [r for r in (trace.ranks if ranks is None else ranks) if _iterations(trace, r)]
    if not ranks:
        raise ValueError("plot_bucket_overlap: no 'reducer buckets' spans in the trace; record a DDP run with "
                         "DISTLAB_TIMELINE set")
    if iteration is None:
        iteration = min(max(_iterations(trace, r)) for r in ranks)
    fig = fig or plt.figure(figsize=(9, 0.6 + 1.9 * len(ranks)))
    axes = fig.subplots(len(ranks), 1, sharex=True, squeeze=False)[:, 0]
    for ax, rank in zip(axes, ranks):
        _overlap_panel(ax, trace, rank, iteration)
    axes[-1].set_xlabel("ms since the iteration's first gradient", fontsize=8)
    fig.suptitle(title or f"DDP iteration {iteration}: gradient arrivals (ticks) and bucket allreduces; "
                 "dotted: end of backward", fontsize=9)
    fig.tight_layout()
    return fig


#: At most this many bucket rows of a panel are labelled.
MAX_BUCKET_LABELS = 10


def _overlap_panel(ax, trace, rank, iteration) -> None:
    iterations = _iterations(trace, rank)
    if iteration not in iterations:
        raise ValueError(f"plot_bucket_overlap: rank {rank} recorded no iteration {iteration} "
                         f"(it has {sorted(iterations)})")
    spans = sorted(iterations[iteration], key=lambda s: s.start)
    earlier = [s.end for it, group in iterations.items() if it < iteration for s in group]
    after = max(earlier, default=float("-inf"))  # the previous iteration's finalize waited for all its buckets
    grads = [m for m in trace.select(rank=rank, lane="reducer grads", kind="marks")
             if after < m.ts <= spans[-1].start]
    t0 = grads[0].ts if grads else spans[0].start
    last_grad = (grads[-1].ts - t0) / 1000 if grads else 0.0
    buckets = sorted({_bucket(s) for s in spans})
    rows = len(buckets) + 1
    ax.broken_barh([(0, max(last_grad, 1e-3))], (0.15, 0.7), facecolors="#9bbcd9", edgecolor="black",
                   linewidth=0.4)
    for g in grads:
        ax.plot([(g.ts - t0) / 1000] * 2, [0.15, 0.85], color="#24476b", linewidth=0.8)
    overlapped = 0
    for s in spans:
        y = 1 + buckets.index(_bucket(s))
        left = (s.start - t0) / 1000
        overlapped += left < last_grad
        ax.broken_barh([(left, max(s.duration / 1000, 1e-3))], (y + 0.15, 0.7), facecolors="#e07b5f",
                       edgecolor="black", linewidth=0.4)
    ax.axvline(last_grad, color="black", linestyle=":", linewidth=1)
    ax.set_ylim(rows, 0)
    every = -(-len(buckets) // MAX_BUCKET_LABELS)  # many small buckets: label every few, readable
    shown = range(every - 1, len(buckets), every)  # (bucket 0 would crowd "backward")
    ax.set_yticks([0.5] + [1.5 + i for i in shown])
    ax.set_yticklabels(["backward"] + [f"bucket {buckets[i]}" for i in shown], fontsize=7)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(f"{trace.rank_label(rank)}: {overlapped} of {len(spans)} bucket allreduces started before "
                 "backward ended", fontsize=8.5, loc="left")


def _bucket(span) -> int:
    parts = span.name.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
