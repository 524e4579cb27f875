"""Every tutorial in tutorials/ executes from top to bottom, as a notebook, in a real Jupyter kernel.

The tutorials are jupytext percent-format ``.py`` files (``tutorials/NN_name.py``). Each is read with jupytext,
executed with nbclient in an ipykernel kernel running this interpreter, and fails the test with the failing
cell's source and traceback. The kernel works in a temporary directory (so the repository root is not on its
``sys.path``) with matplotlib's Agg backend. Tutorials start MPI jobs with ``distlab.run``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((REPO / "tutorials").glob("[0-9]*.py"))
CELL_TIMEOUT = 120  # seconds a single cell may run before the test fails (a tutorial takes seconds in total)


def test_tutorials_exist():
    assert TUTORIALS, f"no tutorials found in {REPO / 'tutorials'}"


@pytest.mark.mpi
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(path, tmp_path, monkeypatch):
    import jupytext
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = jupytext.read(path, fmt="py:percent")
    assert any(cell.cell_type == "code" for cell in notebook.cells), f"{path.name} has no code cells"
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, startup_timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellTimeoutError as exc:
        pytest.fail(f"{path.name}: a cell ran longer than {CELL_TIMEOUT} s:\n{exc}", pytrace=False)
    except CellExecutionError as exc:
        pytest.fail(f"{path.name}: a cell raised:\n{exc}", pytrace=False)
