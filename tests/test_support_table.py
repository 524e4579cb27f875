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

The rules live in ``docs/_ext/support.py`` (:func:`problems`), which also stops ``make docs`` on a stale cell.
No MPI, no build: it reads the JSON and the test sources (well under a second).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "_data"
_spec = importlib.util.spec_from_file_location("_docs_support", ROOT / "docs" / "_ext" / "support.py")
support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(support)
problems = support.problems


def load(name):
    return json.loads((DATA / f"{name}.json").read_text())


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
