"""Check that the built site shows what a learner needs: executed tutorials, drawn flows, blocks that fit.

``make docs`` runs it after Sphinx (so ``make linkcheck`` does too). Usage: ``python docs/_scripts/check_pages.py [docs/_build/html]``;
prints each problem and exits 1 if there is one. The rules:

- every tutorial page (``tutorials/*.html``) holds at least one figure and at least one printed output, both
  inside an executed cell's output (a page of code only means myst-nb did not execute the notebook);
- every protocol page (``protocols/*.html`` but the index) holds at least one message-flow figure drawn from a
  recorded run by ``_scripts/make_flow_figures.py`` (an image named after a file of ``docs/_generated/flows``);
- nothing scrolls sideways in a 1280 px wide window: no code block (diagram, shell, text, Python written for the
  page, a tutorial's cell) and no table is wider than the content column, and no flow figure is drawn wider
  than the column (:data:`COLUMN_PT`). Cell outputs and snippets' outputs wrap (the site's
  ``_static/distlab.css``), and so does code
  quoted from the sources (``literalinclude`` and docstrings, class ``quoted``, see ``conf.py``), which keeps
  its 120 columns: their wrapped lines are counted and printed, not failed.

The widths are estimated from the characters, without a browser, with figures measured in headless Chromium
156 (Debian 12, its Liberation fonts) on the site built with furo 2025.12.19, in a window 1280 px wide, by
``_scripts/measure_pages.py`` (which also reports what the browser itself finds scrolling):

- the content column (``<article>``) is 736 px wide (:data:`COLUMN_PX`); a tutorial cell's input 4 px less;
  a block inside a definition (``<dd>``: the API pages' docstrings) 32 px less;
- code, in blocks and inline, is furo's monospace stack (``SFMono-Regular, Menlo, Consolas, Monaco,
  "Liberation Mono", ...``) at 13 px: 7.80 px per character (:data:`CODE_CHAR_PX`, 0.6 em, as Menlo, SF Mono and
  DejaVu Sans Mono; Consolas is narrower); a ``<pre>`` adds 28 px of padding. So a block line of N characters
  renders 7.80 N + 28 px wide: 816 px for 101 characters, as measured (the 100 blocks that scrolled before
  the pages were fixed measured within 1 px of the estimate, and on 102 blocks written for the pages the
  estimate and Chromium agreed on every one whether it scrolls), and :data:`WIDEST`, 90 characters, is the
  longest line that fits;
- prose is the system sans-serif at 16 px: Liberation Sans here, with Arial's and Helvetica's advance widths
  (:func:`text_px` holds them; a system whose sans-serif is another font sets prose somewhat differently);
- a table is as narrow as its widest unbreakable word per column allows (a table cell breaks at spaces, and
  at the ``<wbr>`` conf.py puts after the dots and underscores of a code name): its estimated width is the
  sum, over columns, of the widest word in the column plus 17 px per cell (padding, margins and a border),
  with 7.2 px more per inline code span (its padding and border); it must fit the 742 px of its wrapper
  (:data:`TABLE_PX`). The two tables that scrolled measured 812 and 898 px at their narrowest; the estimate
  said 813 and 906, and every other table measured fits with an estimate under 742 px.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

#: The content column's width, in CSS pixels, in a 1280 px window (furo's 46em of 16 px).
COLUMN_PX = 736
#: One character of code (13 px Liberation Mono, Menlo, SF Mono: 0.6 em).
CODE_CHAR_PX = 7.80
#: An inline ``<code>``'s padding (0.2 em of 13 px each side) and border.
CODE_SPAN_PX = 7.2
#: A ``<pre>`` block's padding, left and right together.
BLOCK_PADDING_PX = 28
#: How much narrower a block is inside a tutorial cell's input, and inside a definition (``<dd>``).
CELL_INSET_PX, NESTED_INSET_PX = 4, 32
#: Prose: 16 px of Liberation Sans, metric-compatible with Arial and Helvetica. Advance widths of the printable
#: ASCII characters (space to ``~``) in thousandths of an em, regular and bold (``<th>``, ``<strong>``), read
#: from the fonts with fontTools; any other character counts a full em.
TEXT_PX = 16
_SANS = [278, 278, 355, 556, 556, 889, 667, 191, 333, 333, 389, 584, 278, 333, 278, 278, 556, 556, 556, 556,
         556, 556, 556, 556, 556, 556, 278, 278, 584, 584, 584, 556, 1015, 667, 667, 722, 722, 667, 611, 778,
         722, 278, 500, 667, 556, 833, 722, 778, 667, 778, 722, 667, 611, 722, 667, 944, 667, 667, 611, 278,
         278, 278, 469, 556, 333, 556, 556, 500, 556, 556, 278, 556, 556, 222, 222, 500, 222, 833, 556, 556,
         556, 556, 333, 500, 278, 556, 500, 722, 500, 500, 500, 334, 260, 334, 584]
_SANS_BOLD = [278, 333, 474, 556, 556, 889, 722, 238, 333, 333, 389, 584, 278, 333, 278, 278, 556, 556, 556,
              556, 556, 556, 556, 556, 556, 556, 333, 333, 584, 584, 584, 611, 975, 722, 722, 722, 722, 667,
              611, 778, 722, 278, 556, 722, 611, 833, 722, 778, 667, 778, 722, 667, 611, 722, 667, 944, 667,
              667, 611, 333, 278, 333, 584, 556, 333, 556, 611, 556, 611, 556, 333, 611, 611, 278, 278, 556,
              278, 889, 611, 611, 611, 611, 389, 556, 333, 611, 556, 778, 556, 556, 500, 389, 280, 389, 584]


def text_px(text: str, bold: bool = False) -> float:
    """The width of ``text`` set in the body font (16 px), in px."""
    widths = _SANS_BOLD if bold else _SANS
    return sum(widths[ord(c) - 32] if 32 <= ord(c) < 127 else 1000 for c in text) * TEXT_PX / 1000

#: A table cell's padding, its paragraph's margins and one border; the table wrapper's width.
TABLE_CELL_PX, TABLE_PX = 17, 742

#: The widest line a code block written for the page may have (a tutorial cell's, the narrowest usual place).
WIDEST = int((COLUMN_PX - CELL_INSET_PX - BLOCK_PADDING_PX) / CODE_CHAR_PX)

#: Pages Sphinx generates (indices, search): not pages a learner reads.
GENERATED = {"genindex.html", "py-modindex.html", "search.html"}


@dataclass
class Block:
    """One ``<pre>`` block: its highlight language, whether it is a cell's output or code quoted from the sources,
    how far it is inset from the column's edges (px), and its text."""

    language: str
    in_output: bool
    quoted: bool = False
    inset: int = 0
    text: str = ""

    @property
    def widest(self) -> int:
        return max((len(line) for line in self.text.splitlines()), default=0)

    @property
    def px(self) -> float:
        """The estimated rendered width of its widest line, padding included."""
        return self.widest * CODE_CHAR_PX + BLOCK_PADDING_PX

    @property
    def fits(self) -> bool:
        return self.px <= COLUMN_PX - self.inset


@dataclass
class Table:
    """One table: per row, per cell, the widths (px) of its unbreakable words."""

    rows: list[list[list[float]]] = field(default_factory=list)
    head: str = ""

    @property
    def px(self) -> float:
        """The estimated narrowest width the browser can give it: per column, its widest word plus a cell's
        padding, summed over the columns."""
        columns: dict[int, float] = {}
        for row in self.rows:
            for number, words in enumerate(row):
                columns[number] = max(columns.get(number, 0.0), max(words, default=0.0) + TABLE_CELL_PX)
        return sum(columns.values())


@dataclass
class Page:
    """What the checks need from one page: its images, its ``<pre>`` blocks and its tables."""

    images: list[tuple[str, bool]] = field(default_factory=list)  # (src, inside a cell's output)
    blocks: list[Block] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._divs: list[list[str]] = []  # the classes of each open <div>
        self._pre: Block | None = None
        self._nested = 0  # open <dd> elements
        self._table: Table | None = None
        self._cell: list[float] | None = None  # the words of the open table cell
        self._word = 0.0  # the width of the word being read in it
        self._code = 0  # open <code> elements
        self._bold = 0  # open <th>, <strong>, <b> elements

    def _in_output(self) -> bool:
        return any("cell_output" in classes or "snippet-output" in classes for classes in self._divs)

    def _language(self) -> str:
        for classes in reversed(self._divs):
            for name in classes:
                if name.startswith("highlight-"):
                    return name[len("highlight-"):]
        return "none"

    def _end_word(self):
        if self._cell is not None and self._word:
            self._cell.append(self._word)
        self._word = 0.0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div":
            self._divs.append((attrs.get("class") or "").split())
        elif tag == "img" and attrs.get("src"):
            self.page.images.append((attrs["src"], self._in_output()))
        elif tag == "pre":
            quoted = any("quoted" in classes for classes in self._divs)
            in_cell = any("cell_input" in classes for classes in self._divs)
            inset = (CELL_INSET_PX if in_cell else 0) + (NESTED_INSET_PX if self._nested else 0)
            self._pre = Block(self._language(), self._in_output(), quoted, inset)
        elif tag == "dd":
            self._nested += 1
        elif tag == "table":
            self._table = Table()
        elif tag == "tr" and self._table is not None:
            self._table.rows.append([])
        elif tag in ("td", "th") and self._table is not None and self._table.rows:
            self._cell, self._word = [], 0.0
            self._table.rows[-1].append(self._cell)
        elif tag in ("wbr", "br"):
            self._end_word()
        elif tag == "code":
            self._code += 1
            if self._cell is not None:
                self._word += CODE_SPAN_PX
        if tag in ("th", "strong", "b"):
            self._bold += 1

    def handle_endtag(self, tag):
        if tag == "div" and self._divs:
            self._divs.pop()
        elif tag == "pre" and self._pre is not None:
            self.page.blocks.append(self._pre)
            self._pre = None
        elif tag == "dd":
            self._nested = max(0, self._nested - 1)
        elif tag in ("td", "th"):
            self._end_word()
            self._cell = None
        elif tag == "code":
            self._code = max(0, self._code - 1)
        if tag in ("th", "strong", "b"):
            self._bold = max(0, self._bold - 1)
        elif tag == "table" and self._table is not None:
            self.page.tables.append(self._table)
            self._table = None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre.text += data
        if self._cell is not None:
            if self._table is not None and not self._table.head:
                self._table.head = data.strip()
            for piece in re.split(r"(\s+)", data):
                if piece.isspace():
                    self._end_word()
                elif piece:
                    self._word += len(piece) * CODE_CHAR_PX if self._code else text_px(piece, self._bold > 0)


def parse(html: str) -> Page:
    """The images, blocks and tables of one page of HTML."""
    parser = _Parser()
    parser.feed(html)
    parser.close()
    return parser.page


def tutorial_problems(name: str, page: Page) -> list[str]:
    """A tutorial page must show a figure and printed output from its executed cells."""
    problems = []
    if not any(in_output for _, in_output in page.images):
        problems.append(f"{name}: no figure in any cell output (was the notebook executed?)")
    if not any(block.in_output and block.text.strip() for block in page.blocks):
        problems.append(f"{name}: no printed output in any cell (was the notebook executed?)")
    return problems


def protocol_problems(name: str, page: Page, flow_names: set[str]) -> list[str]:
    """A protocol page must show at least one message-flow figure generated from a recorded run."""
    if any(Path(src).name in flow_names for src, _ in page.images):
        return []
    return [f"{name}: no message-flow figure drawn by make_flow_figures.py (docs/_generated/flows)"]


def width_problems(name: str, page: Page) -> tuple[list[str], int]:
    """Blocks and tables that would scroll sideways; and the number of wrapped lines of quoted code."""
    problems, wrapped = [], 0
    for block in page.blocks:
        if block.in_output:
            continue
        if block.quoted:
            room = int((COLUMN_PX - block.inset - BLOCK_PADDING_PX) / CODE_CHAR_PX)
            wrapped += sum(len(line) > room for line in block.text.splitlines())
        elif not block.fits:
            line = max(block.text.splitlines(), key=len)
            problems.append(f"{name}: a {block.language} block {block.widest} characters wide, about "
                            f"{block.px:.0f} px in a {COLUMN_PX - block.inset} px column (it scrolls "
                            f"sideways): {line[:60].strip()}...")
    for table in page.tables:
        if table.px > TABLE_PX:
            problems.append(f"{name}: a table about {table.px:.0f} px wide at its narrowest, in a {TABLE_PX} px "
                            f"column (it scrolls sideways): {table.head[:40]!r}...")
    return problems, wrapped


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")


def fenced_block_problems(name: str, markdown: str) -> list[str]:
    """The same width rule on a MyST page's source: lines of fenced blocks (a bare fence, ``sh``, ``text``, and
    the Python written on the page too) wider than :data:`WIDEST`. Directives (```` ```{figure} ````,
    ``{literalinclude}``) are left out: they quote the code, which keeps its own style."""
    problems, fence, language = [], None, ""
    for number, line in enumerate(markdown.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, language = match.group(1), match.group(2).strip()
        elif fence is not None and match and match.group(1).startswith(fence) and not match.group(2):
            fence = None
        elif fence is not None and not language.startswith("{") and len(line) > WIDEST:
            problems.append(f"{name}:{number}: a line {len(line)} characters wide in a ```{language} block "
                            f"(at most {WIDEST})")
    return problems


def tutorial_code_problems(name: str, source: str) -> list[str]:
    """Code lines of a tutorial (jupytext percent format) wider than :data:`WIDEST`: its page shows them as they
    are. Markdown cells are prose, which the page wraps."""
    problems, markdown = [], False
    for number, line in enumerate(source.splitlines(), 1):
        if line.startswith("# %%"):
            markdown = "[markdown]" in line
        elif not markdown and len(line) > WIDEST:
            problems.append(f"{name}:{number}: a code line {len(line)} characters wide (at most {WIDEST})")
    return problems


#: furo's content column, in the points matplotlib writes into an SVG (46em of 16 px at 96 px per inch).
COLUMN_PT = 46 * 16 * 72 / 96
_SVG_WIDTH = re.compile(r'<svg[^>]*?\swidth="([0-9.]+)pt"')


def figure_width_problems(flows: Path) -> list[str]:
    """Flow figures drawn wider than the column: the browser would shrink them, and their labels with them."""
    problems = []
    for path in sorted(flows.glob("*.svg")):
        match = _SVG_WIDTH.search(path.read_text(errors="replace")[:4000])
        if match and float(match.group(1)) > COLUMN_PT:
            problems.append(f"{path.name}: {float(match.group(1)):.0f}pt wide, more than the page's "
                            f"{COLUMN_PT:.0f}pt column (shrunk to fit, its labels become hard to read)")
    return problems


def check(site: Path, flows: Path) -> tuple[list[str], int]:
    """Every problem of the built ``site``; and the number of lines of quoted code the page wraps."""
    flow_names = {path.name for path in flows.glob("*.svg")}
    problems, wrapped_lines = figure_width_problems(flows), 0
    tutorials = sorted((site / "tutorials").glob("*.html"))
    protocols = sorted(path for path in (site / "protocols").glob("*.html") if path.name != "index.html")
    if not tutorials:
        problems.append(f"{site}: no tutorial pages (tutorials/*.html)")
    if not protocols:
        problems.append(f"{site}: no protocol pages (protocols/*.html)")
    for source in sorted((Path(__file__).resolve().parents[2] / "tutorials").glob("[0-9]*.py")):
        problems += tutorial_code_problems(f"tutorials/{source.name}", source.read_text())
    for path in sorted(site.rglob("*.html")):
        name = str(path.relative_to(site))
        if name.startswith("_modules") or name in GENERATED:  # viewcode's sources, Sphinx's indices
            continue
        page = parse(path.read_text(errors="replace"))
        if path in tutorials:
            problems += tutorial_problems(name, page)
        if path in protocols:
            problems += protocol_problems(name, page, flow_names)
        wide, wrapped = width_problems(name, page)
        problems += wide
        wrapped_lines += wrapped
    return problems, wrapped_lines


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
    flows = Path(__file__).resolve().parents[1] / "_generated" / "flows"
    found, wrapped = check(site, flows)
    for problem in found:
        print(problem)
    if wrapped:
        print(f"check_pages: {wrapped} lines of code quoted from the sources wrap at 1280 px (not failed)")
    print(f"check_pages: {len(found)} problems in {site}")
    sys.exit(1 if found else 0)
