"""Sphinx configuration of distlab's docs: `make docs` builds them into docs/_build/html (warnings are errors).

The build is offline: no intersphinx, no remote images. The tutorials live in ../tutorials as jupytext
percent-format .py files; each build converts them into docs/tutorials/*.ipynb (generated, git-ignored), and
myst-nb executes them (with jupyter-cache: a tutorial runs again only when its code or distlab's sources
changed) so that every tutorial page shows its printed outputs and figures. A tutorial that fails to execute
fails the build, showing the failing cell's traceback. The message-flow figures of the protocol pages are drawn
from recorded runs by _scripts/make_flow_figures.py, again only when its inputs changed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import zmq
from docutils.nodes import doctest_block, literal_block
from jupyter_client.manager import KernelManager
from pygments.formatters import HtmlFormatter
from sphinx.directives.code import LiteralInclude
from sphinx.highlighting import PygmentsBridge

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

import figures  # noqa: E402 - docs/_ext: the records of docs/_data as substitutions
import snippets  # noqa: E402 - docs/_ext: the snippet directive
import support  # noqa: E402 - docs/_ext: the support table from docs/_data/support.json

# The API reference is generated from the reference twin: it holds the full docstrings (core docstrings are one
# line pointing back to it), and it imports without a compiled core.
# The tutorials run in kernels that inherit this environment: the reference twin too (the docs need no compiled
# core), every wait on the ranks bounded well below a cell's timeout, and matplotlib's inline backend (the
# kernel's default) so that figures become outputs; an inherited MPLBACKEND=Agg would draw nothing.
os.environ["DISTLAB_IMPL"] = "reference"
os.environ["DISTLAB_TIMEOUT"] = os.environ.get("DISTLAB_DOCS_TIMEOUT", "60")
os.environ.pop("MPLBACKEND", None)
os.environ.pop("DISTLAB_TIMELINE", None)

project = "distlab"
author = "the distlab authors"
copyright = "the distlab authors"  # noqa: A001 - Sphinx's name
try:
    import distlab

    release = distlab.__version__
except ImportError as exc:  # pragma: no cover - a clear message instead of autodoc noise
    sys.exit(f"docs/conf.py: cannot import distlab ({exc}); build the docs with `make docs`")
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",
    "sphinx_design",
    "snippets",   # docs/_ext/snippets.py: code blocks that run when the docs are built
    "figures",    # docs/_ext/figures.py: no measured figure typed by hand in a page
]

# Markdown (MyST) pages and notebooks; conf.py, the figure scripts and the README are not pages.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "_scripts", "_generated", "_ext", "_fragments", "_data",
                    "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3
# Every record of docs/_data (a recorded run or a benchmark's JSON) by name: {{ bench_reducer.figures.x }} in a
# page is filled in from docs/_data/bench/reducer.json at build time (docs/_ext/figures.py).
myst_substitutions = figures.load()
# A snippet runs again when its text or distlab's sources changed (docs/_ext/snippets.py).
snippet_sources_stamp = snippets.sources_hash()

# Notebooks are executed at build time and their outputs cached in docs/_build/.jupyter_cache, keyed by their
# code cells (which include a hidden cell holding a hash of distlab's sources, see _convert_tutorials).
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 180          # seconds per cell (a whole tutorial takes 2-20 s)
nb_execution_in_temp = True         # the kernel works in a temporary directory: the repository is not on sys.path
nb_execution_raise_on_error = True  # a failing tutorial fails the build...
nb_execution_show_tb = True         # ...showing the failing cell and its traceback

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"distlab {release}"
html_static_path = ["_static"]
html_css_files = ["distlab.css"]  # cell outputs wrap (see the file)
pygments_style = "sphinx"

# `make linkcheck`: every link of the built site; DISTLAB_LINKCHECK_OFFLINE=1 (a machine without a network)
# checks only local targets and anchors (-W makes a broken one an error in the html build too).
linkcheck_anchors = True
if os.environ.get("DISTLAB_LINKCHECK_OFFLINE"):
    linkcheck_ignore = [r"https?://"]

# Warnings are errors (-W); these are the ones that say nothing about our docs.
suppress_warnings = ["myst.header"]


def _convert_tutorials() -> None:
    """Write docs/tutorials/<name>.ipynb from each ../tutorials/<name>.py (jupytext percent format).

    Each notebook gets a first, hidden cell (tag ``remove-cell``) naming a hash of distlab's sources, so that the
    execution cache, keyed by the code cells, runs a tutorial again when the library it shows has changed.
    """
    import jupytext
    from nbformat.v4 import new_code_cell

    out_dir = DOCS / "tutorials"
    out_dir.mkdir(exist_ok=True)
    sources = sorted((ROOT / "tutorials").glob("[0-9]*.py"))
    wanted = {src.stem + ".ipynb" for src in sources}
    for stale in out_dir.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    stamp = f"# distlab sources {snippets.sources_hash(('src', 'reference'))} (a docs build stamp; not shown)"
    for src in sources:
        target = out_dir / (src.stem + ".ipynb")
        notebook = jupytext.read(src, fmt="py:percent")
        notebook.cells.insert(0, new_code_cell(stamp, metadata={"tags": ["remove-cell"]}))
        text = jupytext.writes(notebook, fmt="ipynb")
        if not target.exists() or target.read_text() != text:  # unchanged files keep their mtime
            target.write_text(text)


def _draw_flow_figures() -> None:
    """Run docs/_scripts/make_flow_figures.py when its inputs changed (it skips the run itself otherwise)."""
    script = DOCS / "_scripts" / "make_flow_figures.py"
    if not script.exists():
        return
    done = subprocess.run([sys.executable, "-P", str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        sys.exit(f"docs/conf.py: {script.name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    if done.stdout.strip():
        print(done.stdout.strip())


# The tutorials' kernels talk to the build over CurveZMQ-encrypted TCP: jupyter_client provisions the keys when
# the kernelspec declares support (ipykernel's does), and ipykernel no longer warns, once per tutorial, that the
# connection is plain text.
# (jupyter_client and ipykernel releases before CurveZMQ neither provision keys nor warn.)
if hasattr(KernelManager, "transport_encryption") and zmq.has("curve"):
    KernelManager.transport_encryption.default_value = "auto"

# Before Sphinx looks for source files.
_convert_tutorials()
support.write(DOCS)
# The pages' snippets whose results are not cached, a few at a time (DISTLAB_DOCS_JOBS, default 2) rather than
# one by one as Sphinx reads the pages.
_ran = snippets.prerun(DOCS, snippet_sources_stamp, int(os.environ.get("DISTLAB_DOCS_JOBS", "2")))
if _ran:
    print(f"docs/conf.py: ran {_ran} snippets of the pages")
_draw_flow_figures()

_STAR = re.compile(r"(?<![\\*])\*(?=[A-Za-z_])")


def _escape_stars_in_types(app, what, name, obj, options, lines) -> None:
    """Escape ``*`` in NumPy-style parameter types such as ``shape (nnz, *shape[1:])``.

    Napoleon turns a parameter's type into a ``:type x:`` field, where reST would read ``*shape`` as the start
    of emphasis and warn. Runs after napoleon (priority 600 > 500).
    """
    for i, line in enumerate(lines):
        if line.lstrip().startswith(":type ") and "*" in line:
            head, sep, tail = line.partition(": ")
            lines[i] = head + sep + _STAR.sub(r"\\*", tail)


def _repository_links(app, relative_path, parent_docname, content) -> None:
    """Make the links of ../ARCHITECTURE.md (written for the repository, included by architecture.md) fit the site.

    Its links are relative to the repository root, as GitHub shows them: a link into docs/ becomes a link between
    pages, and a link to a file outside the docs (CONTRIBUTING.md, tests/README.md) becomes the file's name.
    """
    if Path(relative_path).name != "ARCHITECTURE.md":
        return
    text = re.sub(r"\]\(\./docs/", "](", content[0])
    content[0] = re.sub(r"\[([^\]]+)\]\(\./[^)]+\)", r"`\1`", text)


class _QuotedLiteralInclude(LiteralInclude):
    """``literalinclude`` whose blocks carry the class ``quoted``: code quoted from the sources keeps its 120
    columns, and the site wraps its long lines (``_static/distlab.css``) instead of scrolling sideways."""

    def run(self):
        nodes = super().run()
        for node in nodes:
            node["classes"].append("quoted")
        return nodes


def _mark_docstring_blocks(app, doctree) -> None:
    """Give the class ``quoted`` to the code blocks of docstrings (autodoc): code quoted from the sources, as the
    ``literalinclude`` blocks."""
    for node in doctree.findall(lambda node: isinstance(node, (literal_block, doctest_block))):
        if "docstring of " in (node.source or node.get("source") or ""):
            node["classes"].append("quoted")


_TAG = re.compile(r"<[^>]+>")


class _LineFormatter(HtmlFormatter):
    """Pygments' HTML with each source line in a ``<span class="line">`` that knows its indentation (``--indent``,
    in characters): where the site's CSS wraps a block (quoted code, outputs), a wrapped line continues four
    characters further in than the line itself starts, so a continuation reads as one."""

    def wrap(self, source):
        def line(html):
            text = _TAG.sub("", html)
            indent = len(text) - len(text.lstrip(" "))
            return f'<span class="line" style="--indent:{indent}">{html}</span>'

        return super().wrap((kind, line(text) if kind == 1 else text) for kind, text in source)


_TABLE = re.compile(r"<table\b.*?</table>", flags=re.S)
_CODE_SPAN = re.compile(r'(<span class="pre">)([^<]*)(</span>)')
_BREAK_AFTER = re.compile(r"(?<=[^\s.(,=/_][.(,=/_])(?=[^\s.(,=/_)])")


def _break_code_in_tables(app, pagename, templatename, context, doctree) -> None:
    """Let a long code name in a table cell wrap after its dots, underscores, opening parentheses, commas, ``=``
    and ``/`` (a ``<wbr>``; never after a leading underscore), so that a column of names such as
    ``distlab.comm.ProcessGroup.allgather_object`` does not push the table wider than the page's column."""
    def split(code):
        opening, text, closing = code.groups()
        return "<wbr>".join(opening + part + closing for part in _BREAK_AFTER.split(text))

    def table(found):
        return _CODE_SPAN.sub(split, found.group(0))

    if "body" in context:
        context["body"] = _TABLE.sub(table, context["body"])


def setup(app):
    PygmentsBridge.html_formatter = _LineFormatter
    app.add_directive("literalinclude", _QuotedLiteralInclude, override=True)
    app.connect("doctree-read", _mark_docstring_blocks)
    app.connect("html-page-context", _break_code_in_tables)
    app.connect("autodoc-process-docstring", _escape_stars_in_types, priority=600)
    app.connect("include-read", _repository_links)
