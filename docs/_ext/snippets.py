"""The ``snippet`` directive: a code block of a page that runs when the docs are built, or says why it does not.

A page writes its code as

````md
```{snippet} python
:ranks: 3

import distlab.rpc as rpc
...
```
````

and the build runs it: a ``python`` snippet as a script, on ``:ranks:`` ranks through distlab's own launcher
(``python -m distlab run -n N --timeout T snippet.py``; one plain ``python`` process without ``:ranks:``), a
``sh`` snippet with ``bash -e``; both in a scratch folder that links the repository's top-level entries (so
``python -m distlab run -n 2 examples/train_ddp.py`` works as from the repository root, and what a snippet
writes stays out of the checkout). The page then shows the code, a line saying how it ran, and the output it
printed (``:hide-output:`` drops the output; lines prefixed ``[N]`` by the launcher are grouped by rank between
two of the launcher's own lines, each rank's in the order printed). A snippet that exits with a status other than ``:returncode:`` (0 by
default) or outlasts ``:timeout:`` seconds (60 by default) fails the build, with its output.

``:requires: torch`` runs a snippet only where the named modules import, and says so where they do not.

A block that cannot run says why, and the page shows the reason under it (with ``:recorded: runs/name``, also the
output of a recorded run: ``docs/_data/runs/name.json`` holds ``output``, ``date`` and ``machine``):

````md
```{snippet} sh
:no-run: needs a CUDA GPU

make gpu-check
```
````

Results are cached in ``docs/_build/.snippets``, keyed by the snippet, its options and a hash of distlab's
sources and examples, so a second build runs only what changed. Every snippet runs with the docs' environment
(``DISTLAB_IMPL=reference``, ``DISTLAB_TIMEOUT`` of the build) plus ``:env:`` (``NAME=value`` pairs).

Written here rather than taken from a package: sphinx-exec-code runs a block in one Python process (no launcher,
no ranks, no timeout, no cache across builds), and sphinxcontrib-programoutput runs a command but shows no code
of the page's own and caches within one build only.

The ``doctree-read`` check (:func:`check_blocks`) makes every other code block of a page an error: a block is
either a snippet, code quoted from the sources (``literalinclude``, docstrings: class ``quoted``), a cell of an
executed notebook, or a fence without a language (a diagram or a layout drawn in text, which is not code).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
CACHE = DOCS / "_build" / ".snippets"
#: What a snippet's result depends on besides its own text.
SOURCES = ("src", "reference", "examples")
DEFAULT_TIMEOUT = 60
_RANK_LINE = re.compile(r"^\[(\d+)\] ?")


def sources_hash(folders=SOURCES) -> str:
    """A hash of the Python sources under ``folders`` (relative to the repository)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def parse_env(text: str | None) -> dict[str, str]:
    """``NAME=value NAME2=value2`` (shell quoting allowed) as a dict."""
    pairs = {}
    for item in shlex.split(text or ""):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"an :env: entry must be NAME=value, got {item!r}")
        pairs[name] = value
    return pairs


def group_by_rank(output: str) -> str:
    """The ranks' lines (``[N] ...``) grouped by rank, each rank's in the order printed, between two of the
    launcher's own lines: those keep their place, so a restart's lines stay on their side of it."""
    out, run = [], []
    for line in output.splitlines() + [None]:
        found = _RANK_LINE.match(line) if line is not None else None
        if found:
            run.append((int(found.group(1)), line))
            continue
        out += [text for _, text in sorted(run, key=lambda item: item[0])]  # stable within a rank
        run = []
        if line is not None:
            out.append(line)
    return "\n".join(out)


def command_for(language: str, ranks: int | None, timeout: int) -> list[str]:
    """The command that runs ``snippet.py`` / ``snippet.sh`` in the scratch folder."""
    if language == "python":
        if ranks:
            return [sys.executable, "-m", "distlab", "run", "-n", str(ranks), "--timeout", str(timeout),
                    "snippet.py"]
        return [sys.executable, "-P", "snippet.py"]
    return ["bash", "-e", "snippet.sh"]


def how_it_ran(language: str, ranks: int | None) -> str:
    """The line a page shows under a snippet that ran."""
    if language == "python" and ranks:
        return f"Ran on {ranks} ranks (python -m distlab run -n {ranks}) when these docs were built; it printed:"
    if language == "python":
        return "Ran (one Python process) when these docs were built; it printed:"
    return "Ran from the repository's root when these docs were built; it printed:"


def _scratch(folder: Path) -> None:
    """Link the repository's top-level entries into ``folder``: a shell snippet sees the repository's files
    while what it writes lands in the scratch folder."""
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (folder / entry.name).symlink_to(entry)


def run_snippet(language: str, code: str, ranks: int | None, timeout: int, env: dict[str, str]) -> dict:
    """Run one snippet (uncached): its exit status and output, paths of the scratch folder removed."""
    with tempfile.TemporaryDirectory(prefix="distlab-snippet-") as scratch:
        folder = Path(scratch)
        _scratch(folder)
        (folder / ("snippet.py" if language == "python" else "snippet.sh")).write_text(code)
        run_env = {**os.environ, **env}
        venv_bin = str(Path(sys.executable).parent)
        run_env["PATH"] = venv_bin + os.pathsep + run_env.get("PATH", "")
        run_env.pop("PYTHONPATH", None)
        process = subprocess.Popen(command_for(language, ranks, timeout), cwd=folder, env=run_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout + 30)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            returncode = "timeout"
    output = output.replace(str(folder.resolve()) + "/", "").replace(str(folder) + "/", "")
    output = output.replace(str(ROOT) + "/", "")
    return {"returncode": returncode, "output": group_by_rank(output.rstrip()) if ranks else output.rstrip()}


def cache_path(language: str, code: str, ranks: int | None, timeout: int, env: dict[str, str], stamp: str) -> Path:
    key = hashlib.sha256(json.dumps([language, code, ranks, timeout, sorted(env.items()), stamp,
                                     os.environ.get("DISTLAB_IMPL"), os.environ.get("DISTLAB_TIMEOUT")])
                         .encode()).hexdigest()[:24]
    return CACHE / f"{key}.json"


def cached_run(language: str, code: str, ranks: int | None, timeout: int, env: dict[str, str],
               stamp: str) -> dict:
    path = cache_path(language, code, ranks, timeout, env, stamp)
    if path.exists():
        return json.loads(path.read_text())
    result = run_snippet(language, code, ranks, timeout, env)
    if result["returncode"] != "timeout":
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    return result


_OPENING = re.compile(r"^(`{3,})\{snippet\}\s+(\w+)\s*$")
_OPTION = re.compile(r"^:([\w-]+):\s*(.*)$")


def snippets_of(markdown: str) -> list[tuple[str, dict, str]]:
    """The snippets of a page's source, as the directive reads them: (language, options, code)."""
    found, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        opening = _OPENING.match(lines[i])
        i += 1
        if not opening:
            continue
        fence, language, options, body = opening.group(1), opening.group(2), {}, []
        while i < len(lines) and _OPTION.match(lines[i]):
            name, value = _OPTION.match(lines[i]).groups()
            options[name], i = value, i + 1
        if options and i < len(lines) and not lines[i].strip():
            i += 1
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        found.append((language, options, "\n".join(body) + "\n"))
    return found


def prerun(docs: Path, stamp: str, workers: int) -> int:
    """Run every snippet of the pages whose result is not cached yet, ``workers`` at a time, before Sphinx reads
    the pages one by one (the directive then finds each result cached). Returns how many ran."""
    from concurrent.futures import ThreadPoolExecutor

    todo = []
    for page in sorted(docs.rglob("*.md")):
        if page.parts[len(docs.parts)].startswith("_") or page.name == "README.md":
            continue
        for language, options, code in snippets_of(page.read_text()):
            if "no-run" in options or language not in ("python", "sh"):
                continue
            if any(importlib.util.find_spec(name) is None for name in options.get("requires", "").split()):
                continue
            ranks = int(options["ranks"]) if "ranks" in options else None
            timeout = int(options.get("timeout", DEFAULT_TIMEOUT))
            env = parse_env(options.get("env"))
            if not cache_path(language, code, ranks, timeout, env, stamp).exists():
                todo.append((language, code, ranks, timeout, env, stamp))
    if todo:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(lambda args: cached_run(*args), todo))
    return len(todo)


class snippet_note(nodes.paragraph):
    """The line under a snippet: how it ran, or why it did not."""


class Snippet(SphinxDirective):
    """``{snippet} LANGUAGE``: see the module's docstring."""

    has_content = True
    required_arguments = 1
    option_spec = {
        "ranks": directives.positive_int,
        "no-run": directives.unchanged_required,
        "timeout": directives.positive_int,
        "returncode": int,
        "hide-output": directives.flag,
        "env": directives.unchanged,
        "class": directives.class_option,
        "recorded": directives.unchanged_required,
        "requires": directives.unchanged_required,
    }

    def run(self):
        language = self.arguments[0]
        code = "\n".join(self.content) + "\n"
        block = nodes.literal_block(code.rstrip("\n"), code.rstrip("\n"), language=language,
                                    classes=["snippet-code", *self.options.get("class", [])])
        block["snippet"] = True
        self.set_source_info(block)
        reason = self.options.get("no-run")
        missing = [name for name in self.options.get("requires", "").split()
                   if importlib.util.find_spec(name) is None]
        if reason is None and missing:
            reason = f"needs {', '.join(missing)}, which is not installed where these docs were built"
        if reason is None and language not in ("python", "sh"):
            raise self.error(f"a {language!r} snippet cannot run: give :no-run: with the reason "
                             "(or write it in python or sh)")
        if reason is not None:
            text = f"Not run when the docs are built: {reason}."
            body = [block]
            if "recorded" in self.options:
                record = DOCS / "_data" / (self.options["recorded"] + ".json")
                if not record.exists():
                    raise self.error(f":recorded: {self.options['recorded']}: no docs/_data/"
                                     f"{self.options['recorded']}.json")
                self.env.note_dependency(str(record))
                run = json.loads(record.read_text())
                text += f" Recorded {run['date']} on {run['machine']}; it printed:"
                output = nodes.literal_block(run["output"], run["output"], language="text",
                                             classes=["snippet-output"])
                output["snippet"] = True
                self.set_source_info(output)
            body.append(snippet_note("", "", nodes.Text(text), classes=["snippet-note", "snippet-not-run"]))
            if "recorded" in self.options:
                body.append(output)
            return [nodes.container("", *body, classes=["snippet", "snippet-not-run"])]
        ranks = self.options.get("ranks")
        timeout = self.options.get("timeout", DEFAULT_TIMEOUT)
        try:
            env = parse_env(self.options.get("env"))
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        stamp = self.env.app.config.snippet_sources_stamp
        result = cached_run(language, code, ranks, timeout, env, stamp)
        expected = self.options.get("returncode", 0)
        where = f"{self.env.docname}:{self.lineno}"
        if result["returncode"] != expected:
            status = ("did not finish within its timeout" if result["returncode"] == "timeout"
                      else f"exited {result['returncode']}, not {expected}")
            raise self.error(f"snippet {where} {status}; its output:\n{result['output']}")
        body = [block]
        if "hide-output" in self.options or not result["output"]:
            text = how_it_ran(language, ranks).replace("; it printed:", ("; it printed nothing."
                              if not result["output"] else "."))
            body.append(snippet_note("", "", nodes.Text(text), classes=["snippet-note"]))
        else:
            body.append(snippet_note("", "", nodes.Text(how_it_ran(language, ranks)), classes=["snippet-note"]))
            output = nodes.literal_block(result["output"], result["output"], language="text",
                                         classes=["snippet-output"])
            output["snippet"] = True
            self.set_source_info(output)
            body.append(output)
        self.env.note_dependency(str(DOCS / "_ext" / "snippets.py"))
        return [nodes.container("", *body, classes=["snippet"])]


def _inside(node, classes: set[str]) -> bool:
    parent = node.parent
    while parent is not None:
        if classes & set(parent.get("classes", [])):
            return True
        parent = parent.parent
    return False


#: Containers whose code blocks are an executed notebook's cells (myst-nb).
NOTEBOOK_CLASSES = {"cell_input", "cell_output", "cell"}


def unaccounted_blocks(doctree) -> list:
    """The code blocks of a page that neither run, nor are quoted from the sources, nor are a diagram."""
    found = []
    for node in doctree.findall(lambda n: isinstance(n, (nodes.literal_block, nodes.doctest_block))):
        if node.get("snippet") or "quoted" in node.get("classes", []):
            continue
        if _inside(node, NOTEBOOK_CLASSES):
            continue
        if node.get("language") in (None, "none", "default") and not node.get("highlight_args"):
            continue  # a fence without a language: a diagram drawn in text, not code
        found.append(node)
    return found


def check_blocks(app, doctree) -> None:
    for node in unaccounted_blocks(doctree):
        first = node.astext().splitlines()[0] if node.astext() else ""
        logger.warning("a %s code block that neither runs nor says why not (%r...): write it as "
                       "```{snippet} %s with :ranks: or :no-run: (docs/README.md, 'How to write a page')",
                       node.get("language"), first[:40], node.get("language"), location=node)


def visit_snippet_note(self, node):
    self.body.append(self.starttag(node, "p", CLASS="snippet-note"))


def depart_snippet_note(self, node):
    self.body.append("</p>\n")


def setup(app):
    app.add_config_value("snippet_sources_stamp", "", "env")
    app.add_node(snippet_note, html=(visit_snippet_note, depart_snippet_note))
    app.add_directive("snippet", Snippet)
    app.connect("doctree-read", check_blocks, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
