"""Sphinx configuration of distlab's docs: `make docs` builds them into docs/_build/html (warnings are errors).

The build is offline: no intersphinx, no remote images, notebooks are not executed here (the test suite
executes them: tests/test_tutorials.py). The tutorials live in ../tutorials as jupytext percent-format .py files;
each build converts them into docs/tutorials/*.ipynb (generated, git-ignored) for myst-nb to render.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

# The API reference is generated from the reference twin: it holds the full docstrings (core docstrings are one
# line pointing back to it), and it imports without a compiled core.
os.environ["DISTLAB_IMPL"] = "reference"
os.environ.setdefault("MPLBACKEND", "Agg")

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
]

# Markdown (MyST) pages and notebooks; conf.py, the figure scripts and the README are not pages.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "_scripts", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks are rendered as stored (the tutorials hold no outputs); tests/test_tutorials.py executes them.
nb_execution_mode = "off"

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"distlab {release}"
html_static_path = ["_static"]
pygments_style = "sphinx"

# Warnings are errors (-W); these are the ones that say nothing about our docs.
suppress_warnings = ["myst.header"]


def _convert_tutorials() -> None:
    """Write docs/tutorials/<name>.ipynb from each ../tutorials/<name>.py (jupytext percent format)."""
    import jupytext

    out_dir = DOCS / "tutorials"
    out_dir.mkdir(exist_ok=True)
    sources = sorted((ROOT / "tutorials").glob("[0-9]*.py"))
    wanted = {src.stem + ".ipynb" for src in sources}
    for stale in out_dir.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for src in sources:
        target = out_dir / (src.stem + ".ipynb")
        if target.exists() and target.stat().st_mtime >= src.stat().st_mtime:
            continue
        notebook = jupytext.read(src, fmt="py:percent")
        jupytext.write(notebook, target, fmt="ipynb")


# Before Sphinx looks for source files.
_convert_tutorials()

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


def setup(app):
    app.connect("autodoc-process-docstring", _escape_stars_in_types, priority=600)
