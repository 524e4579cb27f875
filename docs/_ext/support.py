"""The support table, drawn from ``docs/_data/support.json``: one short table per component, each cell linking
to the tests that run it.

``write(docs)`` (called by ``conf.py`` before Sphinx reads the sources) writes

- ``docs/_generated/support.md``: per component, a heading and a table of its array types and device paths
  (numpy, cupy staged, CUDA IPC, NCCL, CUDA-aware MPI): the status, what the cell covers, and links to its tests;
  ``support.md`` includes it;
- ``docs/tests/<file>.md`` (git-ignored): each test a cell names, its source quoted (``literalinclude
  :pyobject:``), under an anchor the cells link to, so a reader goes from a cell to the test that proves it.

A GPU test (``gpu_tests``) counts as run only where ``docs/_data/gpu_runs.json`` records a device run that passed
it; otherwise the cell says it has not run on a GPU yet. :func:`problems` finds a stale cell (the rules are in
``tests/test_support_table.py``'s docstring): ``write`` stops the docs build on one, and ``make test`` fails on
one (``tests/test_support_table.py``).
"""
from __future__ import annotations

import ast
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

#: The statuses a cell may have.
STATUSES = ("tested", "tested on the stand-in", "untested", "refused", "not implemented", "not applicable")

#: What a named test's source must mention to count as running the cell's path.
PATH_WORDS = {
    "numpy": None,
    "staged": r"fake|stand-in|DEVICE_WORLD|device",
    "ipc": r"(?i)ipc",
    "nccl": r"\bnccl\b|hierarchical",
    "mpi": r"CUDA_AWARE|cuda_aware|device pointers|per_transport",
}
#: What in a test's source (or its scenarios) selects a transport: a test that matches runs that path.
RUNS_PATH = {
    # DISTLAB_TEST_DEVICE_WORLD: the scenario registers the stand-in first, and auto picks ipc for its groups
    "ipc": r"""DEVICE_COMM["']?\s*[:=,]\s*["']ipc|device_comm\s*==\s*["']ipc|TEST_DEVICE_WORLD""",
    "nccl": r"""DEVICE_COMM["']?\s*[:=,]\s*["'](nccl|hierarchical)|device_comm\s*==\s*["'](nccl|hierarchical)""",
    "mpi": r"""CUDA_AWARE["']?\s*[:=,]\s*["']1|device_comm\s*==\s*["']mpi""",
}


@functools.lru_cache(maxsize=None)
def module_text(path: Path) -> str:
    """A test file's code outside its functions and classes: the constants its tests pass on."""
    text = path.read_text()
    lines = text.splitlines()
    return "\n".join("\n".join(lines[node.lineno - 1:node.end_lineno]) for node in ast.parse(text).body
                     if isinstance(node, (ast.Assign, ast.AnnAssign)))


@functools.lru_cache(maxsize=None)
def functions(path: Path) -> dict[str, str]:
    """Each top-level test function of a file, by name: its source with its decorators."""
    text = path.read_text()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            found[node.name] = "\n".join(text.splitlines()[start:node.end_lineno])
    return found


@functools.lru_cache(maxsize=None)
def scenario_text(source: str, mpi_dir: Path) -> str:
    """The scenario scripts a test's source launches (``name.py`` under tests/mpi), and the sibling modules
    they import, one level down, as one text."""
    seen, texts = set(), []
    for name in re.findall(r"\b(\w+)\.py\b", source):
        path = mpi_dir / f"{name}.py"
        if path.exists() and name not in seen:
            seen.add(name)
            text = path.read_text()
            texts.append(text)
            for module in re.findall(r"^(?:from|import) (\w+)", text, flags=re.M):
                sibling = mpi_dir / f"{module}.py"
                if sibling.exists() and module not in seen:
                    seen.add(module)
                    texts.append(sibling.read_text())
    return "\n".join(texts)


def evidence(test_id: str, root: Path) -> str | None:
    """A named test's source and its scenarios' text; None when the test does not exist."""
    path, _, name = test_id.partition("::")
    if not (root / path).exists():
        return None
    source = functions(root / path).get(name)
    if source is None:
        return None
    return source + "\n" + scenario_text(source, root / "tests" / "mpi")


def problems(support: dict, gpu_runs: dict, root: Path = ROOT) -> list[str]:
    """Every stale or ill-formed cell, as '<component> x <column>: why'."""
    found = []
    recorded = {test for run in gpu_runs.get("runs", []) for test in run.get("passed", [])}
    for component in support["components"]:
        for column in support["columns"]:
            where = f"{component['name']} x {column}"
            cell = component["cells"].get(column)
            if cell is None:
                found.append(f"{where}: no cell")
                continue
            if cell["status"] not in STATUSES:
                found.append(f"{where}: status {cell['status']!r} is not one of {STATUSES}")
            tests = cell.get("tests", [])
            if cell["status"].startswith("tested") and not tests:
                found.append(f"{where}: marked {cell['status']!r} but names no test")
            for test in tests + cell.get("gpu_tests", []):
                text = evidence(test, root)
                if text is None:
                    found.append(f"{where}: {test} does not exist")
                elif test in tests and PATH_WORDS[column] and not re.search(PATH_WORDS[column], text):
                    found.append(f"{where}: {test} never touches this path (no {PATH_WORDS[column]!r})")
            if re.search(r"\b(ran|passed|tested) on (a|an|the) (GPU|H100|H200|device)\b", cell.get("note", "")):
                found.append(f"{where}: a GPU run claimed in the note; record it in gpu_runs.json instead")
            for test in cell.get("gpu_tests", []):
                if test in recorded and "not yet" in cell.get("note", ""):
                    found.append(f"{where}: {test} passed on a GPU, the note says not yet")
            if column in RUNS_PATH and cell["status"] in ("untested", "not implemented", "not applicable"):
                for path in component.get("test_files", []):
                    if not (root / path).exists():
                        found.append(f"{where}: test file {path} does not exist")
                        continue
                    constants = module_text(root / path)
                    for name, source in functions(root / path).items():
                        # the test's own code and the constants it names: what it sets, not what a shared
                        # scenario does when some other test sets it
                        used = "\n".join(line for line in constants.splitlines()
                                         if re.match(r"\s*(\w+)", line) and re.match(r"\s*(\w+)", line).group(1)
                                         in source)
                        if name.startswith("test") and re.search(RUNS_PATH[column], source + "\n" + used):
                            found.append(f"{where}: marked {cell['status']!r}, but {path}::{name} runs it")
    return found


def load(docs: Path) -> tuple[dict, dict]:
    data = json.loads((docs / "_data" / "support.json").read_text())
    runs = json.loads((docs / "_data" / "gpu_runs.json").read_text())
    return data, runs


def anchor(test_id: str) -> str:
    """The label of a test on its page: ``tests/test_x.py::test_y`` -> ``test-x-test-y``."""
    path, _, name = test_id.partition("::")
    return re.sub(r"[^a-z0-9]+", "-", f"{Path(path).stem}-{name}".lower()).strip("-")


def words(test_id: str) -> str:
    """A test's name as a link shows it: ``test_comm_mpi: collectives`` (words break where a name cannot)."""
    path, _, name = test_id.partition("::")
    return f"{Path(path).stem}: {name.removeprefix('test_').replace('_', ' ')}"


def passed_on_gpu(test_id: str, runs: dict) -> list[dict]:
    return [run for run in runs.get("runs", []) if test_id in run.get("passed", [])]


def cell_text(cell: dict, runs: dict) -> tuple[str, str]:
    """(status, the rest: what the cell covers and its test links) as Markdown."""
    parts = []
    if cell.get("note"):
        parts.append(cell["note"])
    links = ", ".join(f"{{ref}}`{words(test)} <{anchor(test)}>`" for test in cell.get("tests", []))
    if links:
        parts.append(links)
    for test in cell.get("gpu_tests", []):
        done = passed_on_gpu(test, runs)
        where = "; ".join(f"passed {run['date']} on {run['device']}" for run in done) or "not yet run on a GPU"
        parts.append(f"on a GPU: {{ref}}`{words(test)} <{anchor(test)}>` ({where})")
    return cell["status"], "; ".join(parts)


def support_markdown(data: dict, runs: dict) -> str:
    out = []
    for component in data["components"]:
        out += [f"### {component['name']}", "",
                f"{{mod}}`{component['module']}`", "",
                "| arrays, path | status | what runs it |", "| --- | --- | --- |"]
        for key, title in data["columns"].items():
            status, rest = cell_text(component["cells"][key], runs)
            out.append(f"| {title} | **{status}** | {rest} |")
        out.append("")
    return "\n".join(out)


def named_tests(data: dict) -> dict[str, list[str]]:
    """Every test a cell names, by file."""
    by_file: dict[str, list[str]] = {}
    for component in data["components"]:
        for cell in component["cells"].values():
            for test in cell.get("tests", []) + cell.get("gpu_tests", []):
                path, _, name = test.partition("::")
                if name not in by_file.setdefault(path, []):
                    by_file[path].append(name)
    return by_file


def test_pages(data: dict) -> dict[str, str]:
    """``docs/tests/<stem>.md`` contents: each named test's source under its anchor."""
    pages = {}
    for path, names in sorted(named_tests(data).items()):
        lines = ["---", "orphan: true", "---", "", f"# `{path}`", "",
                 f"The tests of `{path}` that the {{ref}}`support table <support-table>` names, quoted from the "
                 "repository. Run one with `.venv/bin/python -P -m pytest -q "
                 f"{path}::NAME`.", ""]
        for name in names:
            lines += [f"({anchor(path + '::' + name)})=", f"## `{name}`", "",
                      f"```{{literalinclude}} ../../{path}", ":language: python", f":pyobject: {name}", "```", ""]
        pages[Path(path).stem] = "\n".join(lines)
    return pages


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:  # an unchanged file keeps its mtime: no rebuild
        path.write_text(text)


def write(docs: Path) -> None:
    data, runs = load(docs)
    stale = problems(data, runs)
    if stale:
        message = ("docs/_data/support.json: stale cells (tests/test_support_table.py explains the rules):\n  "
                   + "\n  ".join(stale))
        print(message, file=sys.stderr)
        raise SystemExit(message)
    generated = docs / "_generated"
    generated.mkdir(exist_ok=True)
    _write_if_changed(generated / "support.md", support_markdown(data, runs))
    folder = docs / "tests"
    folder.mkdir(exist_ok=True)
    pages = test_pages(data)
    for stale in folder.glob("*.md"):
        if stale.stem not in pages:
            stale.unlink()
    for stem, text in pages.items():
        _write_if_changed(folder / f"{stem}.md", text)
