"""The support table (``docs/_data/support.json``, drawn on ``docs/support.md``) is current.

Every cell of every component (numpy, cupy staged, CUDA IPC, NCCL, CUDA-aware MPI) has a status from the page's
list, and:

- every test it names exists (a ``def`` of that name in that file);
- a cell marked *tested* names a test, and each named test touches the cell's path: its source (decorators
  included), or a scenario script under ``tests/mpi`` it launches (and the sibling modules that script imports),
  mentions the stand-in for a device cell and the path's own words for a transport cell (:data:`PATH_WORDS`);
- a path the component's tests run is not marked *untested*, *not implemented* or *not applicable*: a test of
  the component's test files whose source (or a constant of its file it uses) selects that transport
  (``DISTLAB_DEVICE_COMM=ipc``, ``device_comm == "nccl"``, ``DISTLAB_CUDA_AWARE=1``, the device world whose
  groups ``auto`` puts on ipc: :data:`RUNS_PATH`) makes such a cell stale;
- no cell claims a GPU run: a GPU test counts as run only where ``docs/_data/gpu_runs.json`` records it.

No MPI, no build: it reads the JSON and the test sources (well under a second).
"""
from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "_data"
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


def load(name):
    return json.loads((DATA / f"{name}.json").read_text())


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


def test_every_cell_is_current():
    assert problems(load("support"), load("gpu_runs")) == []


def _with(support, component, column, **cell):
    changed = json.loads(json.dumps(support))
    for entry in changed["components"]:
        if entry["name"] == component:
            entry["cells"][column] = cell
    return changed


@pytest.mark.parametrize("component, column, cell, words", [
    # the stale cell the table once had: DDP through CUDA IPC "not implemented" while its tests run it
    ("DDP reducer", "ipc", {"status": "not implemented"}, "runs it"),
    ("DDP reducer", "numpy", {"status": "tested", "tests": ["tests/test_ddp_mpi.py::test_no_such_test"]},
     "does not exist"),
    ("DDP reducer", "ipc", {"status": "tested on the stand-in",
                            "tests": ["tests/test_ddp_mpi.py::test_twins_are_bit_identical_with_identical_traces"]},
     "never touches this path"),
    ("RPC and RRefs", "staged", {"status": "tested"}, "names no test"),
    ("RPC and RRefs", "nccl", {"status": "works"}, "is not one of"),
    ("comm collectives", "staged", {"status": "tested on the stand-in", "note": "ran on an H100",
                                    "tests": ["tests/test_device_mpi.py::test_every_component_section_ran_on_the_device"]},
     "GPU run claimed"),
])
def test_a_stale_cell_is_named(component, column, cell, words):
    found = problems(_with(load("support"), component, column, **cell), load("gpu_runs"))
    assert found and all(p.startswith(f"{component} x {column}: ") and words in p for p in found), found
