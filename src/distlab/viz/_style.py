"""What the drawing modules share: matplotlib imported on first use, colours, time windows, labels that fit."""
from __future__ import annotations

PALETTE = ("#e07b5f", "#4a7ab5", "#8cb369", "#f4a259", "#9b72aa", "#5b8e7d", "#bc4b51", "#c9b458", "#7f7f7f",
           "#6fb7c7")
OTHER = "#d0d0d0"


def pyplot():
    """matplotlib.pyplot, or an ImportError that says how to install it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the test and docs extras
        raise ImportError("distlab.viz draws with matplotlib, which is not installed: "
                          "pip install 'distlab[viz]' (or pip install matplotlib)") from exc
    return plt


def colours_for(kinds, colors=None) -> dict:
    """A colour per kind, in order of first appearance: ``colors`` first, then the palette, then grey."""
    chosen = dict(colors or {})
    free = [c for c in PALETTE if c not in chosen.values()]
    for kind in kinds:
        if kind not in chosen:
            chosen[kind] = free.pop(0) if free else OTHER
    return chosen


def resolve_window(trace, window) -> tuple[float, float]:
    """``(start, end)`` in trace microseconds from numbers or event names (first start, last end)."""
    if window is None:
        times = [s.start for s in trace.spans] + [s.end for s in trace.spans] + [m.ts for m in trace.marks]
        return (min(times, default=0.0), max(times, default=0.0))
    start, end = window
    start = trace.time_of(start) if isinstance(start, str) else (float("-inf") if start is None else start)
    end = trace.time_of(end, last=True) if isinstance(end, str) else (float("inf") if end is None else end)
    return start, end


def fit_text(text, max_width_px: float, renderer) -> None:
    """Shorten a Text artist with an ellipsis until it is at most ``max_width_px`` wide."""
    full = text.get_text()
    if text.get_window_extent(renderer).width <= max_width_px:
        return
    low, high = 0, len(full)
    while low < high:  # the longest prefix that fits with its ellipsis
        mid = (low + high + 1) // 2
        text.set_text(full[:mid].rstrip() + "…")
        if text.get_window_extent(renderer).width <= max_width_px:
            low = mid
        else:
            high = mid - 1
    text.set_text(full[:low].rstrip() + "…" if low else "…")
