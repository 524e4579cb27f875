"""Pictures of a recorded run: per-rank timelines, DDP's bucket overlap, and sequence diagrams of messages.

Record a run with ``DISTLAB_TIMELINE=path.json`` (or ``python -m distlab run --timeline path.json``), then::

    from distlab import viz
    trace = viz.load_trace("path.json")
    viz.plot_timeline(trace)                 # every rank's lanes, spans coloured by kind
    viz.plot_bucket_overlap(trace)           # a DDP run: bucket allreduces against backward
    viz.plot_sequence(trace, window=(...))   # messages and collectives, one lifeline per rank

The same file opens in Perfetto (https://ui.perfetto.dev), which draws the messages as flow arrows.
matplotlib is imported only when a function draws (``pip install 'distlab[viz]'``); reading a trace
(:func:`load_trace`, :class:`Trace`) needs nothing beyond the standard library.
"""
from __future__ import annotations

import importlib

__all__ = ["load_trace", "Trace", "plot_timeline", "plot_bucket_overlap", "plot_sequence", "sequence_rows"]

_HOME = {"load_trace": "trace", "Trace": "trace", "plot_timeline": "timeline", "plot_bucket_overlap": "timeline",
         "plot_sequence": "sequence", "sequence_rows": "sequence"}


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
