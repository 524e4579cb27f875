"""Read a Chrome trace written by :mod:`distlab.timeline` into spans, marks, messages and collectives.

No plotting here (and no matplotlib): the drawing functions of :mod:`distlab.viz` and any analysis of a run
start from a :class:`Trace`. Times stay in the trace's microseconds.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

__all__ = ["Trace", "Span", "Mark", "Message", "Collective", "load_trace"]


@dataclass(frozen=True)
class Span:
    """A complete event (``ph: X``): ``name`` on ``lane`` of ``rank`` from ``start`` to ``end`` (us)."""

    rank: int
    lane: str
    name: str
    start: float
    end: float
    cat: str = ""
    args: dict = field(default_factory=dict, compare=False, hash=False)
    sub_lane: str = ""  #: the sub-lane the span was written to (``"reducer buckets (2)"``), or the lane itself

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Mark:
    """An instant event (``ph: i``), e.g. a gradient's arrival."""

    rank: int
    lane: str
    name: str
    ts: float
    cat: str = ""
    args: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Message:
    """A message from rank ``src`` to rank ``dst``: the two ends of one flow (``bind_id``)."""

    name: str
    src: int
    dst: int
    sent: float
    received: float
    args: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Collective:
    """One collective call as every rank recorded it: the comm spans of one group with one sequence number."""

    group: str
    seq: int
    name: str
    op: str
    spans: tuple

    @property
    def ranks(self) -> tuple:
        return tuple(sorted(span.rank for span in self.spans))

    @property
    def start(self) -> float:
        """When the last rank entered it: from then on it can complete."""
        return max(span.start for span in self.spans)

    @property
    def end(self) -> float:
        return max(span.end for span in self.spans)


class Trace:
    """The events of one merged trace, grouped the way the pictures need them.

    Parameters
    ----------
    events : list of dict
        Trace Event Format events (the ``traceEvents`` of a file written by :func:`distlab.timeline.merge`,
        or the events of one rank's :class:`~distlab.timeline.Timeline`).
    """

    def __init__(self, events: list[dict]):
        self.events = events
        thread = {}
        self.process_names: dict[int, str] = {}
        for e in events:
            if e.get("ph") != "M":
                continue
            if e.get("name") == "thread_name":
                thread[(e.get("pid"), e.get("tid"))] = (e["args"].get("lane", e["args"]["name"]), e["args"]["name"])
            elif e.get("name") == "process_name":
                self.process_names[e.get("pid")] = e["args"]["name"]
        self.spans: list[Span] = []
        self.marks: list[Mark] = []
        flows_out, flows_in = {}, {}
        for e in events:
            phase = e.get("ph")
            if phase not in ("X", "i", "I"):
                continue
            lane, sub_lane = thread.get((e.get("pid"), e.get("tid")), (str(e.get("tid")), str(e.get("tid"))))
            args = e.get("args") or {}
            if phase == "X":
                span = Span(e["pid"], lane, e["name"], e["ts"], e["ts"] + e.get("dur", 0), e.get("cat", ""), args,
                            sub_lane)
                self.spans.append(span)
                if "bind_id" in e:
                    (flows_out if e.get("flow_out") else flows_in)[e["bind_id"]] = span
            else:
                self.marks.append(Mark(e["pid"], lane, e["name"], e["ts"], e.get("cat", ""), args))
        self.spans.sort(key=lambda s: (s.start, -s.end))
        self.marks.sort(key=lambda m: m.ts)
        self.messages = sorted(
            (Message(out.name, out.rank, flows_in[key].rank, out.start, flows_in[key].end,
                     {**flows_in[key].args, **out.args})
             for key, out in flows_out.items() if key in flows_in), key=lambda m: (m.sent, m.received))
        self.ranks = sorted({s.rank for s in self.spans} | {m.rank for m in self.marks} | set(self.process_names))

    @property
    def start(self) -> float:
        """The first timestamp in the trace."""
        times = [s.start for s in self.spans] + [m.ts for m in self.marks]
        return min(times, default=0.0)

    def lanes(self, rank: int | None = None) -> list[str]:
        """The lane names (sub-lanes folded into their lane), in the order they first appear."""
        seen: dict[str, None] = {}
        for item in sorted([*self.spans, *self.marks], key=lambda x: getattr(x, "start", getattr(x, "ts", 0))):
            if rank is None or item.rank == rank:
                seen.setdefault(item.lane, None)
        return list(seen)

    def select(self, *, rank=None, lane=None, cat=None, name=None, kind="spans") -> list:
        """The spans (``kind="spans"``) or marks (``"marks"``) matching every criterion given.

        ``lane`` and ``cat`` match exactly (or any of a tuple); ``name`` is a prefix (or a callable).
        """
        items = self.spans if kind == "spans" else self.marks
        return [x for x in items if _matches(x.rank, rank) and _matches(x.lane, lane) and _matches(x.cat, cat)
                and (name is None or (name(x.name) if callable(name) else x.name.startswith(name)))]

    def collectives(self, group: str | None = None) -> list[Collective]:
        """The comm layer's collectives (``cat == "comm"`` spans with a ``seq``), matched across ranks."""
        calls: dict[tuple, list[Span]] = {}
        for span in self.spans:
            if span.cat == "comm" and "seq" in span.args and (group is None or span.lane == group):
                calls.setdefault((span.lane, span.args["seq"]), []).append(span)
        out = [Collective(lane, seq, spans[0].name, spans[0].args.get("op", spans[0].name.split()[0]), tuple(spans))
               for (lane, seq), spans in calls.items()]
        return sorted(out, key=lambda c: (c.start, c.group, c.seq))

    def time_of(self, mark: str, last: bool = False) -> float:
        """When any rank first recorded an instant or began a span called ``mark`` (``last``: the last such
        instant or span end)."""
        times = [m.ts for m in self.marks if m.name == mark]
        times += [(s.end if last else s.start) for s in self.spans if s.name == mark]
        if not times:
            raise KeyError(f"no event named {mark!r} in the trace")
        return max(times) if last else min(times)

    def rank_label(self, rank: int) -> str:
        return self.process_names.get(rank, f"rank {rank}")


def load_trace(source) -> Trace:
    """A :class:`Trace` from a file path, a loaded JSON object (``{"traceEvents": [...]}`` or a list of
    events), or a :class:`Trace` (returned as is)."""
    if isinstance(source, Trace):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source) as fh:
            source = json.load(fh)
    if isinstance(source, dict):
        source = source.get("traceEvents", [])
    if not isinstance(source, list):
        raise TypeError(f"load_trace takes a path, a trace dict or a list of events, not {type(source).__name__}")
    return Trace(source)


def _matches(value, wanted) -> bool:
    if wanted is None:
        return True
    if isinstance(wanted, (tuple, list, set, frozenset)):
        return value in wanted
    return value == wanted
