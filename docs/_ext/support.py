"""The support table, drawn from ``docs/_data/support.json``: one short table per component, each cell linking
to the tests that run it.

``write(docs)`` (called by ``conf.py`` before Sphinx reads the sources) writes

- ``docs/_generated/support.md``: per component, a heading and a table of its array types and device paths
  (numpy, cupy staged, CUDA IPC, NCCL, CUDA-aware MPI): the status, what the cell covers, and links to its tests;
  ``support.md`` includes it;
- ``docs/tests/<file>.md`` (git-ignored): each test a cell names, its source quoted (``literalinclude
  :pyobject:``), under an anchor the cells link to, so a reader goes from a cell to the test that proves it.

A GPU test (``gpu_tests``) counts as run only where ``docs/_data/gpu_runs.json`` records a device run that passed
it; otherwise the cell says it has not run on a GPU yet. ``tests/test_support_table.py`` (in ``make test``) keeps
the table current: see its docstring for the rules.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

#: The statuses a cell may have.
STATUSES = ("tested", "tested on the stand-in", "untested", "refused", "not implemented", "not applicable")


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
