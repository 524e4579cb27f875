"""Figures from recorded runs: every measured number a page quotes is filled in from ``docs/_data`` at build time.

Each ``docs/_data/<name>.json`` is the record of one run (or benchmark JSON): what was measured, the command, the
machine, the date, and the figures. Its contents become the MyST substitution ``<name>`` (dashes and slashes as
underscores: ``_data/bench/reducer.json`` is ``bench_reducer``), so a page writes

```md
the core's bookkeeping is {{ bench_reducer.figures.small_ratio }} times cheaper
```

and the number comes from the record; two pages that quote it cannot disagree, and a name that is not in the
record fails the build (MyST renders substitutions with Jinja2's ``StrictUndefined``). Jinja2 expressions work:
``{{ "%.1f" | format(r.figures.wire_ms / r.figures.local_ms) }}x``.

A record's ``tables`` hold tables: ``{"columns": ["model", "local step [ms]", ...], "rows": [[...], ...]}``. A
column named ``name [unit]`` shows ``name`` in its header and the unit after each number of the column (``ms``
with a space, ``x`` and ``%`` without). The build adds, for each table ``t``:

- ``md.t``, the table as Markdown: ``{{ bench_reducer.md.overhead }}`` alone on a line shows it;
- ``rows.t``, each row by its first cell, each cell by its column's name without the unit, with the unit:
  ``{{ bench_reducer.rows.overhead["small (0.5 MB)"]["local step"] }}`` gives ``10.8 ms``;
- ``num.t``, the same cells as numbers to compute with (a text cell's first number: ``"226 ms"`` is 226.0).

And ``{{ bench_reducer.source }}`` is one sentence naming the run (machine, date, command), for a caption.

:func:`hand_typed_figures` is the rule ``make docs`` and ``tests/test_docs_pages.py`` apply to the pages'
sources: no measured figure (a number with ``ms``, ``us``, ``ns``, or a ratio such as ``1.5x``; in a table, any
decimal) typed by hand in the prose; it comes from a record.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
DATA = DOCS / "_data"
_UNIT = re.compile(r"^(?P<name>.*?)\s*\[(?P<unit>[^\]]+)\]$")


def record_name(path: Path, data: Path = DATA) -> str:
    """The substitution name of a record: its path under ``_data`` without ``.json``, ``/`` and ``-`` as ``_``."""
    return re.sub(r"[/\-.]", "_", str(path.relative_to(data).with_suffix("")))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def number(value):
    """A cell as a number to compute with: the first number of a text cell (``"226 ms"`` is 226.0,
    ``"1.36x (25.1 MiB)"`` 1.36), a number as it is, anything else as it is."""
    if isinstance(value, str):
        found = _NUMBER.search(value)
        return float(found.group(0).replace(",", "")) if found else value
    return value


def split_unit(column: str) -> tuple[str, str]:
    found = _UNIT.match(column)
    return (found.group("name"), found.group("unit")) if found else (column, "")


def with_unit(value, unit: str) -> str:
    """A cell as shown: a number with its column's unit (``x`` and ``%`` glued to it), anything else as is."""
    if not unit or not isinstance(value, (int, float)) or isinstance(value, bool):
        return "" if value is None else str(value)
    text = f"{value:,}" if isinstance(value, int) and abs(value) >= 10000 else str(value)
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}"


def table_markdown(table: dict) -> str:
    """A record's table as a Markdown pipe table (numeric columns right-aligned when the table says so)."""
    columns = [split_unit(c) for c in table["columns"]]
    align = table.get("align", "")
    head = "| " + " | ".join(name for name, _ in columns) + " |"
    rule = "|" + "|".join((" ---: " if align == "right" and i else " --- ") for i in range(len(columns))) + "|"
    lines = [head, rule]
    for row in table["rows"]:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells under {len(columns)} columns: {row}")
        lines.append("| " + " | ".join(with_unit(v, u).replace("|", "\\|") for v, (_, u) in zip(row, columns))
                     + " |")
    return "\n".join(lines)


def source_sentence(record: dict) -> str:
    parts = [record.get("machine", ""), record.get("date", "")]
    text = ", ".join(p for p in parts if p)
    if record.get("command"):
        text += f"; `{record['command']}`"
    return text


def prepare(record: dict) -> dict:
    """A record with its tables' ``md``, ``rows`` and ``num`` views, and its ``source`` sentence."""
    out = dict(record)
    md, rows, num = {}, {}, {}
    for name, table in record.get("tables", {}).items():
        columns = [split_unit(c) for c in table["columns"]]
        md[name] = table_markdown(table)
        rows[name] = {str(row[0]): {c: with_unit(v, u) for v, (c, u) in zip(row, columns)}
                      for row in table["rows"]}
        num[name] = {str(row[0]): {c: number(v) for v, (c, _) in zip(row, columns)} for row in table["rows"]}
    out.update(md=md, rows=rows, num=num, source=source_sentence(record))
    return out


def load(data: Path = DATA) -> dict:
    """Every record under ``data``, by substitution name."""
    records = {}
    for path in sorted(data.rglob("*.json")):
        try:
            records[record_name(path, data)] = prepare(json.loads(path.read_text()))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"docs/_data/{path.relative_to(data)}: {exc}") from exc
    return records


# What a measured figure looks like in prose: a number with a unit of time, or a ratio (1.36x). Sizes (26 MB),
# rates (1 Gbit/s), counts and settings are not measurements of a run and are not matched.
_FIGURE = re.compile(r"(?<![\w.{`/=-])\d[\d,]*(?:\.\d+)?(?:\s?(?:-|to)\s?\d[\d,]*(?:\.\d+)?)?"
                     r"(?:\s?(?:ms|us|µs|ns)\b|x\b)")
_TABLE_DECIMAL = re.compile(r"(?<![\w.{`/=-])\d[\d,]*\.\d+(?![\w.])")
#: A version number is not a figure: NCCL 2.30, Python 3.12, torch 2.13.
_VERSION = re.compile(r"(?i)\b(nccl|python|cuda|cupy|torch|mpich|version|v)\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"``[^`]+``|`[^`]+`")
_SUBSTITUTION = re.compile(r"\{\{.*?\}\}")
#: A line may keep a hand-typed figure that is not a measurement (a setting's default, a timeout in an example)
#: by ending with this comment: ``<!-- not measured: the default timeout -->``.
_NOT_MEASURED = re.compile(r"<!--\s*not measured:[^>]*-->")


def hand_typed_figures(markdown: str) -> list[tuple[int, str]]:
    """(line, figure) for every measured-looking figure typed by hand in the prose of a Markdown page: outside
    code blocks, inline code, substitutions and lines marked ``<!-- not measured: why -->``."""
    found, fence = [], None
    for number, line in enumerate(markdown.splitlines(), 1):
        opened = _FENCE.match(line)
        if opened:
            mark = opened.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
            elif mark.startswith(fence) and line.strip() == mark:
                fence = None
            continue
        if fence is not None or _NOT_MEASURED.search(line) or line.lstrip().startswith(":"):
            continue
        text = _SUBSTITUTION.sub(" ", _INLINE_CODE.sub(" ", line))
        text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
        found += [(number, m.group(0)) for m in _FIGURE.finditer(text)]
        if text.lstrip().startswith("|"):  # a table row: a decimal is a figure too (units in the header)
            found += [(number, m.group(0)) for m in _TABLE_DECIMAL.finditer(text)
                      if not _FIGURE.match(text, m.start()) and not _VERSION.search(text[:m.start()])]
    return found


def check_sources(app, docname, source) -> None:
    """``source-read``: a page with a hand-typed figure fails the build (``-W``), naming the line."""
    from sphinx.util import logging  # here, so that the rule itself imports without Sphinx (the tests use it)

    logger = logging.getLogger(__name__)
    if not app.env.doc2path(docname).suffix == ".md":
        return
    for line, figure in hand_typed_figures(source[0]):
        logger.warning("a measured figure typed by hand: %r; take it from its record in docs/_data "
                       "(docs/README.md, 'How to write a page')", figure,
                       location=(docname, line))


def setup(app):
    app.connect("source-read", check_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
