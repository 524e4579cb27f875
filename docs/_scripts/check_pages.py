"""Check that the built site shows what a learner needs: executed tutorials, drawn flows, blocks that fit.

``make docs`` runs it after Sphinx (so ``make linkcheck`` does too). Usage: ``python docs/_scripts/check_pages.py [docs/_build/html]``;
prints each problem and exits 1 if there is one. The rules:

- every tutorial page (``tutorials/*.html``) holds at least one figure and at least one printed output, both
  inside an executed cell's output (a page of code only means myst-nb did not execute the notebook);
- every protocol page (``protocols/*.html`` but the index) holds at least one message-flow figure drawn from a
  recorded run by ``_scripts/make_flow_figures.py`` (an image named after a file of ``docs/_generated/flows``);
- no diagram, shell or text block has a line wider than :data:`WIDEST` characters: the page shows about that
  many before the block scrolls sideways and cuts off a rank's column; no flow figure is drawn wider than the
  column (:data:`COLUMN_PT`); and the tutorials' code, shown as written, stays within :data:`WIDEST` too. Cell outputs wrap instead (the site's
  ``_static/distlab.css``), and Python quoted from the code follows its own 120-column style, so neither is
  held to it; Python lines wider than the limit are counted and printed, not failed.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

#: The widest line a non-Python block may have (furo's content column shows about this many monospace
#: characters at its code font size).
WIDEST = 100

#: Highlight languages that are Python source (``default`` is Sphinx's: Python, for ``::`` blocks).
PYTHON = {"python", "python3", "py", "ipython3", "ipython", "pycon", "cython", "default"}


@dataclass
class Block:
    """One ``<pre>`` block: its highlight language, whether it is a cell's output, and its text."""

    language: str
    in_output: bool
    text: str = ""

    @property
    def widest(self) -> int:
        return max((len(line) for line in self.text.splitlines()), default=0)


@dataclass
class Page:
    """What the checks need from one page: its images and its ``<pre>`` blocks."""

    images: list[tuple[str, bool]] = field(default_factory=list)  # (src, inside a cell's output)
    blocks: list[Block] = field(default_factory=list)


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._divs: list[list[str]] = []  # the classes of each open <div>
        self._pre: Block | None = None

    def _in_output(self) -> bool:
        return any("cell_output" in classes for classes in self._divs)

    def _language(self) -> str:
        for classes in reversed(self._divs):
            for name in classes:
                if name.startswith("highlight-"):
                    return name[len("highlight-"):]
        return "none"

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div":
            self._divs.append((attrs.get("class") or "").split())
        elif tag == "img" and attrs.get("src"):
            self.page.images.append((attrs["src"], self._in_output()))
        elif tag == "pre":
            self._pre = Block(self._language(), self._in_output())

    def handle_endtag(self, tag):
        if tag == "div" and self._divs:
            self._divs.pop()
        elif tag == "pre" and self._pre is not None:
            self.page.blocks.append(self._pre)
            self._pre = None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre.text += data


def parse(html: str) -> Page:
    """The images and blocks of one page of HTML."""
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
    """Non-Python blocks wider than :data:`WIDEST`; and the number of Python lines wider than it."""
    problems, python_lines = [], 0
    for block in page.blocks:
        if block.in_output:
            continue
        if block.language in PYTHON:
            python_lines += sum(len(line) > WIDEST for line in block.text.splitlines())
        elif block.widest > WIDEST:
            line = max(block.text.splitlines(), key=len)
            problems.append(f"{name}: a {block.language} block {block.widest} characters wide "
                            f"(at most {WIDEST}): {line[:60].strip()}...")
    return problems, python_lines


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
    """Every problem of the built ``site``; and the number of Python source lines wider than :data:`WIDEST`."""
    flow_names = {path.name for path in flows.glob("*.svg")}
    problems, python_lines = figure_width_problems(flows), 0
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
        if name.startswith("_modules"):  # highlighted sources (viewcode): the code as it is
            continue
        page = parse(path.read_text(errors="replace"))
        if path in tutorials:
            problems += tutorial_problems(name, page)
        if path in protocols:
            problems += protocol_problems(name, page, flow_names)
        wide, python = width_problems(name, page)
        problems += wide
        python_lines += python
    return problems, python_lines


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
    flows = Path(__file__).resolve().parents[1] / "_generated" / "flows"
    found, wide_python = check(site, flows)
    for problem in found:
        print(problem)
    if wide_python:
        print(f"check_pages: {wide_python} lines of Python source are wider than {WIDEST} characters (not failed)")
    print(f"check_pages: {len(found)} problems in {site}")
    sys.exit(1 if found else 0)
